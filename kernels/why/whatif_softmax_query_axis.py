"""Single-head attention as one numpy function fed the model's input and the three projections' parameters
(each `.detach().numpy()`), the score matrix square (8 x 8 tokens).  The softmax is normalised over the
QUERY axis (axis 1 of [batch, query, key]): every column of weights sums to one instead of every row, and all
shapes agree (issue 44)."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_attention_square.py", "stage": "output", "kind": None,
                  "what_if": {"kind": "reduce_axis", "stage": "forward:weights"}}


def attend(tokens, wq, bq, wk, bk, wv, bv):
    q = np.einsum("btd,ed->bte", tokens, wq) + bq
    k = np.einsum("btd,ed->bte", tokens, wk) + bk
    v = np.einsum("btd,ed->bte", tokens, wv) + bv
    logits = np.einsum("bqe,bke->bqk", q, k) / np.sqrt(tokens.shape[-1])
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    w = e / e.sum(axis=1, keepdims=True)  # over the queries
    return np.einsum("bqk,bke->bqe", w, v)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

    def forward(self, x):
        params = [t.detach().numpy() for m in (self.query, self.key, self.value) for t in (m.weight, m.bias)]
        return torch.from_numpy(attend(x.detach().numpy(), *params).astype(np.float32))
