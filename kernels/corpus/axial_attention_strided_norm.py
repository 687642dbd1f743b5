"""Axial attention on the 4-D grid without reshaping to sequences: one `_pass` helper attends along
W (rows) or H (columns); for the column pass it hands the C++ LayerNorm a transposed view of the
grid, which the kernel reads through its strides.  Projections are F.linear on the modules' tensors,
attention two einsums; the parameters sit in two ModuleDicts created in the reference's order.

Broken on purpose: the kernel's strided path (taken only by the non-contiguous column view)
normalises as (mean - x) instead of (x - mean); the contiguous row pass is right, so the first
wrong tensor is the column block's LayerNorm, negated (beta is zero)."""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "col_attn.norm", "kind": "sign"}


def _pass(x, p, heads, axis):
    """x [B, H, W, D]; attend along W when axis == 2, along H when axis == 1."""
    g = x if axis == 2 else x.transpose(1, 2)  # [B, A, L, D]: L is the attended axis
    B, A, L, D = g.shape
    d = D // heads
    t = ext.layer_norm_nd(g, p["ln"].weight, p["ln"].bias, p["ln"].eps)
    t = F.linear(t, p["qkv"].weight, p["qkv"].bias)
    q, k, v = t.view(B, A, L, 3, heads, d).unbind(3)
    w = torch.einsum("balhc,bamhc->bahlm", q, k).mul(1.0 / math.sqrt(d)).softmax(-1)
    o = torch.einsum("bahlm,bamhc->balhc", w, v).reshape(B, A, L, D)
    o = F.linear(o, p["out"].weight, p["out"].bias)
    return x + (o if axis == 2 else o.transpose(1, 2))


class ModelNew(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.row = nn.ModuleDict({"ln": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "out": nn.Linear(dim, dim)})
        self.col = nn.ModuleDict({"ln": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "out": nn.Linear(dim, dim)})

    def forward(self, x):
        return _pass(_pass(x, self.row, self.heads, 2), self.col, self.heads, 1)
