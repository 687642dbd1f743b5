"""The product computed in row tiles of 16 into an output from torch.empty; the launch covers
M // 16 tiles, so the last, partial tile (rows 16..23 of 24) is never written and holds whatever the
allocator's memory held -- which changes from one call to the next."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_diag_matmul.py", "stage": "output", "kind": "unwritten_region", "what_if": None}

ROWS = 16


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        m, n = A.shape[0], B.shape[1]
        out = torch.empty(m, n)
        a, b = A.detach().numpy(), B.detach().numpy()
        dst = out.numpy()
        for t in range(m // ROWS):
            rows = slice(t * ROWS, (t + 1) * ROWS)
            dst[rows] = a[rows] @ b
        return out
