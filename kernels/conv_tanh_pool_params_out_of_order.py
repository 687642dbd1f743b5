"""Broken on purpose: the convolution's parameters are made by hand (nn.Parameter over torch.empty, with
nn.Conv2d's own init) under other names, the bias before the weight.  KernelBench seeds once before each
constructor, so both draw other random numbers than the reference's: the output is wrong from the first
stage that reads them, the convolution, though every kernel is right."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFKIT_EXPECT = {"reference": "conv_tanh_pool.py", "stage": "conv", "kind": "other_weights"}


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, subtract1_value, subtract2_value, kernel_size_pool):
        super().__init__()
        fan_in = in_channels * kernel_size * kernel_size
        bound = 1.0 / math.sqrt(fan_in)
        self.shift = nn.Parameter(torch.empty(out_channels).uniform_(-bound, bound))  # the bias, drawn first
        self.filters = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        nn.init.kaiming_uniform_(self.filters, a=math.sqrt(5))
        self.offsets = (subtract1_value, subtract2_value)
        self.pool = kernel_size_pool

    def forward(self, x):
        y = F.conv2d(x, self.filters, self.shift)
        y = torch.tanh(y - self.offsets[0]) - self.offsets[1]  # the three elementwise steps, fused
        return F.avg_pool2d(y, self.pool)
