"""Fused twin of kernels/gelu_tail_fast_path.py: the GELU is one call, `ext.gelu(...)`
(kernels/fused/fused_ops.cpp), so diffkit sees only input -> output.

Broken on purpose, as the original: the kernel flushes GELU's negative tail to zero below -3 (GELU(-3) =
-0.004, beyond 1e-4).  Only inputs with an element below -3 show it: KernelBench's first trial (seed 42) has
none, a later one does, so a one-trial diff matches and the default five trials diverge."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["GELU"]["flush_tail"]

DIFFKIT_EXPECT = {"reference": "gelu.py", "stage": "output", "kind": None, "what_if": None,
                  "what_if_note": "GELU(x) replaced by 0 for x < -3 (a flush of the input's tail region): not a clamp "
                                  "of the output, nor any other catalogue kind"}


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.gelu(x, BUG)
