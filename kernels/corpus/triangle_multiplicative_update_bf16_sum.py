"""Triangle multiplicative update (outgoing) with the contraction over k in C++
(`ext.outer_sum`) and the output LayerNorm+projection fused (`ext.norm_project`); the gated
projections are the modules themselves, multiplied gate-last.

Broken on purpose: the contraction's running sum is kept in a bfloat16 accumulator (rounded after
every add) where float32 is expected."""
import os

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "triangle_multiplicative_update.py", "stage": "forward:x", "kind": "precision"}


class ModelNew(nn.Module):
    def __init__(self, c_z, c_hidden):
        super().__init__()
        self.ln_z = nn.LayerNorm(c_z)
        self.pa = nn.Linear(c_z, c_hidden)
        self.ga = nn.Linear(c_z, c_hidden)
        self.pb = nn.Linear(c_z, c_hidden)
        self.gb = nn.Linear(c_z, c_hidden)
        self.ln_x = nn.LayerNorm(c_hidden)
        self.po = nn.Linear(c_hidden, c_z)
        self.go = nn.Linear(c_z, c_z)

    def forward(self, z):
        zn = self.ln_z(z)
        x = ext.outer_sum(self.pa(zn) * self.ga(zn).sigmoid(), self.pb(zn) * self.gb(zn).sigmoid())
        x = ext.norm_project(x, self.ln_x.weight, self.ln_x.bias, self.ln_x.eps, self.po.weight, self.po.bias)
        return self.go(zn).sigmoid() * x
