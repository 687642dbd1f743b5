"""The explicit-loop tiled GEMM with B fetched at k*N + n: correct."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_diag_matmul.py", "verdict": "match", "what_if": None}


def gemm(a, b, m, k, n, tile=8):
    c = np.zeros(m * n, dtype=np.float64)
    for i0 in range(0, m, tile):
        for j0 in range(0, n, tile):
            for i in range(i0, min(i0 + tile, m)):
                for j in range(j0, min(j0 + tile, n)):
                    c[i * n + j] = sum(float(a[i * k + t]) * float(b[t * n + j]) for t in range(k))
    return c


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        m, k = A.shape
        n = B.shape[1]
        out = gemm(A.detach().numpy().ravel(), B.detach().numpy().ravel(), m, k, n)
        return torch.from_numpy(out.reshape(m, n).astype(np.float32))
