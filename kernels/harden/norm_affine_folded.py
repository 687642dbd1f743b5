"""Correct: the LayerNorm's affine is folded into the projection at every call
(W' = W diag(gamma), b' = W beta + b); the statistics are sums divided by the width (another order of
summation than the reference's kernel), the projection one addmm on the standardised rows."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "hk_norm_then_proj.py", "harden": None}


class ModelNew(nn.Module):
    def __init__(self, n, m):
        super().__init__()
        self.norm = nn.LayerNorm(n)
        self.lin = nn.Linear(n, m)

    def _folded(self):
        w = self.lin.weight * self.norm.weight.unsqueeze(0)
        b = self.lin.bias + self.lin.weight @ self.norm.bias
        return w, b

    def forward(self, x):
        n = x.shape[-1]
        centred = x - x.sum(-1, keepdim=True) / n
        inv = torch.rsqrt((centred * centred).sum(-1, keepdim=True) / n + self.norm.eps)
        w, b = self._folded()
        y = torch.addmm(b, centred * inv, w.t())
        return y * torch.sigmoid(y)
