"""Conv2d + SiLU + scale as an im2col matrix product in numpy (sliding windows by stride tricks); the epilogue
applies sigmoid(x) where the reference applies SiLU, x·sigmoid(x) (issue 44: SiLU vs sigmoid-gated)."""
import numpy as np
import torch
import torch.nn as nn
from numpy.lib.stride_tricks import sliding_window_view

DIFFKIT_EXPECT = {"reference": "why_conv2d_silu_scale.py", "stage": "output", "kind": None,
                  "what_if": {"kind": "activation", "stage": "forward:x#2"}}


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, scaling_factor):
        super().__init__()
        self.filt = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.mult = float(scaling_factor)

    def forward(self, img):
        a = img.detach().numpy()
        kern = self.filt.weight.detach().numpy()
        o, c, kh, kw = kern.shape
        win = sliding_window_view(a, (kh, kw), axis=(2, 3))  # [n, c, oh, ow, kh, kw]
        cols = win.transpose(0, 2, 3, 1, 4, 5).reshape(-1, c * kh * kw)
        z = cols @ kern.reshape(o, -1).T + self.filt.bias.detach().numpy()
        z = z.reshape(a.shape[0], win.shape[2], win.shape[3], o).transpose(0, 3, 1, 2)
        act = 1.0 / (1.0 + np.exp(-z))
        return torch.from_numpy(np.ascontiguousarray(act * self.mult).astype(np.float32))
