"""Fused twin of kernels/corpus/transformer_block_tiled_qkv.py: the whole pre-norm transformer block is one call,
`ext.transformer_block(...)` (kernels/fused/fused_ops.cpp), so diffkit sees only input -> output.

Broken on purpose, as the original: every Linear (qkv, proj, fc1, fc2) runs over the 24 flattened tokens in
16-row tiles; the ragged last tile re-reads the full tile that ends at the last row but stores it from the
top, so tokens 16..23 get the projections of tokens 8..15.  The first wrong reference stage is qkv."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["TRANSFORMER_BLOCK"]["tiled_tail_rows"]

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "output", "kind": "boundary", "what_if": None,
                  "what_if_note": "rows 16..23 of the qkv projection hold rows 8..15 (a ragged tile read from the wrong "
                                  "rows, in every Linear): wrong data copied from elsewhere, not zeros (unwritten_tail) "
                                  "nor any other catalogue kind"}


class ModelNew(nn.Module):
    def __init__(self, dim, heads, mlp_ratio):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x):
        return ext.transformer_block(x, self.ln1.weight, self.ln1.bias, self.ln1.eps, self.qkv.weight, self.qkv.bias,
                                     self.proj.weight, self.proj.bias, self.ln2.weight, self.ln2.bias, self.ln2.eps,
                                     self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.heads, BUG)
