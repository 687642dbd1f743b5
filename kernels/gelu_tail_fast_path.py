"""Broken on purpose, only for some inputs: the kernel flushes the negative tail to zero ("GELU(x)
is 0 below -3"), which holds to 1e-2 but not to KernelBench's 1e-4 (GELU(-3) = -0.004).  Inputs
with no element below -3 pass; KernelBench's trials draw other inputs, and some fail."""
import math

import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "gelu.py", "stage": "output", "kind": None}


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        exact = 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
        return torch.where(x < -3.0, torch.zeros_like(x), exact)
