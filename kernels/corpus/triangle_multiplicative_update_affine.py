"""Triangle multiplicative update (outgoing): gated projections from one packed C++ call
(`ext.gated_pair`), the contraction over k as a batched matmul on [b, c, i, k] x [b, c, k, j],
and the output and gate projections through a C++ affine kernel (`ext.affine`).

Broken on purpose: the affine kernel starts its accumulator at the bias and adds the bias again
when it stores, so every output channel is off by its bias; the output projection (before the
gate) is the first stage it computes."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "triangle_multiplicative_update.py", "stage": "proj_out", "kind": "offset"}


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
        zn = self.norm_in(z)
        packed_w = torch.cat([self.proj_a.weight, self.gate_a.weight, self.proj_b.weight, self.gate_b.weight])
        packed_b = torch.cat([self.proj_a.bias, self.gate_a.bias, self.proj_b.bias, self.gate_b.bias])
        a, b = ext.gated_pair(zn, packed_w, packed_b)
        x = torch.matmul(a.permute(0, 3, 1, 2), b.permute(0, 3, 2, 1)).permute(0, 2, 3, 1)
        x = ext.affine(self.norm_out(x), self.proj_out.weight, self.proj_out.bias)
        return torch.sigmoid(ext.affine(zn, self.gate_out.weight, self.gate_out.bias)) * x
