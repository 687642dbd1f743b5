"""Broken on purpose: the GEMM + sigmoid runs in 32x32 output tiles and only over the full tiles
(rows and columns beyond the last multiple of 32 are never written; exact at 64 x 96)."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "hk_linear_sigmoid.py", "harden": "shape", "stage": "fc"}

TILE = 32


class TiledDense(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        lin = nn.Linear(k, n)
        self.kernel = lin.weight
        self.offset = lin.bias

    def forward(self, a):
        m, n = a.shape[0], self.kernel.shape[0]
        acc = a.new_zeros(m, n)
        for r0 in range(0, m - m % TILE, TILE):
            for c0 in range(0, n - n % TILE, TILE):
                blk = a[r0:r0 + TILE] @ self.kernel[c0:c0 + TILE].t() + self.offset[c0:c0 + TILE]
                acc[r0:r0 + TILE, c0:c0 + TILE] = blk
        return acc


class ModelNew(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.gemm = TiledDense(k, n)

    def forward(self, a):
        return torch.sigmoid(self.gemm(a))
