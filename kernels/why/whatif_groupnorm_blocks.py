"""ConvTranspose2d + GELU + GroupNorm fused into one pass written as plain Python over numpy buffers, with a
small helper class standing in for a CUDA launch: each "thread block" owns 128 consecutive values of a group
and normalises them with the mean and variance IT reduced, never combining the partial sums of the other
blocks of its group (issue 44: GroupNorm statistics reduced per thread block instead of per group)."""
import math

import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_convtranspose2d_gelu_groupnorm.py", "stage": "group_norm", "kind": None,
                  "what_if": {"kind": "block_stats", "stage": "group_norm"}}

THREADS = 128


class _Launch:
    """A grid of blocks over a flat buffer; `run(kernel)` calls kernel(block_id, view of the block)."""

    def __init__(self, buf, threads):
        self.buf, self.threads = buf, threads

    def run(self, kernel):
        flat = self.buf.reshape(-1)
        for bid in range(flat.size // self.threads):
            kernel(bid, flat[bid * self.threads:(bid + 1) * self.threads])


def _gelu_erf(v):
    return 0.5 * v * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(v * (1.0 / math.sqrt(2.0))))


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, groups, num_groups):
        super().__init__()
        self.ct = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride=stride)
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=out_channels)
        self.stride = stride

    def forward(self, inp):
        x = inp.detach().numpy().astype(np.float64)
        w = self.ct.weight.detach().numpy().astype(np.float64)
        n, cin, h, wd = x.shape
        cout, k, s = w.shape[1], w.shape[2], self.stride
        y = np.zeros((n, cout, (h - 1) * s + k, (wd - 1) * s + k))
        for ky in range(k):
            for kx in range(k):
                y[:, :, ky:ky + (h - 1) * s + 1:s, kx:kx + (wd - 1) * s + 1:s] += np.einsum(
                    "bchw,co->bohw", x, w[:, :, ky, kx])
        y = _gelu_erf(y + self.ct.bias.detach().numpy()[None, :, None, None])
        eps = self.gn.eps

        def block_norm(bid, vals):  # the group's other blocks are never consulted
            mean = vals.sum() / vals.size
            var = ((vals - mean) ** 2).sum() / vals.size
            vals[:] = (vals - mean) / math.sqrt(var + eps)

        _Launch(y, THREADS).run(block_norm)
        gamma = self.gn.weight.detach().numpy()[None, :, None, None]
        beta = self.gn.bias.detach().numpy()[None, :, None, None]
        return torch.from_numpy((y * gamma + beta).astype(np.float32))
