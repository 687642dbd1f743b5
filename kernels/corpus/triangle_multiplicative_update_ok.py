"""Triangle multiplicative update (outgoing), correct.  Both gated projections come from one C++
call (`ext.gated_pair`) on a [proj_a; gate_a; proj_b; gate_b] weight packed at run time; the
contraction is an einsum over k; the output LayerNorm, projection and gate are F calls."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "triangle_multiplicative_update.py", "verdict": "match"}


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
        zn = F.layer_norm(z, z.shape[-1:], self.norm_in.weight, self.norm_in.bias, self.norm_in.eps)
        lins = (self.proj_a, self.gate_a, self.proj_b, self.gate_b)
        a, b = ext.gated_pair(zn, torch.cat([m.weight for m in lins]), torch.cat([m.bias for m in lins]))
        x = torch.einsum("zikc,zjkc->zijc", a, b)
        x = F.linear(F.layer_norm(x, x.shape[-1:], self.norm_out.weight, self.norm_out.bias, self.norm_out.eps),
                     self.proj_out.weight, self.proj_out.bias)
        return torch.sigmoid(F.linear(zn, self.gate_out.weight, self.gate_out.bias)) * x
