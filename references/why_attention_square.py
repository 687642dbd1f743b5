"""Single-head self-attention over a short sequence: the score matrix of each batch element is SQUARE
(tokens x tokens), so a softmax over the wrong axis keeps every shape (issue 44)."""
import math

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        weights = torch.softmax(scores, dim=-1)
        return torch.matmul(weights, v)


batch_size, tokens, dim = 2, 8, 16


def get_inputs():
    return [torch.randn(batch_size, tokens, dim)]


def get_init_inputs():
    return [dim]
