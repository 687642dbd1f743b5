"""Pre-norm transformer block: LayerNorm+QKV fused in one C++ call (`ext.norm_project`), attention
in torch on a [b*h, s, d] layout, the output projection through a C++ dense layer
(`ext.dense(ctx, self.proj.weight, self.proj.bias)`), the MLP as nested F calls passed inline.

Broken on purpose: `dense` was written for a weight stored [in, out] (y = x W + b), but nn.Linear
stores [out, in]; the projection is square, so nothing fails and it computes x W + b instead of
x W^T + b.  First wrong stage: the output projection."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "proj", "kind": "transposed_weight"}


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
        y = ext.norm_project(x, self.ln1.weight, self.ln1.bias, self.ln1.eps, self.qkv.weight, self.qkv.bias)
        y = y.reshape(b, s, 3, h, D // h).permute(2, 0, 3, 1, 4).reshape(3, b * h, s, D // h)
        y = torch.bmm(torch.softmax(torch.bmm(y[0], y[1].transpose(1, 2)) * (D // h) ** -0.5, dim=-1), y[2])
        y = y.view(b, h, s, D // h).transpose(1, 2).reshape(b, s, D)
        x = x + ext.dense(y, self.proj.weight, self.proj.bias)
        return x + F.linear(F.gelu(F.linear(F.layer_norm(x, (D,), self.ln2.weight, self.ln2.bias, self.ln2.eps),
                                            self.fc1.weight, self.fc1.bias)), self.fc2.weight, self.fc2.bias)
