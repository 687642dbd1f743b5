"""Pre-norm transformer block with the attention logits from a C++ kernel
(`ext.qk_logits(q, k, scale)`: q @ k^T and the 1/sqrt(d) scale in one call); heads are split with
einsum straight from the QKV weight viewed as [3, h, d, D], so no [b, s, 3D] tensor exists.

Broken on purpose: the kernel stores logit (i, j) at [j, i]: the scores come out transposed in
their last two axes."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "forward:scores", "kind": "permutation"}


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
        d = D // h
        xn = F.layer_norm(x, (D,), self.ln1.weight, self.ln1.bias, self.ln1.eps)
        w = self.qkv.weight.view(3, h, d, D)
        bias = self.qkv.bias.view(3, 1, h, 1, d)
        q, k, v = torch.einsum("bsD,thdD->tbhsd", xn, w) + bias
        p = ext.qk_logits(q, k, d ** -0.5).softmax(dim=-1)
        ctx = torch.einsum("bhst,bhtd->bshd", p, v).reshape(b, s, D)
        x = x + self.proj(ctx)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
