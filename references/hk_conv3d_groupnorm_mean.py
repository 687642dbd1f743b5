"""Conv3d -> GroupNorm -> mean over every non-batch dimension (KernelBench level 2's
23_Conv3d_GroupNorm_Mean, at CPU-sized shapes): the problem of the Sakana AI CUDA Engineer kernel that
wrote the mean of the GroupNorm bias everywhere (KernelBench PR #25)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, num_groups):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size)
        self.group_norm = nn.GroupNorm(num_groups, out_channels)

    def forward(self, x):
        x = self.conv(x)
        x = self.group_norm(x)
        return x.mean(dim=[1, 2, 3, 4])


batch_size = 4
in_channels = 3
out_channels = 8
D, H, W = 6, 7, 7
kernel_size = 3
num_groups = 4


def get_inputs():
    return [torch.randn(batch_size, in_channels, D, H, W)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, num_groups]
