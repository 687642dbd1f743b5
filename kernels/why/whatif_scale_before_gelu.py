"""ConvTranspose3d + LayerNorm + GELU + scale in float32 numpy, the transposed convolution as one matrix
product per kernel tap over flattened voxels, and the scale folded into the normalised value BEFORE the GELU:
gelu(s·y) where the reference computes s·gelu(y) (issue 44: two elementwise steps in the other order)."""
import math

import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_convtranspose3d_layernorm_gelu_scale.py", "stage": "output", "kind": None,
                  "what_if": {"kind": "swapped_order", "stage": "output"}}

ERF = np.vectorize(math.erf, otypes=[np.float32])


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, bias=True, eps=1e-5,
                 scaling_factor=1.0):
        super().__init__()
        self.tconv = nn.ConvTranspose3d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                                        bias=bias)
        self.lnorm = nn.LayerNorm(out_channels, eps=eps)
        self.meta = {"stride": stride, "pad": padding, "eps": eps, "scale": np.float32(scaling_factor)}

    def forward(self, x):
        m = self.meta
        v = x.detach().numpy()
        wt = self.tconv.weight.detach().numpy()
        n, ci, d, h, w = v.shape
        co, k, st = wt.shape[1], wt.shape[2], m["stride"]
        rows = v.transpose(0, 2, 3, 4, 1).reshape(-1, ci)  # one row per input voxel
        full = np.zeros((n, co, (d - 1) * st + k, (h - 1) * st + k, (w - 1) * st + k), dtype=np.float32)
        for t in range(k ** 3):
            a, b, c = t // (k * k), (t // k) % k, t % k
            part = (rows @ wt[:, :, a, b, c]).reshape(n, d, h, w, co).transpose(0, 4, 1, 2, 3)
            full[:, :, a:a + (d - 1) * st + 1:st, b:b + (h - 1) * st + 1:st, c:c + (w - 1) * st + 1:st] += part
        p = m["pad"]
        y = full[:, :, p:-p, p:-p, p:-p] + self.tconv.bias.detach().numpy()[:, None, None, None]
        mean = y.mean(-1, keepdims=True)
        y = (y - mean) / np.sqrt(((y - mean) ** 2).mean(-1, keepdims=True) + np.float32(m["eps"]))
        y = y * self.lnorm.weight.detach().numpy() + self.lnorm.bias.detach().numpy()
        y = y * m["scale"]  # the scale, one step too early
        return torch.from_numpy(0.5 * y * (1 + ERF(y / np.float32(math.sqrt(2)))))
