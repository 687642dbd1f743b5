"""Correct fused candidate for references/invariant_point_attention.py: the whole invariant point attention is
one call, `ext.invariant_point_attention(...)` (kernels/fused/fused_ops.cpp) with no planted mistake (bug 0),
so diffkit sees only input -> output and the output matches."""
import os
import runpy

import torch
import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["IPA"]["ok"]

DIFFKIT_EXPECT = {"reference": "invariant_point_attention.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, c_s, c_z, heads, c_hidden, n_qk_points, n_v_points):
        super().__init__()
        self.heads, self.c_hidden = heads, c_hidden
        self.n_qk, self.n_v = n_qk_points, n_v_points
        self.linear_q = nn.Linear(c_s, heads * c_hidden)
        self.linear_kv = nn.Linear(c_s, 2 * heads * c_hidden)
        self.linear_q_points = nn.Linear(c_s, heads * n_qk_points * 3)
        self.linear_kv_points = nn.Linear(c_s, heads * (n_qk_points + n_v_points) * 3)
        self.linear_b = nn.Linear(c_z, heads)
        self.head_weights = nn.Parameter(torch.randn(heads) * 0.5)
        self.linear_out = nn.Linear(heads * (c_z + c_hidden + n_v_points * 4), c_s)

    def forward(self, s, z, rot, trans):
        return ext.invariant_point_attention(
            s, z, rot, trans, self.linear_q.weight, self.linear_q.bias, self.linear_kv.weight, self.linear_kv.bias,
            self.linear_q_points.weight, self.linear_q_points.bias, self.linear_kv_points.weight,
            self.linear_kv_points.bias, self.linear_b.weight, self.linear_b.bias, self.head_weights,
            self.linear_out.weight, self.linear_out.bias, self.heads, self.c_hidden, self.n_qk, self.n_v, BUG)
