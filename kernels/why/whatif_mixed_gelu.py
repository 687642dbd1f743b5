"""ConvTranspose2d + GELU + GroupNorm in one numpy function, two passes like a two-kernel CUDA fusion: pass 1
reduces each group's sum and sum of squares of the EXACT (erf) GELU; pass 2 recomputes the activation with
the cheaper tanh formula and normalises that with pass 1's statistics (issue 44: statistics from an erf
GELU, output through a tanh GELU)."""
import math

import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_convtranspose2d_gelu_groupnorm.py", "stage": "group_norm", "kind": None,
                  "what_if": {"kind": "mixed_gelu", "stage": "group_norm"}}

_erf = np.frompyfunc(math.erf, 1, 1)


def deconv(x, weight, bias, stride):
    """conv_transpose2d as a zero-stuffed input correlated with the flipped kernel."""
    n, c, h, w = x.shape
    k = weight.shape[-1]
    up = np.zeros((n, c, (h - 1) * stride + 1 + 2 * (k - 1), (w - 1) * stride + 1 + 2 * (k - 1)))
    up[:, :, k - 1:k - 1 + (h - 1) * stride + 1:stride, k - 1:k - 1 + (w - 1) * stride + 1:stride] = x
    flipped = weight[:, :, ::-1, ::-1]
    oh, ow = up.shape[2] - k + 1, up.shape[3] - k + 1
    out = np.zeros((n, weight.shape[1], oh, ow))
    for i in range(k):
        for j in range(k):
            out += np.einsum("nchw,co->nohw", up[:, :, i:i + oh, j:j + ow], flipped[:, :, i, j])
    return out + bias.reshape(1, -1, 1, 1)


def forward_pass(x, weight, bias, stride, groups, gamma, beta, eps):
    pre = deconv(x, weight, bias, stride)
    n, c = pre.shape[:2]
    exact = 0.5 * pre * (1.0 + _erf(pre / math.sqrt(2.0)).astype(np.float64))  # pass 1: statistics
    g = exact.reshape(n, groups, -1)
    mean = g.sum(-1, keepdims=True) / g.shape[-1]
    var = (g * g).sum(-1, keepdims=True) / g.shape[-1] - mean * mean
    fast = 0.5 * pre * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (pre + 0.044715 * pre ** 3)))  # pass 2: values
    y = ((fast.reshape(n, groups, -1) - mean) / np.sqrt(var + eps)).reshape(pre.shape)
    return y * gamma.reshape(1, -1, 1, 1) + beta.reshape(1, -1, 1, 1)


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, groups, num_groups):
        super().__init__()
        self.conv_t = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride=stride)
        self.norm = nn.GroupNorm(num_groups, out_channels)
        self.stride, self.groups = stride, num_groups

    def forward(self, x):
        np_ = lambda t: t.detach().cpu().numpy().astype(np.float64)
        y = forward_pass(np_(x), np_(self.conv_t.weight), np_(self.conv_t.bias), self.stride, self.groups,
                         np_(self.norm.weight), np_(self.norm.bias), self.norm.eps)
        return torch.from_numpy(y.astype(np.float32))
