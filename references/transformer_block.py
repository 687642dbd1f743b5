"""A pre-norm transformer block: x + Attn(LN1(x)), then x + MLP(LN2(x)), GELU MLP (erf form)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
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
        b, s, dim = x.shape
        h = self.heads
        d = dim // h
        y = self.ln1(x)
        qkv = self.qkv(y).reshape(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d))
        attn = torch.softmax(scores, dim=-1)
        ctx = (attn @ v).transpose(1, 2).reshape(b, s, dim)
        x = x + self.proj(ctx)
        y = self.ln2(x)
        hidden = F.gelu(self.fc1(y))
        x = x + self.fc2(hidden)
        return x


batch, seq, dim, heads, mlp_ratio = 2, 12, 32, 4, 4


def get_inputs():
    return [torch.randn(batch, seq, dim)]


def get_init_inputs():
    return [dim, heads, mlp_ratio]
