"""Pre-norm transformer block whose MLP input stage (LayerNorm -> fc1 -> GELU) is one C++ kernel,
`ext.ln_mlp_in(x, gamma, beta, eps, W)`.  The parameters have their own names (norm1, attn_in,
attn_out, norm2, mlp_in, mlp_out), created in the reference's order; attention is plain matmuls
on `.t()` weights with `y` reused.

Broken on purpose: the fused kernel was written without a bias argument, so fc1's bias is never
added (before the GELU).  Everything up to the second LayerNorm is right; the first wrong
reference stage is fc1, which the kernel computes internally and never returns."""
import math
import os

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "fc1", "kind": "missing_bias"}


class ModelNew(nn.Module):
    def __init__(self, dim, heads, mlp_ratio):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.attn_in = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp_in = nn.Linear(dim, mlp_ratio * dim)
        self.mlp_out = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x):
        b, s, D = x.shape
        h, d = self.heads, D // self.heads
        y = ext.layer_norm(x, self.norm1.weight, self.norm1.bias, self.norm1.eps)
        y = y @ self.attn_in.weight.t() + self.attn_in.bias
        q, k, v = y.view(b, s, 3, h, d).transpose(1, 3).unbind(2)  # each [b, h, s, d]
        y = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, s, D) @ self.attn_out.weight.t() + self.attn_out.bias
        x = x + y
        y = ext.ln_mlp_in(x, self.norm2.weight, self.norm2.bias, self.norm2.eps, self.mlp_in.weight)
        y = y @ self.mlp_out.weight.t() + self.mlp_out.bias
        return x + y
