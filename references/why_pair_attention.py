"""Single-head self-attention over a short sequence: q, k, v projections, a square [N, N] score matrix,
softmax over the key axis, an output projection (issue 44: pairing that never mistakes a copy for a
computation; the candidates in kernels/why/pair_*.py compute the attention in numpy)."""
import torch
import torch.nn as nn

BATCH, TOKENS, DIM = 4, 16, 32


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.scale = dim ** -0.5

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        attn = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(attn, v)
        return self.out_proj(ctx)


def get_inputs():
    return [torch.randn(BATCH, TOKENS, DIM)]


def get_init_inputs():
    return [DIM]
