"""Correct fused candidate for references/gelu.py: the GELU is one call, `ext.gelu(...)`
(kernels/fused/fused_ops.cpp) with no planted mistake (bug 0), so diffkit sees only input -> output and the
output matches."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["GELU"]["ok"]

DIFFKIT_EXPECT = {"reference": "gelu.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.gelu(x, BUG)
