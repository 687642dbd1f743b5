"""Linear -> each row scaled to unit L2 norm -> ReLU."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        y = self.linear(x)
        unit = F.normalize(y, dim=1)
        return torch.relu(unit)


batch_size, in_features, out_features = 16, 20, 24


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
