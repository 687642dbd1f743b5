"""Fused twin of kernels/triangle_multiplicative_update_tail_rows.py: the whole triangle multiplicative update is
one call, `ext.triangle_multiplicative_update(...)` (kernels/fused/fused_ops.cpp), so diffkit sees only input
-> output.

Broken on purpose, as the original: in the gated projection for a (tiles of 32 of the flattened 144 rows), the
last partial tile reads its inputs from rows 0..15 instead of 128..143: rows 128..143 of a hold rows 0..15."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["TRIANGLE"]["a_tail_rows"]

DIFFKIT_EXPECT = {"reference": "triangle_multiplicative_update.py", "stage": "output", "kind": "boundary",
                  "what_if": None,
                  "what_if_note": "rows 128..143 of a hold rows 0..15 (the partial tile indexes its rows from the tile "
                                  "start): wrong data copied from elsewhere, not zeros (unwritten_tail) nor any other "
                                  "catalogue kind"}


class ModelNew(nn.Module):
    def __init__(self, c_z, c_hidden):
        super().__init__()
        self.norm_in = nn.LayerNorm(c_z)
        self.proj_a = nn.Linear(c_z, c_hidden)
        self.gate_a = nn.Linear(c_z, c_hidden)
        self.proj_b = nn.Linear(c_z, c_hidden)
        self.gate_b = nn.Linear(c_z, c_hidden)
        self.norm_out = nn.LayerNorm(c_hidden)
        self.proj_out = nn.Linear(c_hidden, c_z)
        self.gate_out = nn.Linear(c_z, c_z)

    def forward(self, z):
        return ext.triangle_multiplicative_update(
            z, self.norm_in.weight, self.norm_in.bias, self.norm_in.eps, self.proj_a.weight, self.proj_a.bias,
            self.gate_a.weight, self.gate_a.bias, self.proj_b.weight, self.proj_b.bias, self.gate_b.weight,
            self.gate_b.bias, self.norm_out.weight, self.norm_out.bias, self.norm_out.eps, self.proj_out.weight,
            self.proj_out.bias, self.gate_out.weight, self.gate_out.bias, BUG)
