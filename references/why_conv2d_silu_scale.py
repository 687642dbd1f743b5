"""Conv2d -> SiLU -> scaling (a KernelBench level-2 style conv + activation + scale): the activation and the
conv's bias are what a fused epilogue gets wrong (issue 44)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, scaling_factor):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        x = self.conv(x)
        x = torch.nn.functional.silu(x)
        return x * self.scaling_factor


batch_size, in_channels, out_channels = 2, 3, 8
height, width, kernel_size = 8, 8, 3
scaling_factor = 1.5


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, scaling_factor]
