"""Fused twin of kernels/corpus/transformer_block_dense_proj.py: the whole pre-norm transformer block is one
call, `ext.transformer_block(...)` (kernels/fused/fused_ops.cpp), so diffkit sees only input -> output.

Broken on purpose, as the original: the attention output projection reads the square [out, in] weight as [in,
out]: it computes x W + b instead of x W^T + b."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["TRANSFORMER_BLOCK"]["proj_read_as_in_out"]

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "output", "kind": "transposed_weight",
                  "what_if": {"kind": "transposed_weight", "stage": "proj"}}


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
