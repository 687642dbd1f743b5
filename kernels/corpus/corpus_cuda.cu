// CUDA kernels behind the GPU candidates in kernels/corpus/ (float32, contiguous, one block per
// row unless said otherwise).  Like corpus_ops.cpp: some are correct, the others carry one
// realistic bug each, documented in the candidate file that calls them, not here.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 128;
constexpr int kRowsPerBlock = 8;

// Sum over the block; `scratch` holds blockDim.x floats.  Every thread gets the total.
__device__ float block_total(float v, float* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) scratch[threadIdx.x] += scratch[threadIdx.x + half];
    __syncthreads();
  }
  const float total = scratch[0];
  __syncthreads();
  return total;
}

// LayerNorm of row blockIdx.x into shared memory, then y = LN(x) W^T + b for all N outputs.
__global__ void ln_qkv_kernel(const float* __restrict__ x, const float* __restrict__ gamma,
                              const float* __restrict__ beta, float eps, const float* __restrict__ W,
                              const float* __restrict__ b, float* __restrict__ y, int D, int N) {
  extern __shared__ float shm[];
  float* scratch = shm;           // kThreads
  float* row = shm + blockDim.x;  // D
  const float* xr = x + (size_t)blockIdx.x * D;
  float s = 0.f;
  for (int k = threadIdx.x; k < D; k += blockDim.x) s += xr[k];
  const float mean = block_total(s, scratch) / D;
  float q = 0.f;
  for (int k = threadIdx.x; k < D; k += blockDim.x) {
    const float c = xr[k] - mean;
    q += c * c;
  }
  const float rstd = rsqrtf(block_total(q, scratch) / D + eps);
  for (int k = threadIdx.x; k < D; k += blockDim.x) row[k] = (xr[k] - mean) * rstd * gamma[k] + beta[k];
  __syncthreads();
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    const float* w = W + (size_t)n * D;
    float acc = b[n];
    for (int k = 0; k < D; ++k) acc += row[k] * w[k];
    y[(size_t)blockIdx.x * N + n] = acc;
  }
}

// y = x W^T for one row per block.
__global__ void proj_kernel(const float* __restrict__ x, const float* __restrict__ W, float* __restrict__ y, int K,
                            int N) {
  extern __shared__ float row[];
  const float* xr = x + (size_t)blockIdx.x * K;
  for (int k = threadIdx.x; k < K; k += blockDim.x) row[k] = xr[k];
  __syncthreads();
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    const float* w = W + (size_t)n * K;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += row[k] * w[k];
    y[(size_t)blockIdx.x * N + n] = acc;
  }
}

// RMSNorm -> [gate | up] from one concatenated weight [2H, D] -> silu(gate) * up.
__global__ void rms_swiglu_kernel(const float* __restrict__ x, const float* __restrict__ w, float eps,
                                  const float* __restrict__ Wgu, const float* __restrict__ bgu,
                                  float* __restrict__ y, int D, int H) {
  extern __shared__ float shm[];
  float* scratch = shm;
  float* h = shm + blockDim.x;
  const float* xr = x + (size_t)blockIdx.x * D;
  float ss = 0.f;
  for (int k = threadIdx.x; k < D; k += blockDim.x) ss += xr[k] * xr[k];
  const float inv = rsqrtf(block_total(ss, scratch) / D + eps);
  for (int k = threadIdx.x; k < D; k += blockDim.x) h[k] = xr[k] * inv * w[k];
  __syncthreads();
  for (int j = threadIdx.x; j < H; j += blockDim.x) {
    const float* wg = Wgu + (size_t)j * D;
    const float* wu = Wgu + (size_t)(H + j) * D;
    float g = bgu[j], u = bgu[H + j];
    for (int k = 0; k < D; ++k) {
      g += h[k] * wg[k];
      u += h[k] * wu[k];
    }
    y[(size_t)blockIdx.x * H + j] = g / (1.f + expf(-g)) * u;
  }
}

// y = x W^T + b, kRowsPerBlock rows per block.
__global__ void rows_linear_kernel(const float* __restrict__ x, const float* __restrict__ W,
                                   const float* __restrict__ b, float* __restrict__ y, int M, int K, int N) {
  for (int r = 0; r < kRowsPerBlock; ++r) {
    const int m = blockIdx.x * kRowsPerBlock + r;
    if (m >= M) return;
    const float* xr = x + (size_t)m * K;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
      const float* w = W + (size_t)n * K;
      float acc = b[n];
      for (int k = 0; k < K; ++k) acc += xr[k] * w[k];
      y[(size_t)m * N + n] = acc;
    }
  }
}

void expect_cuda(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              ": expected a contiguous float32 CUDA tensor");
}

}  // namespace

torch::Tensor ln_qkv(torch::Tensor x, torch::Tensor gamma, torch::Tensor beta, double eps, torch::Tensor W,
                     torch::Tensor b) {
  expect_cuda(x, "x");
  expect_cuda(W, "W");
  const int M = x.size(0), D = x.size(1), N = W.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  ln_qkv_kernel<<<M, kThreads, (kThreads + D) * sizeof(float), c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), gamma.data_ptr<float>(), beta.data_ptr<float>(), (float)eps, W.data_ptr<float>(),
      b.data_ptr<float>(), y.data_ptr<float>(), D, N);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

torch::Tensor proj(torch::Tensor x, torch::Tensor W) {
  expect_cuda(x, "x");
  expect_cuda(W, "W");
  const int M = x.size(0), K = x.size(1), N = W.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  proj_kernel<<<M, kThreads, K * sizeof(float), c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), W.data_ptr<float>(), y.data_ptr<float>(), K, N);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

torch::Tensor rms_swiglu(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor Wgu, torch::Tensor bgu) {
  expect_cuda(x, "x");
  expect_cuda(Wgu, "Wgu");
  const int M = x.size(0), D = x.size(1), H = Wgu.size(0) / 2;
  auto y = torch::empty({M, H}, x.options());
  if (M == 0) return y;
  rms_swiglu_kernel<<<M, kThreads, (kThreads + D) * sizeof(float), c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), w.data_ptr<float>(), (float)eps, Wgu.data_ptr<float>(), bgu.data_ptr<float>(),
      y.data_ptr<float>(), D, H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

torch::Tensor rows_linear(torch::Tensor x, torch::Tensor W, torch::Tensor b) {
  expect_cuda(x, "x");
  expect_cuda(W, "W");
  const int M = x.size(0), K = x.size(1), N = W.size(0);
  auto y = torch::zeros({M, N}, x.options());
  const int blocks = M / kRowsPerBlock;
  if (blocks == 0) return y;
  rows_linear_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), W.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ln_qkv", &ln_qkv, "LayerNorm + Linear (with bias), one block per row");
  m.def("proj", &proj, "output projection, one block per row");
  m.def("rms_swiglu", &rms_swiglu, "RMSNorm + gate/up projection + silu(gate) * up");
  m.def("rows_linear", &rows_linear, "Linear with bias, 8 rows per block");
}
