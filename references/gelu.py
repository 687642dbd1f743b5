"""GELU (erf form) of a batch of rows (KernelBench level-1 style)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return F.gelu(x)


batch_size, dim = 4, 256


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
