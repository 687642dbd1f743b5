"""A deep pre-norm transformer: a stack of `depth` blocks (the scale benchmark's model).

Size from the environment, so the same file serves the CPU test and the H200 benchmark:
DIFFKIT_DEPTH (24), DIFFKIT_BATCH (2), DIFFKIT_SEQ (128), DIFFKIT_DIM (128), DIFFKIT_HEADS (4),
DIFFKIT_DTYPE (float32 | bfloat16)."""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

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
        hidden = F.gelu(self.fc1(self.ln2(x)))
        x = x + self.fc2(hidden)
        return x


class Model(nn.Module):
    def __init__(self, depth, dim, heads, dtype):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.to(getattr(torch, dtype))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def _env(name, default):
    return type(default)(os.environ.get(name, default))


depth, batch, seq = _env("DIFFKIT_DEPTH", 24), _env("DIFFKIT_BATCH", 2), _env("DIFFKIT_SEQ", 128)
dim, heads, dtype = _env("DIFFKIT_DIM", 128), _env("DIFFKIT_HEADS", 4), _env("DIFFKIT_DTYPE", "float32")


def get_inputs():
    return [torch.randn(batch, seq, dim).to(getattr(torch, dtype))]


def get_init_inputs():
    return [depth, dim, heads, dtype]
