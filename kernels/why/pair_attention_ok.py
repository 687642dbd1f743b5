"""Numpy attention, correct: everything after the input in numpy (einsum projections, softmax over the key
axis), parameters and input handed over with `.detach().numpy()`, the result handed back with
`torch.from_numpy` (issue 44: a copy taken only to call numpy is no computation, and must not be paired as
one)."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_pair_attention.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        xs = x.detach().numpy()

        def lin(mod, a):
            return np.einsum("...i,oi->...o", a, mod.weight.detach().numpy()) + mod.bias.detach().numpy()

        q, k, v = lin(self.q_proj, xs), lin(self.k_proj, xs), lin(self.v_proj, xs)
        s = np.einsum("bid,bjd->bij", q, k) * np.float32(q.shape[-1] ** -0.5)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        return torch.from_numpy(lin(self.out_proj, np.einsum("bij,bjd->bid", s, v)).astype(np.float32))
