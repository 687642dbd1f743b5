"""Correct: the first subtraction is folded into the convolution's bias once, at construction
(conv(x) - c == conv with bias - c), and tanh, the second subtraction and the pooling run as one
pass.  Its `conv.bias` therefore differs from the reference's by -subtract1_value -- on purpose:
copying the reference's weights into it would break it."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, subtract1_value, subtract2_value, kernel_size_pool):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        with torch.no_grad():
            self.conv.bias.sub_(subtract1_value)
        self.subtract2_value = subtract2_value
        self.kernel_size_pool = kernel_size_pool

    def forward(self, x):
        y = F.conv2d(x, self.conv.weight, self.conv.bias)
        return F.avg_pool2d(torch.tanh(y) - self.subtract2_value, self.kernel_size_pool)
