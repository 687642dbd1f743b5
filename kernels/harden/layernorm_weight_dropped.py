"""Broken on purpose: the LayerNorm is computed in NumPy (float32, two-pass variance) and only its
bias is applied: the weight, 1 at default init, is dropped."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFKIT_EXPECT = {"reference": "hk_layernorm_gelu_proj.py", "harden": "init", "stage": "norm"}


def _standardise(a: np.ndarray, eps: float) -> np.ndarray:
    mu = a.mean(axis=-1, keepdims=True)
    centred = a - mu
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(var + np.float32(eps))


class ModelNew(nn.Module):
    def __init__(self, width, expand):
        super().__init__()
        self.pre = nn.LayerNorm(width)
        self.up = nn.Linear(width, expand)

    def forward(self, tokens):
        z = _standardise(tokens.detach().cpu().numpy(), self.pre.eps)
        normed = torch.from_numpy(np.ascontiguousarray(z)).to(tokens.device) + self.pre.bias
        return F.gelu(F.linear(normed, self.up.weight, self.up.bias))
