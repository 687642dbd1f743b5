"""A shared-memory tiled CUDA GEMM (GPU only), 16×16 tiles over A [M, K] and B [K, N] with bounds checks on the
tails.  The tile of B is staged from `b[kk * ... ]` with the strides swapped: element (k, n) is read at
`n * K + k`, as if B were stored column-major (the layout cuBLAS assumes).  `FLIP = 0` is the correct kernel
(diag_gemm_cuda_ok.py imports it that way)."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

DIFFKIT_EXPECT = {"reference": "why_diag_matmul.py", "stage": "output", "kind": "transposed_operand",
                  "what_if": None, "device": "cuda"}

FLIP = 1

_SRC = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

#define TS 16

__global__ void tiled_mm(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                         int m, int k, int n, int flip) {
    __shared__ float sa[TS][TS];
    __shared__ float sb[TS][TS];
    const int row = blockIdx.y * TS + threadIdx.y, col = blockIdx.x * TS + threadIdx.x;
    float acc = 0.f;
    for (int t = 0; t < k; t += TS) {
        const int ka = t + threadIdx.x, kb = t + threadIdx.y;
        sa[threadIdx.y][threadIdx.x] = (row < m && ka < k) ? a[(size_t)row * k + ka] : 0.f;
        const size_t bi = flip ? (size_t)col * k + kb : (size_t)kb * n + col;
        sb[threadIdx.y][threadIdx.x] = (kb < k && col < n) ? b[bi] : 0.f;
        __syncthreads();
        #pragma unroll
        for (int q = 0; q < TS; ++q) acc += sa[threadIdx.y][q] * sb[q][threadIdx.x];
        __syncthreads();
    }
    if (row < m && col < n) c[(size_t)row * n + col] = acc;
}

torch::Tensor gemm(torch::Tensor a, torch::Tensor b, int64_t flip) {
    auto A = a.contiguous(), B = b.contiguous();
    const int m = A.size(0), k = A.size(1), n = B.size(1);
    auto C = torch::empty({m, n}, A.options());
    dim3 block(TS, TS), grid((n + TS - 1) / TS, (m + TS - 1) / TS);
    tiled_mm<<<grid, block>>>(A.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(), m, k, n, (int)flip);
    return C;
}
"""

_ext = None


def ext():
    global _ext
    if _ext is None:
        _ext = load_inline("diffkit_why_tiled_gemm", cpp_sources="torch::Tensor gemm(torch::Tensor a, torch::Tensor b, "
                           "int64_t flip);", cuda_sources=_SRC, functions=["gemm"], verbose=False)
    return _ext


class ModelNew(nn.Module):
    def forward(self, A, B):
        return ext().gemm(A, B, FLIP)
