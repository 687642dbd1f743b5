"""Fused twin of kernels/axial_attention_transposed_weight.py: the whole axial-attention model (row block, then
column block) is one call, `ext.axial_attention(...)` (kernels/fused/fused_ops.cpp), so diffkit sees only
input -> output.

Broken on purpose, as the original: in the row block, the LayerNorm+QKV step reads the [3D, D] qkv weight's
memory as a [D, 3D] matrix (w[k*3D + n] instead of w[n*D + k]), i.e. qkv = LN(x) @ W.view(D, 3D) + b.  The
column block is right."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["AXIAL"]["qkv_read_as_in_out"]

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "output", "kind": "transposed_weight", "what_if": {"kind": "transposed_weight", "stage": "row_attn.qkv_proj"}}


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
