"""Fused twin of kernels/tempered_softmax_no_max.py: both projections, the tempered softmax and the product are
one call, `ext.tempered_softmax(...)` (kernels/fused/fused_ops.cpp), so diffkit sees only input -> output.

Broken on purpose, as the original: the softmax exponentiates the raw tempered logits in float32 without
subtracting the row maximum; logits of a few hundred overflow to inf and inf / inf gives NaN."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["TEMPERED"]["no_max"]

DIFFKIT_EXPECT = {"reference": "tempered_softmax.py", "stage": "output", "kind": "nan_inf",
                  "what_if": {"kind": "unstable_softmax", "stage": "forward:weights"}}


class ModelNew(nn.Module):
    def __init__(self, dim, temperature):
        super().__init__()
        self.temperature = temperature
        self.score = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

    def forward(self, x):
        return ext.tempered_softmax(x, self.score.weight, self.score.bias, self.value.weight, self.value.bias,
                                    self.temperature, BUG)
