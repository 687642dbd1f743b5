"""Fused twin of kernels/corpus/axial_attention_softmax_rows.py: the whole axial-attention model (row block, then
column block) is one call, `ext.axial_attention(...)` (kernels/fused/fused_ops.cpp), so diffkit sees only
input -> output.

Broken on purpose, as the original: the attention softmax normalises over the query axis (dim -2) instead of
the key axis, in both blocks (the original's `attention` method serves both)."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["AXIAL"]["softmax_query_axis"]

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "output", "kind": "wrong_reduction_axis",
                  "what_if": {"kind": "reduce_axis", "stage": "row_attn._attn:attn"}}


class _AxialBlock(nn.Module):
    """The parameters of the reference's AxialBlock, in its order."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.norm = nn.LayerNorm(dim)
        self.qkv_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)


class ModelNew(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.row_attn = _AxialBlock(dim, heads)
        self.col_attn = _AxialBlock(dim, heads)

    def forward(self, x):
        r, c = self.row_attn, self.col_attn
        return ext.axial_attention(x, r.norm.weight, r.norm.bias, r.norm.eps, r.qkv_proj.weight, r.qkv_proj.bias,
                                   r.out_proj.weight, r.out_proj.bias, c.norm.weight, c.norm.bias, c.norm.eps,
                                   c.qkv_proj.weight, c.qkv_proj.bias, c.out_proj.weight, c.out_proj.bias, self.heads,
                                   BUG)
