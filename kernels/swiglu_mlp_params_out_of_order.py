"""Broken on purpose: the parameters are made by hand (nn.Parameter over torch.empty, nn.Linear's own
init), under other names, and the projections before the norm's weight.  KernelBench seeds once before
each constructor, so every parameter draws other random numbers than the reference's: the output is
wrong from the first stage that reads one, the norm, though every kernel is right."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFKIT_EXPECT = {"reference": "swiglu_mlp.py", "stage": "norm", "kind": "other_weights"}


def _dense(n_in, n_out):
    weight = torch.empty(n_out, n_in)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    bound = 1.0 / math.sqrt(n_in)
    return nn.Parameter(weight), nn.Parameter(torch.empty(n_out).uniform_(-bound, bound))


class ModelNew(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.wg, self.bg = _dense(dim, hidden)
        self.wu, self.bu = _dense(dim, hidden)
        self.wd, self.bd = _dense(hidden, dim)
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(dim))  # first in the reference, last here
        self.eps = 1e-6

    def forward(self, x):
        rms = torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        normed = x * rms * self.scale
        flat = normed.reshape(-1, normed.shape[-1])
        act = F.silu(torch.addmm(self.bg, flat, self.wg.t())) * torch.addmm(self.bu, flat, self.wu.t())
        return x + torch.addmm(self.bd, act, self.wd.t()).view_as(x)
