"""Two-layer MLP with tanh (a correct candidate may compute it in float64 and cast back)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, hidden, out_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


batch_size, in_features, hidden, out_features = 8, 32, 64, 16


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, hidden, out_features]
