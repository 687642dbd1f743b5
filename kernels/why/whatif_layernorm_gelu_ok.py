"""ConvTranspose3d + LayerNorm + GELU + scale, correct, as plain numpy: the transposed convolution as a
scatter of each input voxel (a loop over input positions), LayerNorm over the last axis as the reference
takes it (issue 44)."""
import math

import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_convtranspose3d_layernorm_gelu_scale.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, bias=True, eps=1e-5,
                 scaling_factor=1.0):
        super().__init__()
        self.deconv = nn.ConvTranspose3d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                                         bias=bias)
        self.norm = nn.LayerNorm(out_channels, eps=eps)
        self.stride, self.padding, self.eps, self.factor = stride, padding, eps, scaling_factor

    def forward(self, x):
        xs = x.detach().numpy().astype(np.float64)
        wt = self.deconv.weight.detach().numpy().astype(np.float64)  # [in, out, k, k, k]
        n, cin, d, h, w = xs.shape
        k, st, p = wt.shape[2], self.stride, self.padding
        big = np.zeros((n, wt.shape[1], (d - 1) * st + k, (h - 1) * st + k, (w - 1) * st + k))
        for i in range(d):
            for j in range(h):
                for l in range(w):
                    # every input voxel scatters a k^3 patch: [n, in] x [in, out, k, k, k]
                    big[:, :, i * st:i * st + k, j * st:j * st + k, l * st:l * st + k] += np.tensordot(
                        xs[:, :, i, j, l], wt, axes=([1], [0]))
        y = big[:, :, p:-p or None, p:-p or None, p:-p or None]
        y = y + self.deconv.bias.detach().numpy()[:, None, None, None]
        mu = y.mean(axis=-1, keepdims=True)
        sd = np.sqrt(((y - mu) ** 2).mean(axis=-1, keepdims=True) + self.eps)
        y = (y - mu) / sd * self.norm.weight.detach().numpy() + self.norm.bias.detach().numpy()
        y = 0.5 * y * (1.0 + np.array([math.erf(v) for v in (y / math.sqrt(2.0)).ravel()]).reshape(y.shape))
        return torch.from_numpy((y * self.factor).astype(np.float32))
