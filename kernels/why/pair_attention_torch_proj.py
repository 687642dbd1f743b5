"""Projections in torch, attention in numpy: q, k, v come from the model's Linears, go to numpy with
`np.asarray(t.detach())`, and the context comes back through `torch.as_tensor` before the output Linear.
Bug: the softmax of the square score matrix normalises over the query axis.  The context (named `mixed`
here) is the first record that comes back from numpy: it is where the error first shows (issue 44)."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_pair_attention.py", "stage": "forward:ctx", "kind": None,
                  "what_if": {"kind": "reduce_axis", "stage": "forward:attn"}}


def _softmax_cols(s):
    s = s - s.max(axis=-2, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-2, keepdims=True)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        q = np.asarray(self.q_proj(x).detach())
        k = np.asarray(self.k_proj(x).detach())
        v = np.asarray(self.v_proj(x).detach())
        s = np.matmul(q, k.transpose(0, 2, 1)) / np.sqrt(q.shape[-1])
        mixed = torch.as_tensor(np.matmul(_softmax_cols(s), v), dtype=torch.float32)
        return self.out_proj(mixed)
