"""Pre-norm transformer block, correct.  The MLP's LayerNorm -> fc1 -> GELU is one C++ call
(`ext.ln_linear_gelu`, three reference stages); the QKV projection is an einsum on the output of
the C++ LayerNorm passed inline; attention is F.scaled_dot_product_attention; the output
projection and fc2 are F.linear with the modules' weights."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "verdict": "match"}


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
        h = self.heads
        qkv = torch.einsum("bsd,ed->bse", ext.layer_norm(x, self.ln1.weight, self.ln1.bias, self.ln1.eps),
                           self.qkv.weight) + self.qkv.bias
        q, k, v = qkv.view(b, s, 3, h, D // h).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v)
        x = x + F.linear(ctx.transpose(1, 2).reshape(b, s, D), self.proj.weight, self.proj.bias)
        return x + F.linear(ext.ln_linear_gelu(x, self.ln2.weight, self.ln2.bias, self.ln2.eps, self.fc1.weight,
                                               self.fc1.bias), self.fc2.weight, self.fc2.bias)
