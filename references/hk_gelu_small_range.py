"""Linear -> exact (erf) GELU on inputs drawn uniformly in [-1, 1]."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


batch_size, in_features, out_features = 16, 64, 48


def get_inputs():
    return [torch.rand(batch_size, in_features) * 2 - 1]


def get_init_inputs():
    return [in_features, out_features]
