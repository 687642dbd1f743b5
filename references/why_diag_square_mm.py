"""A square matrix product of two inputs, scaled: (A @ B) * 0.5, with A, B [S, S]."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, A, B):
        return torch.mm(A, B) * self.alpha


S = 32


def get_inputs():
    return [torch.randn(S, S), torch.randn(S, S)]


def get_init_inputs():
    return [0.5]
