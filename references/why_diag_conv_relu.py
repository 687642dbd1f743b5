"""A 3×3 convolution with padding 1 (output the input's size), ReLU, a second 3×3 convolution:
small image model whose convolutions keep the spatial size."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, cin, cmid, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cmid, 3, padding=1)
        self.conv2 = nn.Conv2d(cmid, cout, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))


def get_inputs():
    return [torch.randn(2, 3, 12, 10)]


def get_init_inputs():
    return [3, 6, 4]
