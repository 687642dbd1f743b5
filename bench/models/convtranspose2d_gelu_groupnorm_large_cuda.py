"""ConvTranspose2d (cuDNN, through the functional call) followed by one CUDA pass for each group's statistics of
the GELU and one that applies GELU, the group's normalisation and the affine (CUDA only).  The candidate issue 46's
memory benchmark diffs at KernelBench level 2 problem 19's sizes: the GELU'd activation is never stored, so the
candidate holds two activations where the reference holds three.  (In bench/models/, not kernels/: at these
sizes a CPU-only suite over kernels/ would run the reference for minutes before finding the candidate needs CUDA.)"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

_SRC = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__device__ __forceinline__ float gelu_erf(float v) { return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)); }

// one block per (sample, group): sum and sum of squares of gelu(x) over the group's channels and pixels
__global__ void group_moments(const float* __restrict__ x, float2* __restrict__ moments, long per_group) {
    const float* p = x + (long)blockIdx.x * per_group;
    double s = 0.0, s2 = 0.0;
    for (long i = threadIdx.x; i < per_group; i += blockDim.x) {
        float g = gelu_erf(p[i]);
        s += g;
        s2 += (double)g * g;
    }
    __shared__ double acc[2][32];
    for (int off = 16; off > 0; off >>= 1) {
        s += __shfl_down_sync(0xffffffff, s, off);
        s2 += __shfl_down_sync(0xffffffff, s2, off);
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { acc[0][warp] = s; acc[1][warp] = s2; }
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x / 32;
        s = lane < warps ? acc[0][lane] : 0.0;
        s2 = lane < warps ? acc[1][lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) {
            s += __shfl_down_sync(0xffffffff, s, off);
            s2 += __shfl_down_sync(0xffffffff, s2, off);
        }
        if (lane == 0) {
            double mean = s / per_group;
            moments[blockIdx.x] = make_float2((float)mean, (float)(s2 / per_group - mean * mean));
        }
    }
}

__global__ void gelu_normalise(const float* __restrict__ x, const float2* __restrict__ moments,
                               const float* __restrict__ gamma, const float* __restrict__ beta, float* __restrict__ y,
                               long total, long hw, int channels, int per_group_channels, float eps) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        long nc = i / hw;
        int c = (int)(nc % channels);
        long grp = (nc / channels) * (channels / per_group_channels) + c / per_group_channels;
        float2 m = moments[grp];
        y[i] = (gelu_erf(x[i]) - m.x) * rsqrtf(m.y + eps) * gamma[c] + beta[c];
    }
}

torch::Tensor gelu_group_norm(torch::Tensor x, torch::Tensor gamma, torch::Tensor beta, int64_t groups, double eps) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.dim() == 4, "gelu_group_norm: NCHW float32 on CUDA");
    auto xc = x.contiguous();
    const long n = xc.size(0), c = xc.size(1), hw = xc.size(2) * xc.size(3);
    const long per_group = (c / groups) * hw;
    auto moments = torch::empty({n * groups, 2}, xc.options());
    group_moments<<<n * groups, 512>>>(xc.data_ptr<float>(), reinterpret_cast<float2*>(moments.data_ptr<float>()), per_group);
    auto y = torch::empty_like(xc);
    const long total = xc.numel();
    gelu_normalise<<<4096, 256>>>(xc.data_ptr<float>(), reinterpret_cast<const float2*>(moments.data_ptr<float>()),
                                  gamma.contiguous().data_ptr<float>(), beta.contiguous().data_ptr<float>(),
                                  y.data_ptr<float>(), total, hw, (int)c, (int)(c / groups), (float)eps);
    return y;
}
"""

_ext = load_inline(name="diffkit_l2_19_gelu_groupnorm", cpp_sources=[
    "torch::Tensor gelu_group_norm(torch::Tensor x, torch::Tensor gamma, torch::Tensor beta, int64_t groups, double eps);"],
    cuda_sources=[_SRC], functions=["gelu_group_norm"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, groups, num_groups):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride=stride)
        self.group_norm = nn.GroupNorm(num_groups=num_groups, num_channels=out_channels)

    def forward(self, x):
        t = F.conv_transpose2d(x, self.conv_transpose.weight, self.conv_transpose.bias,
                               stride=self.conv_transpose.stride)
        gn = self.group_norm
        return _ext.gelu_group_norm(t, gn.weight, gn.bias, gn.num_groups, gn.eps)
