"""Pre-norm transformer block on a flat [b*s, D] token matrix with every projection through one
C++ row-tiled GEMM (`ext.linear_tiled`, 16-row tiles) and the LayerNorms through `ext.layer_norm`,
results passed inline; attention in torch.

Broken on purpose: for a ragged last tile (24 tokens = 16 + 8) the kernel re-reads the full tile
that ends at the last row, to keep its loads in bounds, but stores the rows from the top of that
tile: tokens 16..23 get the projections of tokens 8..15.  The first projection, QKV, is the first
wrong stage."""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "qkv", "kind": "boundary"}


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
        b, s, D = x.shape
        h, d = self.heads, D // self.heads
        tokens = x.reshape(b * s, D)
        qkv = ext.linear_tiled(ext.layer_norm(tokens, self.ln1.weight, self.ln1.bias, self.ln1.eps),
                               self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
        a = F.softmax(q @ k.transpose(2, 3) / math.sqrt(d), dim=3)
        ctx = (a @ v).permute(0, 2, 1, 3).reshape(b * s, D)
        tokens = tokens + ext.linear_tiled(ctx, self.proj.weight, self.proj.bias)
        hid = F.gelu(ext.linear_tiled(ext.layer_norm(tokens, self.ln2.weight, self.ln2.bias, self.ln2.eps),
                                      self.fc1.weight, self.fc1.bias))
        tokens = tokens + ext.linear_tiled(hid, self.fc2.weight, self.fc2.bias)
        return tokens.view(b, s, D)
