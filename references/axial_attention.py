"""Axial attention: multi-head self-attention along the rows of a 2-D grid, then along its columns.

x: [B, H, W, D].  Each axial block is pre-norm attention with a residual:
    y = x + out_proj(softmax(q k^T / sqrt(d)) v),  q, k, v = split(qkv_proj(LayerNorm(x)))
The row block attends over W for every (b, h); the column block over H for every (b, w).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class AxialBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.norm = nn.LayerNorm(dim)
        self.qkv_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def _attn(self, x):
        # x: [N, L, D] -- N independent sequences of length L
        n, length, dim = x.shape
        h, d = self.heads, self.head_dim
        x_norm = self.norm(x)
        qkv = self.qkv_proj(x_norm)
        qkv = qkv.view(n, length, 3, h, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        attn = F.softmax(scores, dim=-1)
        ctx = attn @ v
        ctx = ctx.transpose(1, 2).reshape(n, length, dim)
        out = self.out_proj(ctx)
        return x + out


class RowAttention(AxialBlock):
    def forward(self, x):
        b, hgt, wid, dim = x.shape
        rows = x.reshape(b * hgt, wid, dim)
        y = self._attn(rows)
        return y.reshape(b, hgt, wid, dim)


class ColumnAttention(AxialBlock):
    def forward(self, x):
        b, hgt, wid, dim = x.shape
        cols = x.permute(0, 2, 1, 3).reshape(b * wid, hgt, dim)
        y = self._attn(cols)
        return y.reshape(b, wid, hgt, dim).permute(0, 2, 1, 3)


class Model(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.row_attn = RowAttention(dim, heads)
        self.col_attn = ColumnAttention(dim, heads)

    def forward(self, x):
        x = self.row_attn(x)
        x = self.col_attn(x)
        return x


batch, height, width, dim, heads = 2, 6, 10, 32, 4


def get_inputs():
    return [torch.randn(batch, height, width, dim)]


def get_init_inputs():
    return [dim, heads]
