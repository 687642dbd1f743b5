"""LayerNorm -> Linear -> GELU: a norm whose weight starts at 1 (and bias at 0)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, hidden)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(self.norm(x)))


batch_size, tokens, dim, hidden = 4, 12, 32, 48


def get_inputs():
    return [torch.randn(batch_size, tokens, dim)]


def get_init_inputs():
    return [dim, hidden]
