"""Axial attention, correct: one module-level `_mixer` serves both axes; LayerNorm+QKV is one C++
call (`ext.norm_project`), attention is two einsums, the output projection is F.linear, and the
residual is added by the caller, not inside the helper.  The parameters live in a ModuleList of
(norm, qkv, out) triples, created in the reference's order so that seeded construction gives the
reference's values."""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "verdict": "match"}


def _mixer(seq, block, heads):
    """Multi-head self-attention over the middle axis of seq [n, L, D]; returns the update only."""
    norm, qkv, out = block
    n, L, D = seq.shape
    d = D // heads
    t = ext.norm_project(seq, norm.weight, norm.bias, norm.eps, qkv.weight, qkv.bias)
    q, k, v = t.view(n, L, 3, heads, d).unbind(2)
    w = torch.einsum("nihc,njhc->nhij", q, k) / math.sqrt(d)
    w = w.softmax(dim=-1)
    t = torch.einsum("nhij,njhc->nihc", w, v).reshape(n, L, D)
    return F.linear(t, out.weight, out.bias)


class ModelNew(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.axes = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)]) for _ in range(2))

    def forward(self, x):
        b, H, W, D = x.shape
        x = x + _mixer(x.reshape(b * H, W, D), self.axes[0], self.heads).view(b, H, W, D)
        cols = x.transpose(1, 2).reshape(b * W, H, D)
        x = x + _mixer(cols, self.axes[1], self.heads).view(b, W, H, D).transpose(1, 2)
        return x
