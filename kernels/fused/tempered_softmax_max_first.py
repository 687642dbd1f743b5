"""Fused twin of kernels/corpus/tempered_softmax_max_first.py: both projections, the tempered softmax and the
product are one call, `ext.tempered_softmax(...)` (kernels/fused/fused_ops.cpp), so diffkit sees only input ->
output.

Broken on purpose, as the original: softmax(u / T) is computed as exp(u/T - max(u)) / sum: the maximum of the
untempered logits u is subtracted after dividing by T = 0.01, i.e. only 1% of the tempered row maximum is
removed, so the exponent reaches a few hundred, overflows to inf, and inf / inf gives NaN -- in effect a
softmax without the max subtraction."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["TEMPERED"]["max_first"]

DIFFKIT_EXPECT = {"reference": "tempered_softmax.py", "stage": "output", "kind": "nan_inf",
                  "what_if": None,
                  "what_if_note": "a wrong maximum is subtracted (max(u), not max(u/T)): it overflows elsewhere than a "
                                  "softmax with no maximum subtracted, so no catalogue mistake reproduces its NaNs"}


class ModelNew(nn.Module):
    def __init__(self, dim, temperature):
        super().__init__()
        self.temperature = temperature
        self.score = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

    def forward(self, x):
        return ext.tempered_softmax(x, self.score.weight, self.score.bias, self.value.weight, self.value.bias,
                                    self.temperature, BUG)
