"""Linear whose bias the model zero-fills at construction -> tanh -> scale by a learned gain."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.proj = nn.Linear(in_features, out_features)
        nn.init.zeros_(self.proj.bias)
        self.gain = nn.Parameter(torch.randn(out_features))

    def forward(self, x):
        h = self.proj(x)
        return torch.tanh(h) * self.gain


batch_size, in_features, out_features = 16, 40, 24


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
