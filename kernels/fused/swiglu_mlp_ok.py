"""Correct fused candidate for references/swiglu_mlp.py: RMSNorm, the SwiGLU MLP and the residual are one call,
`ext.swiglu_mlp(...)` (kernels/fused/fused_ops.cpp) with no planted mistake (bug 0), so diffkit sees only
input -> output and the output matches."""
import os
import runpy

import torch
import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["SWIGLU"]["ok"]

DIFFKIT_EXPECT = {"reference": "swiglu_mlp.py", "verdict": "match", "what_if": None}


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
