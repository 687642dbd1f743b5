"""Correct fused candidate for references/tempered_softmax.py: both projections, the tempered softmax and the
product are one call, `ext.tempered_softmax(...)` (kernels/fused/fused_ops.cpp) with no planted mistake (bug
0), so diffkit sees only input -> output and the output matches."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["TEMPERED"]["ok"]

DIFFKIT_EXPECT = {"reference": "tempered_softmax.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, dim, temperature):
        super().__init__()
        self.temperature = temperature
        self.score = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

    def forward(self, x):
        return ext.tempered_softmax(x, self.score.weight, self.score.bias, self.value.weight, self.value.bias,
                                    self.temperature, BUG)
