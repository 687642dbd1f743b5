"""Numpy attention whose softmax normalises over the query axis of the square [N, N] score matrix (axis -2,
not -1).  The input is detached only to hand it to numpy; the whole attention is one numpy block, so the
first stage diffkit can compare is the output (issue 44)."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_pair_attention.py", "stage": "output", "kind": None,
                  "what_if": {"kind": "reduce_axis", "stage": "forward:attn"}}


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        xs = x.detach().numpy()
        wq, bq = self.q_proj.weight.detach().numpy(), self.q_proj.bias.detach().numpy()
        wk, bk = self.k_proj.weight.detach().numpy(), self.k_proj.bias.detach().numpy()
        wv, bv = self.v_proj.weight.detach().numpy(), self.v_proj.bias.detach().numpy()
        wo, bo = self.out_proj.weight.detach().numpy(), self.out_proj.bias.detach().numpy()
        q = np.einsum("bnd,ed->bne", xs, wq) + bq
        k = np.einsum("bnd,ed->bne", xs, wk) + bk
        v = np.einsum("bnd,ed->bne", xs, wv) + bv
        s = np.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1])
        s = s - s.max(axis=-2, keepdims=True)
        p = np.exp(s)
        p = p / p.sum(axis=-2, keepdims=True)  # the query axis: columns sum to one, not rows
        ctx = np.einsum("bqk,bkd->bqd", p, v)
        out = ctx @ wo.T + bo
        return torch.from_numpy(out.astype(np.float32))
