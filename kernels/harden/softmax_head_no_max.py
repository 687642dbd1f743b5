"""Broken on purpose: the softmax exponentiates the raw scores (no max subtraction).  Scores of order 1
at get_inputs() scale are exact; at x100 exp overflows to inf and inf/inf gives NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFKIT_EXPECT = {"reference": "hk_softmax_head.py", "harden": "inputs", "stage": "forward:probs"}


def naive_softmax(s):
    e = torch.exp(s)
    return e / e.sum(dim=1, keepdim=True)


class ModelNew(nn.Module):
    def __init__(self, d, c):
        super().__init__()
        self.wq = nn.Linear(d, c)
        self.wv = nn.Linear(d, c)

    def forward(self, feats):
        p = naive_softmax(F.linear(feats, self.wq.weight, self.wq.bias))
        return p.mul(F.linear(feats, self.wv.weight, self.wv.bias))
