"""ConvTranspose3d + LayerNorm + GELU + scale as one numpy routine (einsum per kernel tap).  The LayerNorm is
taken per (sample, channel) over D·H·W, the way a kernel writer reads LayerNorm(out_channels) on a 5-D
tensor; the reference normalises the last axis (W) (issue 44)."""
import math

import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_convtranspose3d_layernorm_gelu_scale.py", "stage": "output", "kind": None,
                  "what_if": {"kind": "norm_axes", "stage": "layer_norm"}}


def _erf(z):
    return np.vectorize(math.erf, otypes=[np.float64])(z)


def _deconv3d(x, w, b, stride, pad):
    n, cin, d, h, wd = x.shape
    cout, k = w.shape[1], w.shape[2]
    full = np.zeros((n, cout, (d - 1) * stride + k, (h - 1) * stride + k, (wd - 1) * stride + k))
    for a in range(k):
        for c in range(k):
            for e in range(k):
                tap = np.einsum("nidhw,io->nodhw", x, w[:, :, a, c, e])
                full[:, :, a:a + (d - 1) * stride + 1:stride, c:c + (h - 1) * stride + 1:stride,
                     e:e + (wd - 1) * stride + 1:stride] += tap
    out = full[:, :, pad:full.shape[2] - pad, pad:full.shape[3] - pad, pad:full.shape[4] - pad]
    return out + b[None, :, None, None, None]


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, bias=True, eps=1e-5,
                 scaling_factor=1.0):
        super().__init__()
        self.up = nn.ConvTranspose3d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                                     bias=bias)
        self.ln = nn.LayerNorm(out_channels, eps=eps)
        self.cfg = (stride, padding, eps, scaling_factor)

    def forward(self, x):
        stride, pad, eps, s = self.cfg
        as64 = lambda t: t.detach().numpy().astype(np.float64)
        y = _deconv3d(as64(x), as64(self.up.weight), as64(self.up.bias), stride, pad)
        mu = y.mean(axis=(2, 3, 4), keepdims=True)
        var = ((y - mu) ** 2).mean(axis=(2, 3, 4), keepdims=True)
        y = (y - mu) / np.sqrt(var + eps) * as64(self.ln.weight) + as64(self.ln.bias)
        y = 0.5 * y * (1.0 + _erf(y / math.sqrt(2.0)))
        return torch.from_numpy((y * s).astype(np.float32))
