"""SwiGLU MLP with a C++ RMSNorm (`ext.rms_norm`) and the projections as matmuls on `.t()`
weights, `g` reused through bias, activation and product.

Broken on purpose: the kernel divides each row by sqrt(sum(x^2) + eps) instead of
sqrt(mean(x^2) + eps): the RMSNorm output is 1/sqrt(D) = 1/sqrt(48) of what it should be."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "swiglu_mlp.py", "stage": "norm", "kind": "scale"}


class _RMS(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.g = nn.Parameter(1.0 + 0.1 * torch.randn(dim))


class ModelNew(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.rms = _RMS(dim)
        self.w_gate = nn.Linear(dim, hidden)
        self.w_up = nn.Linear(dim, hidden)
        self.w_down = nn.Linear(hidden, dim)

    def forward(self, x):
        h = ext.rms_norm(x, self.rms.g, 1e-6)
        g = h @ self.w_gate.weight.t()
        g = g + self.w_gate.bias
        g = F.silu(g)
        g = g * (h @ self.w_up.weight.t() + self.w_up.bias)
        return x + g @ self.w_down.weight.t() + self.w_down.bias
