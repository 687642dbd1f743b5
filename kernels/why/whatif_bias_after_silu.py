"""Conv2d + SiLU + scale with the convolution's bias moved into the epilogue after the activation:
silu(W * x) + b instead of silu(W * x + b).  Written as explicit Python loops over output pixels, with numpy
only for the dot product of each window (issue 44: bias placement)."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_conv2d_silu_scale.py", "stage": "output", "kind": None,
                  "what_if": {"kind": "bias_placement", "stage": "forward:x#2"}}


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, scaling_factor):
        super().__init__()
        self.body = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.k, self.alpha = kernel_size, scaling_factor

    def forward(self, x):
        src = x.detach().numpy().astype(np.float64)
        w = self.body.weight.detach().numpy().astype(np.float64)
        b = self.body.bias.detach().numpy().astype(np.float64)
        n, _, h, wd = src.shape
        oh, ow = h - self.k + 1, wd - self.k + 1
        out = np.empty((n, w.shape[0], oh, ow))
        for bi in range(n):
            for i in range(oh):
                for j in range(ow):
                    patch = src[bi, :, i:i + self.k, j:j + self.k]
                    acc = (w * patch).sum(axis=(1, 2, 3))
                    out[bi, :, i, j] = acc / (1.0 + np.exp(-acc)) + b  # bias after the activation
        return torch.from_numpy((out * self.alpha).astype(np.float32))
