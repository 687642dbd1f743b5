"""Axial attention with CUDA kernels, written the way the first seed's author wrote it: one
`_attend` helper serves the row and the column pass, a fused LayerNorm+QKV kernel (`ext.ln_qkv`)
and an output-projection kernel (`ext.proj`), attention itself in torch; the parameters are
row_norm/row_qkv/row_out then col_*, created in the reference's order.

Broken on purpose (the first seed's bug): the output-projection kernel was written without a
bias argument, `ext.proj(o, out.weight)`, so `out_proj`'s bias is never added."""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_cuda", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                             "corpus_cuda.cu")],
           extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn.out_proj", "kind": "missing_bias",
                  "device": "cuda"}


class ModelNew(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.row_norm = nn.LayerNorm(dim)
        self.row_qkv = nn.Linear(dim, 3 * dim)
        self.row_out = nn.Linear(dim, dim)
        self.col_norm = nn.LayerNorm(dim)
        self.col_qkv = nn.Linear(dim, 3 * dim)
        self.col_out = nn.Linear(dim, dim)

    def _attend(self, x, norm, qkv, out):
        n, L, D = x.shape
        h, d = self.heads, self.head_dim
        t = ext.ln_qkv(x.reshape(n * L, D).contiguous(), norm.weight, norm.bias, norm.eps, qkv.weight, qkv.bias)
        q, k, v = t.view(n, L, 3, h, d).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        a = F.softmax((q @ k.transpose(-1, -2)) * self.scale, dim=-1)
        o = (a @ v).transpose(1, 2).reshape(n * L, D).contiguous()
        return ext.proj(o, out.weight).view(n, L, D)

    def forward(self, x):
        B, H, W, D = x.shape
        x = x + self._attend(x.reshape(B * H, W, D), self.row_norm, self.row_qkv, self.row_out).reshape(B, H, W, D)
        cols = x.permute(0, 2, 1, 3).reshape(B * W, H, D)
        x = x + self._attend(cols, self.col_norm, self.col_qkv, self.col_out).reshape(B, W, H, D).permute(0, 2, 1, 3)
        return x
