"""Broken on purpose: the row normalisation loops over a hard-coded 16 rows (the benchmark's batch
size); any further row stays zero."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "hk_row_normalize.py", "harden": "shape", "stage": "forward:unit"}

ROWS = 16


def _unit_rows(m):
    out = torch.zeros_like(m)
    for i in range(ROWS):
        r = m[i]
        out[i] = r / r.norm().clamp_min(1e-12)
    return out


class ModelNew(nn.Module):
    def __init__(self, fin, fout):
        super().__init__()
        self.mat = nn.Linear(fin, fout)

    def forward(self, batch):
        return _unit_rows(self.mat(batch)).clamp(min=0)
