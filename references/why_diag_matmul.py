"""A plain matrix product of two inputs (KernelBench level-1 style), not square: A [M, K] @ B [K, N]."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.matmul(A, B)


M, K, N = 24, 40, 16


def get_inputs():
    return [torch.randn(M, K), torch.randn(K, N)]


def get_init_inputs():
    return []
