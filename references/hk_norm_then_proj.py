"""LayerNorm -> Linear -> SiLU (a correct candidate may fold the norm's affine into the Linear)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, dim, out_dim):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, out_dim)

    def forward(self, x):
        return F.silu(self.proj(self.ln(x)))


batch_size, dim, out_dim = 8, 32, 24


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim, out_dim]
