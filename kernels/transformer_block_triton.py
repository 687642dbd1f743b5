"""Transformer block with Triton kernels (GPU only): the attention softmax (autotuned over warp
counts, several rows per program) and the MLP's bias + erf-GELU epilogue; matmuls in torch.
`ROWS_BUG` makes the softmax grid round the row count down (the tail rows are never written)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

ROWS = 5  # softmax rows per program (the reference's 96 rows leave a partial last program)


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (1, 2, 4)], key=["n_cols"])
@triton.jit
def softmax_rows_kernel(out_ptr, in_ptr, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    for r in range(ROWS):
        row = tl.program_id(0) * ROWS + r
        mask = (cols < n_cols) & (row < n_rows)
        x = tl.load(in_ptr + row * n_cols + cols, mask=mask, other=-float("inf"))
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        tl.store(out_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def bias_gelu_kernel(out_ptr, in_ptr, bias_ptr, n, n_cols, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(in_ptr + offs, mask=mask) + tl.load(bias_ptr + offs % n_cols, mask=mask)
    tl.store(out_ptr + offs, 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476)), mask=mask)


class ModelNew(nn.Module):
    ROWS_BUG = False

    def __init__(self, dim, heads, mlp_ratio):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x):
        b, s, dim = x.shape
        h = self.heads
        d = dim // h
        y = self.ln1(x)
        qkv = self.qkv(y).reshape(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        scores = (q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d))).contiguous()
        attn = torch.empty_like(scores)
        n_rows = scores.numel() // s
        grid = (n_rows // ROWS,) if self.ROWS_BUG else (triton.cdiv(n_rows, ROWS),)
        softmax_rows_kernel[grid](attn, scores, n_rows, s, ROWS=ROWS, BLOCK=triton.next_power_of_2(s))
        ctx = (attn @ v).transpose(1, 2).reshape(b, s, dim)
        x = x + self.proj(ctx)
        y = self.ln2(x)
        pre = (y @ self.fc1.weight.t()).contiguous()
        hidden = torch.empty_like(pre)
        bias_gelu_kernel[(triton.cdiv(pre.numel(), 1024),)](hidden, pre, self.fc1.bias, pre.numel(), pre.shape[-1],
                                                            BLOCK=1024)
        x = x + self.fc2(hidden)
        return x

