"""Softmax over the last dimension of a batch of rows (KernelBench level-1 style, CPU size)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.softmax(x, dim=1)


batch_size, dim = 8, 512


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
