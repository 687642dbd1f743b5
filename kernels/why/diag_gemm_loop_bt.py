"""A tiled GEMM written as explicit loops over 8×8 output tiles and the K axis (the way a CUDA
kernel stages tiles of A and B), on flat buffers.  B's element (k, n) is fetched at k + n*K, the
index of a column-major B: the kernel reads B's memory as if it were B transposed."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_diag_matmul.py", "stage": "output", "kind": "transposed_operand",
                  "what_if": None}

TILE = 8


def tiled_gemm(a_flat, b_flat, m, k, n):
    c = np.zeros(m * n, dtype=np.float32)
    for i0 in range(0, m, TILE):
        for j0 in range(0, n, TILE):
            for i in range(i0, min(i0 + TILE, m)):
                for j in range(j0, min(j0 + TILE, n)):
                    acc = np.float32(0.0)
                    for kk in range(k):
                        acc += a_flat[i * k + kk] * b_flat[kk + j * k]
                    c[i * n + j] = acc
    return c


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        m, k = A.shape
        n = B.shape[1]
        a = A.detach().contiguous().numpy().ravel()
        b = B.detach().contiguous().numpy().ravel()
        return torch.from_numpy(tiled_gemm(a, b, m, k, n).reshape(m, n))
