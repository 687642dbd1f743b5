"""A pre-norm SwiGLU feed-forward block (the MLP of LLaMA-style transformers), with a residual.

x: [B, S, D].  h = RMSNorm(x);  y = down_proj(silu(gate_proj(h)) * up_proj(h));  out = x + y.
RMSNorm: x / sqrt(mean(x^2) + eps) * weight, no mean subtraction and no bias; its weight starts
near (not at) one so that a kernel which ignores it is visible.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

    def forward(self, x):
        ms = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(ms + self.eps) * self.weight


class Model(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.norm(x)
        gate = F.silu(self.gate_proj(h))
        up = self.up_proj(h)
        act = gate * up
        y = self.down_proj(act)
        return x + y


batch, seq, dim, hidden = 2, 10, 48, 80


def get_inputs():
    return [torch.randn(batch, seq, dim)]


def get_init_inputs():
    return [dim, hidden]
