// CUDA kernels for the axial-attention candidate (float32, contiguous).
//   ln_linear: fused LayerNorm + Linear, one block per row; the normalised row lives in shared memory.
//   linear:    y = x W^T + b, one block per TILE rows.
// `bug` selects a deliberately broken variant (0 = correct):
//   1  RACE      the __syncthreads() between writing the normalised row and reading it is missing
//   2  TAIL      the grid covers M / TILE tiles: the last partial tile is never written
//   4  SMEM      the normalised row goes to a fixed 64-float shared buffer: rows wider than 64 overflow it
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <c10/cuda/CUDAStream.h>

#define TILE 16

__device__ float block_sum(float v, float* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  float r = red[0];
  __syncthreads();
  return r;
}

__global__ void ln_linear_kernel(const float* x, const float* g, const float* beta, float eps, const float* W,
                                 const float* b, float* y, int K, int N, int bug) {
  extern __shared__ float sh[];
  __shared__ float fixed_row[64];
  float* red = sh;                  // blockDim.x floats
  float* row = (bug & 4) ? fixed_row : sh + blockDim.x;  // K floats (or the fixed 64)
  const float* xr = x + (size_t)blockIdx.x * K;
  float s = 0.f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) s += xr[k];
  const float mean = block_sum(s, red) / K;
  float v = 0.f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) { float d = xr[k] - mean; v += d * d; }
  const float inv = rsqrtf(block_sum(v, red) / K + eps);
  for (int k = threadIdx.x; k < K; k += blockDim.x) row[k] = (xr[k] - mean) * inv * g[k] + beta[k];
  if (!(bug & 1)) __syncthreads();
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    float acc = b ? b[n] : 0.f;
    const float* w = W + (size_t)n * K;
    for (int k = 0; k < K; ++k) acc += row[k] * w[k];
    y[(size_t)blockIdx.x * N + n] = acc;
  }
}

__global__ void linear_kernel(const float* x, const float* W, const float* b, float* y, int M, int K, int N) {
  for (int r = 0; r < TILE; ++r) {
    const int m = blockIdx.x * TILE + r;
    if (m >= M) return;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
      float acc = b ? b[n] : 0.f;
      for (int k = 0; k < K; ++k) acc += x[(size_t)m * K + k] * W[(size_t)n * K + k];
      y[(size_t)m * N + n] = acc;
    }
  }
}

static void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name, " must be contiguous float32");
}

torch::Tensor ln_linear(torch::Tensor x, torch::Tensor g, torch::Tensor beta, double eps, torch::Tensor W,
                        c10::optional<torch::Tensor> b, int64_t bug) {
  check(x, "x"); check(W, "weight");
  const int M = x.size(0), K = x.size(1), N = W.size(0);
  auto y = torch::empty({M, N}, x.options());
  const int threads = 128;
  const size_t smem = (threads + ((bug & 4) ? 0 : K)) * sizeof(float);
  ln_linear_kernel<<<M, threads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), g.data_ptr<float>(), beta.data_ptr<float>(), (float)eps, W.data_ptr<float>(),
      b.has_value() && b->defined() ? b->data_ptr<float>() : nullptr, y.data_ptr<float>(), K, N, (int)bug);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor W, c10::optional<torch::Tensor> b, int64_t bug) {
  check(x, "x"); check(W, "weight");
  const int M = x.size(0), K = x.size(1), N = W.size(0);
  auto y = torch::zeros({M, N}, x.options());
  const int blocks = (bug & 2) ? M / TILE : (M + TILE - 1) / TILE;
  if (blocks > 0)
    linear_kernel<<<blocks, 128, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), W.data_ptr<float>(), b.has_value() && b->defined() ? b->data_ptr<float>() : nullptr,
        y.data_ptr<float>(), M, K, N);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}
