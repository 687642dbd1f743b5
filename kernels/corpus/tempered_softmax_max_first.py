"""Tempered softmax pooling with the temperature folded into a C++ softmax
(`ext.softmax_temp(logits, T)` = softmax(logits / T), two reference stages); the two projections
are F.linear / addmm, passed inline.

Broken on purpose: the kernel takes the row maximum of the raw logits and subtracts it after
dividing by T, i.e. exp(x/T - max(x)) instead of exp((x - max(x))/T): with T = 0.01 the exponent
reaches a few hundred, overflows to inf, and inf/inf gives NaN."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load

ext = load(name="diffkit_corpus_ops", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus_ops.cpp")], extra_cflags=["-O2"])

DIFFKIT_EXPECT = {"reference": "tempered_softmax.py", "stage": "forward:weights", "kind": "nan_inf"}


class ModelNew(nn.Module):
    def __init__(self, dim, temperature):
        super().__init__()
        self.t = temperature
        self.q = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        flat = x.reshape(b * n, d)
        p = ext.softmax_temp(F.linear(flat, self.q.weight, self.q.bias), self.t)
        return (p * torch.addmm(self.v.bias, flat, self.v.weight.t())).view(b, n, d)
