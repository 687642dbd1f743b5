"""ConvTranspose3d -> LayerNorm -> GELU -> scaling (KernelBench level 2's 34_ConvTranspose3d_LayerNorm_GELU_Scaling,
at CPU-sized shapes).  As in the original, LayerNorm(out_channels) normalises the LAST axis (W), which after the
transposed convolution happens to have out_channels elements: a fused kernel that normalises per channel over
D·H·W (or over C) is the classic mistake (issue 44)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, bias=True, eps=1e-5,
                 scaling_factor=1.0):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(in_channels, out_channels, kernel_size, stride=stride,
                                                 padding=padding, bias=bias)
        self.layer_norm = nn.LayerNorm(out_channels, eps=eps)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        x = self.conv_transpose(x)
        x = self.layer_norm(x)
        x = torch.nn.functional.gelu(x)
        x = x * self.scaling_factor
        return x


batch_size = 2
in_channels = 4
out_channels = 8
D, H, W = 2, 3, 4  # W * stride = out_channels: the output's last axis has out_channels elements
kernel_size = 4
stride = 2
padding = 1
bias = True
eps = 1e-5
scaling_factor = 2.0


def get_inputs():
    return [torch.randn(batch_size, in_channels, D, H, W)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding, bias, eps, scaling_factor]
