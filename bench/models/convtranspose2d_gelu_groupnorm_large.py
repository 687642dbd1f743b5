"""ConvTranspose2d -> GELU -> GroupNorm at the sizes of KernelBench level 2's problem 19 (batch 128, 64 -> 64
channels, 256 x 256 in, kernel 3, stride 1: 258 x 258 out, 8 groups), in float32: 2.2 GB an activation, the
problem issue 46 measures device memory on (a GPU-sized reference: on a CPU one forward takes minutes, which is
why it lives in bench/models/ and not references/, whose every model the CPU tests run).
DIFFKIT_L2_BATCH sets the batch (the memory benchmark's smaller runs)."""
import os

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


batch_size = int(os.environ.get("DIFFKIT_L2_BATCH", "128"))
in_channels = 64
out_channels = 64
height = width = 256
kernel_size = 3
stride = 1
groups = 8
num_groups = 8


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, groups, num_groups]
