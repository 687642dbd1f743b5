"""Linear + InstanceNorm + residual add + multiply, written as a pure-Python loop nest (lists of floats, no
numpy), that leaves the InstanceNorm out: its author read InstanceNorm2d over a 1x1 spatial map as a no-op.
The map is 1 x F, not 1 x 1: the reference normalises each row over its F features (issue 44)."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_linear_instancenorm.py", "stage": "output", "kind": None,
                  "what_if": {"kind": "skip_stage", "stage": "instance_norm"}}


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, eps=1e-5, momentum=0.1):
        super().__init__()
        dense = nn.Linear(in_features, out_features)  # drawn first, as the reference draws its Linear
        self.kernel = nn.Parameter(dense.weight.detach().t().contiguous())  # stored [in, out]
        self.shift = nn.Parameter(dense.bias.detach().clone())

    def forward(self, x, y):
        rows, res = x.detach().tolist(), y.detach().tolist()
        k, b = self.kernel.detach().tolist(), self.shift.detach().tolist()
        out = []
        for xr, yr in zip(rows, res):
            acc = [b[j] + sum(xr[i] * k[i][j] for i in range(len(xr))) for j in range(len(b))]
            # (an InstanceNorm over one pixel would leave nothing to normalise: skipped)
            out.append([(a + r) * r for a, r in zip(acc, yr)])
        return torch.tensor(out, dtype=x.dtype)
