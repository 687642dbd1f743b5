"""Fused twin of kernels/transformer_block_triton_tail.py (Triton there, CUDA here): the whole pre-norm
transformer block is one call, `ext.transformer_block(...)` (kernels/fused/fused_cuda.cu), so diffkit sees
only input -> output.

Broken on purpose, as the original: the attention softmax kernel handles 5 rows per block and is launched on
n_rows // 5 blocks, so the last n_rows % 5 rows of the flattened [96, 12] attention weights (1 row: batch 1,
head 3, query 11) are never written.  The original leaves them uninitialised (torch.empty_like); here the
buffer is zeroed first, so the output is deterministic."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load_cuda"]()
BUG = _ops["TRANSFORMER_BLOCK"]["softmax_rows_of_5_floor"]

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "output", "kind": "unwritten_region", "device": "cuda",
                  "what_if": None,
                  "what_if_note": "the unwritten tail is the last partial block of a 5-row block (1 of 96 rows); the "
                                  "catalogue's unwritten_tail assumes a power-of-two block, and no power-of-two block "
                                  "leaves exactly that row (96 is a multiple of 32)"}


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
