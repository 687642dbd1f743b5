"""The product written into an np.empty buffer one block of 6 columns at a time; the loop stops at
N // 6 blocks, so the last 4 of 16 columns are never written and hold whatever that memory held."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_diag_matmul.py", "stage": "output", "kind": "unwritten_region", "what_if": None}

COLS = 6


def column_blocks(a, b):
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.float32)
    for j in range(b.shape[1] // COLS):
        out[:, j * COLS:(j + 1) * COLS] = a @ b[:, j * COLS:(j + 1) * COLS]
    return out


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.from_numpy(column_blocks(A.detach().numpy(), B.detach().numpy()))
