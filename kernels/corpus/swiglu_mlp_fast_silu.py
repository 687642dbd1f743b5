"""SwiGLU MLP with the activation in C++ (`ext.silu`, sigmoid through a rational tanh so the hot
loop has no exp); the RMSNorm is written out inline, the projections are the modules themselves
and everything is passed inline.

Broken on purpose: the rational tanh t(27 + t^2)/(27 + 9t^2) is only an approximation (error up
to ~2e-2 near |t| = 2): SiLU of the gate projection is off by a smooth function of its input."""
import os

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "swiglu_mlp.py", "stage": "forward:gate", "kind": "approximation"}


class ModelNew(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.eps = 1e-6
        self.rms_weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.gate = nn.Linear(dim, hidden)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        h = x * (x * x).mean(-1, keepdim=True).add(self.eps).rsqrt() * self.rms_weight
        return x + self.down(ext.silu(self.gate(h)) * self.up(h))
