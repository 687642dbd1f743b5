"""ConvTranspose2d -> GELU -> GroupNorm (KernelBench level 2's 19_ConvTranspose2d_GELU_GroupNorm, at CPU-sized
shapes).  A fused kernel takes each group's statistics and normalises in one pass: the places it goes wrong are
the reduction (per thread block instead of per group) and computing the GELU twice, two different ways
(issue 44).  The inputs are on a scale where the GELU's curved part matters (values of a few units)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, groups, num_groups):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride=stride)
        self.group_norm = nn.GroupNorm(num_groups=num_groups, num_channels=out_channels)

    def forward(self, x):
        x = self.conv_transpose(x)
        x = torch.nn.functional.gelu(x)
        x = self.group_norm(x)
        return x


batch_size = 2
in_channels = 8
out_channels = 16
height, width = 7, 7  # 16 x 16 after the transposed convolution
kernel_size = 4
stride = 2
groups = 8
num_groups = 4


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width) * 6.0]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, groups, num_groups]
