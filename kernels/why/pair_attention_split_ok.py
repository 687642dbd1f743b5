"""Attention with the projections in torch (functional calls on the model's weights, kept in the reference's
order) and the score/softmax/context part in numpy, entered with `.cpu().numpy()` and left with
`torch.tensor(array)`.  Correct (issue 44)."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFKIT_EXPECT = {"reference": "why_pair_attention.py", "verdict": "match", "what_if": None}


def _numpy_attention(q, k, v):
    logits = np.matmul(q, np.swapaxes(k, 1, 2)) / np.float32(np.sqrt(q.shape[-1]))
    logits -= logits.max(axis=2, keepdims=True)
    w = np.exp(logits)
    return np.matmul(w / w.sum(axis=2, keepdims=True), v)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        with torch.no_grad():
            proj = [F.linear(x, m.weight, m.bias) for m in (self.q_proj, self.k_proj, self.v_proj)]
            mixed = _numpy_attention(*(t.cpu().numpy() for t in proj))
            return F.linear(torch.tensor(mixed), self.out_proj.weight, self.out_proj.bias)
