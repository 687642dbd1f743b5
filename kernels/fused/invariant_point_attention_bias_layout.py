"""Fused twin of kernels/invariant_point_attention_bias_layout.py: the whole invariant point attention is one
call, `ext.invariant_point_attention(...)` (kernels/fused/fused_ops.cpp), so diffkit sees only input ->
output.

Broken on purpose, as the original: the logits read the pair bias [B, N, N, H] as if it were [B, H, N, N] (a
stride bug): bias_term = pair_bias.view(B, H, N, N) instead of pair_bias.permute(0, 3, 1, 2)."""
import os
import runpy

import torch
import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["IPA"]["bias_layout"]

DIFFKIT_EXPECT = {"reference": "invariant_point_attention.py", "stage": "output", "kind": None, "what_if": None,
                  "what_if_note": "the pair bias's memory is reinterpreted as [B, H, N, N] (a view of the [B, N, N, H] "
                                  "buffer): neither a transpose of two last dims (transposed_operand) nor a swap of "
                                  "operands; a layout bug outside the catalogue"}


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
