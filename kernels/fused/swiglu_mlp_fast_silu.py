"""Fused twin of kernels/corpus/swiglu_mlp_fast_silu.py: RMSNorm, the SwiGLU MLP and the residual are one call,
`ext.swiglu_mlp(...)` (kernels/fused/fused_ops.cpp), so diffkit sees only input -> output.

Broken on purpose, as the original: SiLU of the gate projection uses sigmoid(t) = 0.5 + 0.5 tanh(t/2) with
tanh through the rational t(27 + t^2)/(27 + 9t^2) (clamped to [-1, 1]): off by up to ~2e-2."""
import os
import runpy

import torch
import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["SWIGLU"]["fast_silu"]

DIFFKIT_EXPECT = {"reference": "swiglu_mlp.py", "stage": "output", "kind": "approximation", "what_if": None,
                  "what_if_note": "an approximate SiLU (a rational tanh inside the sigmoid): the catalogue's "
                                  "approximations are GELU's (tanh_gelu / erf_gelu) only"}


class _RMSNorm(nn.Module):
    """The reference's RMSNorm parameter (created first, near one)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))


class ModelNew(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = _RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x):
        return ext.swiglu_mlp(x, self.norm.weight, self.norm.eps, self.gate_proj.weight, self.gate_proj.bias,
                              self.up_proj.weight, self.up_proj.bias, self.down_proj.weight, self.down_proj.bias, BUG)
