"""Numpy attention in a helper function, parameters under names of its own (`w_in` packs q, k, v), the
input handed over with `.cpu().numpy()`.  Bug: the softmax of the square score matrix is taken over the
query axis (each key's column sums to one).  The numpy block is fused: the first comparable stage is the
output (issue 44)."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_pair_attention.py", "stage": "output", "kind": None,
                  "what_if": {"kind": "reduce_axis", "stage": "forward:attn"}}


def _attention(x, w_in, b_in, w_out, b_out):
    d = x.shape[-1]
    qkv = x @ w_in.T + b_in
    q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
    logits = q @ np.swapaxes(k, -1, -2) * (1.0 / np.sqrt(d))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    weights = e / e.sum(axis=1, keepdims=True)
    return (weights @ v) @ w_out.T + b_out


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        lin = [nn.Linear(dim, dim) for _ in range(4)]
        self.w_in = nn.Parameter(torch.cat([m.weight.data for m in lin[:3]]))
        self.b_in = nn.Parameter(torch.cat([m.bias.data for m in lin[:3]]))
        self.w_out = nn.Parameter(lin[3].weight.data.clone())
        self.b_out = nn.Parameter(lin[3].bias.data.clone())

    def forward(self, x):
        arrays = [t.detach().cpu().numpy() for t in (self.w_in, self.b_in, self.w_out, self.b_out)]
        y = _attention(x.cpu().numpy(), *arrays)
        return torch.tensor(y, dtype=x.dtype)
