"""Axial attention with a C++ softmax over the attention scores.  One `attention` method serves
both blocks; projections are `@ W.t() + b` on the modules' tensors, with `t` reused for every
intermediate.  Parameters have their own names (ln_r, wqkv_r, wo_r, then the column set), created
in the reference's order.

Broken on purpose: `ext.attn_softmax` normalises each column of the [Lq, Lk] score matrix (over
the query axis) instead of each row: the first wrong tensor is the row block's attention weights."""
import math
import os

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn._attn:attn", "kind": "wrong_reduction_axis"}


class ModelNew(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.ln_r, self.wqkv_r, self.wo_r = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln_c, self.wqkv_c, self.wo_c = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def attention(self, s, ln, wqkv, wo):
        n, L, D = s.shape
        h = self.heads
        t = ext.layer_norm(s, ln.weight, ln.bias, ln.eps)
        t = t @ wqkv.weight.t() + wqkv.bias
        t = t.reshape(n, L, 3, h, D // h).permute(2, 0, 3, 1, 4)
        q, k, v = t[0], t[1], t[2]
        p = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        p = ext.attn_softmax(p)
        t = torch.matmul(p, v).permute(0, 2, 1, 3).reshape(n, L, D)
        t = t @ wo.weight.t() + wo.bias
        return s + t

    def forward(self, x):
        b, H, W, D = x.shape
        x = self.attention(x.reshape(b * H, W, D), self.ln_r, self.wqkv_r, self.wo_r).reshape(b, H, W, D)
        x = self.attention(x.permute(0, 2, 1, 3).reshape(b * W, H, D), self.ln_c, self.wqkv_c, self.wo_c)
        return x.reshape(b, W, H, D).permute(0, 2, 1, 3)
