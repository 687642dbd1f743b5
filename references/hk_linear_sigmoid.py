"""Linear -> sigmoid at a size that is a multiple of 32 in both dimensions of the output."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return torch.sigmoid(self.fc(x))


batch_size, in_features, out_features = 64, 48, 96


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
