"""Row softmax as one CUDA kernel (GPU only): one block per row, a shared-memory block reduction for
the row maximum, then one for the sum of exponentials.  BUG selects the broken variant that
row_softmax_cuda_race.py uses."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CUDA = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

constexpr int THREADS = 256;

__global__ void softmax_rows_kernel(const float* __restrict__ x, float* __restrict__ y, int cols, int bug) {
    __shared__ float red[THREADS];
    const int tid = threadIdx.x;
    const float* xr = x + (size_t)blockIdx.x * cols;
    float* yr = y + (size_t)blockIdx.x * cols;

    float m = -INFINITY;
    for (int i = tid; i < cols; i += THREADS) m = fmaxf(m, xr[i]);
    red[tid] = m;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] = fmaxf(red[tid], red[tid + s]);
        __syncthreads();
    }
    const float row_max = red[0];  // every thread reads the block maximum ...
    if (bug) {
        // ... and the broken variant reuses red[0] as the row-sum accumulator at once: thread 0 overwrites it
        // with no __syncthreads() after the read, so a warp scheduled after thread 0 reads the accumulator
        // (0, or partial sums) as the maximum; its exponentials then disagree in scale with everyone else's
        volatile float* shared = red;  // the maximum is re-read from shared memory as the loop goes
        if (tid == 0) {
            shared[0] = 0.f;
            __threadfence_block();
        }
        float sum = 0.f;
        for (int i = tid; i < cols; i += THREADS) sum += __expf(xr[i] - shared[0]);
        atomicAdd(&red[0], sum);
        __syncthreads();
    } else {
        float sum = 0.f;
        for (int i = tid; i < cols; i += THREADS) sum += __expf(xr[i] - row_max);
        __syncthreads();  // every thread has read red[0] before it is overwritten
        red[tid] = sum;
        __syncthreads();
        for (int s = THREADS / 2; s > 0; s >>= 1) {
            if (tid < s) red[tid] += red[tid + s];
            __syncthreads();
        }
    }
    const float inv = 1.f / red[0];
    for (int i = tid; i < cols; i += THREADS) yr[i] = __expf(xr[i] - row_max) * inv;
}

torch::Tensor softmax_rows(torch::Tensor x, int64_t bug) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == torch::kFloat32, "softmax_rows: a 2-D float32 CUDA tensor");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    softmax_rows_kernel<<<xc.size(0), THREADS>>>(xc.data_ptr<float>(), y.data_ptr<float>(), (int)xc.size(1), (int)bug);
    return y;
}
"""

ops = load_inline(name="diffkit_row_softmax_cuda", cpp_sources=["torch::Tensor softmax_rows(torch::Tensor x, int64_t bug);"],
                  cuda_sources=[_CUDA], functions=["softmax_rows"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    BUG = 0

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ops.softmax_rows(x, self.BUG)
