"""Axial attention where the scores come straight from the packed QKV projection: one C++ call
(`ext.packed_scores`) splits q and k out of the [n, L, 3D] projection, takes q.k per head and
scales it, so it stands for the reference's head split, q @ k^T and the division by sqrt(d).
A module-level helper `_axial` takes the axis' submodule; the submodules have their own names.

Broken on purpose: the kernel scales by 1/sqrt(D) with D the model width (32) instead of the head
width d = D / heads (8), so the row block's scores are half what they should be."""
import os

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn._attn:scores", "kind": "scale"}


class _Axis(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.proj_in = nn.Linear(dim, 3 * dim)
        self.proj_out = nn.Linear(dim, dim)


def _axial(seq, ax, heads):
    n, L, D = seq.shape
    packed = ax.proj_in(ax.ln(seq))
    probs = torch.softmax(ext.packed_scores(packed, heads), dim=-1)
    v = packed[..., 2 * D:].reshape(n, L, heads, D // heads).transpose(1, 2)
    mixed = (probs @ v).transpose(1, 2).reshape(n, L, D)
    return seq + ax.proj_out(mixed)


class ModelNew(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.along_w = _Axis(dim)
        self.along_h = _Axis(dim)

    def forward(self, x):
        b, H, W, D = x.shape
        y = _axial(x.reshape(b * H, W, D), self.along_w, self.heads).reshape(b, H, W, D)
        y = _axial(y.transpose(1, 2).reshape(b * W, H, D), self.along_h, self.heads)
        return y.reshape(b, W, H, D).transpose(1, 2)
