// CUDA builds of the kernels the IPA and triangle-update candidates call (float32, contiguous).
// Same functions and signatures as kernels/cpu/ops.cpp, so one model body serves both builds.
//   linear            y = x W^T (+ b), rows in tiles of `tile`
//   layernorm         one block per row, block reductions
//   gated_linear      sigmoid(x Wg^T + bg) * (x Wp^T + bp), one fused kernel
//   triangle_outgoing out[b,i,j,c] = sum_k a[b,i,k,c] * b[b,j,k,c]; a's k-tiles staged in shared memory
//   frame_apply       global = R p + t, or local = R^T (p - t), one thread per point
//   ipa_logits        w_s q.k + w_b bias[b,i,j,h] - 0.5 w_p gamma_h |qp_i - kp_j|^2, one thread per logit
// `bug` selects a deliberately broken variant (0 = correct); values shared with ops.cpp:
//   4     SKIP_TAIL   the grid covers M / tile row tiles: the last partial tile is never written
//   128   BIAS_LAYOUT the pair bias [B,N,N,H] is read as if it were [B,H,N,N]
// and CUDA-only:
//   1024  RACE        triangle_outgoing: no __syncthreads() between staging a tile and reading it
//   2048  HALF_ACC    ipa_logits accumulates q.k and the point distances in half precision
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <c10/cuda/CUDAStream.h>

enum { SKIP_TAIL = 4, BIAS_LAYOUT = 128, RACE = 1024, HALF_ACC = 2048 };

static void check(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  if (dim >= 0) TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.dim());
}

static inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }
static inline const float* opt(const c10::optional<torch::Tensor>& b) {
  return b.has_value() && b->defined() ? b->data_ptr<float>() : nullptr;
}

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

// ---------------------------------------------------------------- linear / gated_linear
__global__ void linear_kernel(const float* x, const float* W, const float* b, const float* Wg, const float* bg,
                              float* y, int M, int K, int N, int tile) {
  for (int r = 0; r < tile; ++r) {
    const int m = blockIdx.x * tile + r;
    if (m >= M) return;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
      float acc = b ? b[n] : 0.f;
      for (int k = 0; k < K; ++k) acc += x[(size_t)m * K + k] * W[(size_t)n * K + k];
      if (Wg) {
        float g = bg ? bg[n] : 0.f;
        for (int k = 0; k < K; ++k) g += x[(size_t)m * K + k] * Wg[(size_t)n * K + k];
        acc *= 1.f / (1.f + expf(-g));
      }
      y[(size_t)m * N + n] = acc;
    }
  }
}

static torch::Tensor launch_linear(torch::Tensor x, torch::Tensor w, const float* b, const float* wg, const float* bg,
                                   int64_t bug, int64_t tile) {
  check(x, "x", 2);
  check(w, "weight", 2);
  TORCH_CHECK(x.size(1) == w.size(1), "linear: x has ", x.size(1), " features, weight expects ", w.size(1));
  const int M = x.size(0), K = x.size(1), N = w.size(0);
  const int t = tile > 0 ? (int)tile : 16;
  auto y = torch::zeros({M, N}, x.options());
  const int blocks = (bug & SKIP_TAIL) ? M / t : (M + t - 1) / t;
  if (blocks > 0)
    linear_kernel<<<blocks, 128, 0, stream()>>>(x.data_ptr<float>(), w.data_ptr<float>(), b, wg, bg,
                                                y.data_ptr<float>(), M, K, N, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b, int64_t bug, int64_t tile) {
  return launch_linear(x, w, opt(b), nullptr, nullptr, bug, tile);
}

torch::Tensor gated_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor bp, torch::Tensor wg, torch::Tensor bg,
                           int64_t bug, int64_t tile) {
  check(wg, "gate weight", 2);
  return launch_linear(x, wp, bp.data_ptr<float>(), wg.data_ptr<float>(), bg.data_ptr<float>(), bug, tile);
}

// ---------------------------------------------------------------- layernorm
__global__ void layernorm_kernel(const float* x, const float* g, const float* bt, float* y, int K, float eps) {
  __shared__ float red[128];
  const float* xr = x + (size_t)blockIdx.x * K;
  float s = 0.f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) s += xr[k];
  const float mean = block_sum(s, red) / K;
  float v = 0.f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) { float d = xr[k] - mean; v += d * d; }
  const float inv = rsqrtf(block_sum(v, red) / K + eps);
  for (int k = threadIdx.x; k < K; k += blockDim.x) y[(size_t)blockIdx.x * K + k] = (xr[k] - mean) * inv * g[k] + bt[k];
}

torch::Tensor layernorm(torch::Tensor x, torch::Tensor g, torch::Tensor b, double eps, int64_t bug) {
  check(x, "x", 2);
  auto y = torch::empty_like(x);
  if (x.size(0) > 0)
    layernorm_kernel<<<x.size(0), 128, 0, stream()>>>(x.data_ptr<float>(), g.data_ptr<float>(), b.data_ptr<float>(),
                                                      y.data_ptr<float>(), x.size(1), (float)eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

// ---------------------------------------------------------------- triangle contraction
#define TK 16
__global__ void triangle_kernel(const float* a, const float* bb, float* out, int N, int C, int bug) {
  extern __shared__ float tile_a[];  // TK x C: a[b, i, k0:k0+TK, :]
  const int bi = blockIdx.x;          // b * N + i
  const int b = bi / N;
  const int c = threadIdx.x;
  const int j = blockIdx.y * blockDim.y + threadIdx.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  float acc = 0.f;
  for (int k0 = 0; k0 < N; k0 += TK) {
    const int kt = min(TK, N - k0);
    for (int e = tid; e < kt * C; e += nthreads) tile_a[e] = a[((size_t)bi * N + k0) * C + e];
    if (!(bug & RACE)) __syncthreads();
    if (j < N)
      for (int kk = 0; kk < kt; ++kk) acc += tile_a[kk * C + c] * bb[(((size_t)b * N + j) * N + k0 + kk) * C + c];
    __syncthreads();
  }
  if (j < N) out[((size_t)bi * N + j) * C + c] = acc;
}

torch::Tensor triangle_outgoing(torch::Tensor a, torch::Tensor bb, int64_t bug) {
  check(a, "a", 4);
  check(bb, "b", 4);
  TORCH_CHECK(a.sizes() == bb.sizes(), "triangle_outgoing: a and b differ in shape");
  const int B = a.size(0), N = a.size(1), C = a.size(3);
  TORCH_CHECK(C <= 1024, "triangle_outgoing: at most 1024 channels");
  auto out = torch::empty_like(a);
  const int tj = std::max(1, 256 / C);
  dim3 block(C, tj), grid(B * N, (N + tj - 1) / tj);
  triangle_kernel<<<grid, block, TK * C * sizeof(float), stream()>>>(a.data_ptr<float>(), bb.data_ptr<float>(),
                                                                     out.data_ptr<float>(), N, C, (int)bug);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// ---------------------------------------------------------------- frames
__global__ void frame_kernel(const float* R, const float* t, const float* p, float* y, int BN, int P, bool inverse) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= BN * P) return;
  const int bn = idx / P;
  const float* r = R + (size_t)bn * 9;
  const float* tr = t + (size_t)bn * 3;
  const float* x = p + (size_t)idx * 3;
  float* o = y + (size_t)idx * 3;
  for (int i = 0; i < 3; ++i) {
    float acc = 0.f;
    for (int c = 0; c < 3; ++c) acc += inverse ? r[c * 3 + i] * (x[c] - tr[c]) : r[i * 3 + c] * x[c];
    o[i] = inverse ? acc : acc + tr[i];
  }
}

torch::Tensor frame_apply(torch::Tensor R, torch::Tensor t, torch::Tensor p, bool inverse, int64_t bug) {
  check(R, "rotations", 4);
  check(t, "translations", 3);
  check(p, "points", 4);
  TORCH_CHECK(R.size(0) == p.size(0) && R.size(1) == p.size(1), "frame_apply: frames are [", R.size(0), ", ",
              R.size(1), "] but points are [", p.size(0), ", ", p.size(1), "]");
  TORCH_CHECK(p.size(3) == 3, "frame_apply: points must end in 3 coordinates, got ", p.size(3));
  const int BN = p.size(0) * p.size(1), P = p.size(2);
  auto y = torch::empty_like(p);
  const int threads = 128, blocks = (BN * P + threads - 1) / threads;
  if (blocks > 0)
    frame_kernel<<<blocks, threads, 0, stream()>>>(R.data_ptr<float>(), t.data_ptr<float>(), p.data_ptr<float>(),
                                                   y.data_ptr<float>(), BN, P, inverse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

// ---------------------------------------------------------------- IPA logits
__global__ void ipa_logits_kernel(const float* Q, const float* K, const float* QP, const float* KP, const float* BI,
                                  const float* G, float* O, int B, int N, int H, int C, int P, float w_s, float w_b,
                                  float w_p, int bug) {
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)B * H * N * N) return;
  const int j = idx % N, i = (idx / N) % N, h = (idx / ((size_t)N * N)) % H, b = idx / ((size_t)N * N * H);
  const float* q = Q + (((size_t)b * N + i) * H + h) * C;
  const float* k = K + (((size_t)b * N + j) * H + h) * C;
  const float* qp = QP + (((size_t)b * N + i) * H + h) * P * 3;
  const float* kp = KP + (((size_t)b * N + j) * H + h) * P * 3;
  float dot, dist;
  if (bug & HALF_ACC) {
    __half hd = __float2half(0.f), hs = __float2half(0.f);
    for (int c = 0; c < C; ++c) hd = __hadd(hd, __float2half(q[c] * k[c]));
    for (int e = 0; e < P * 3; ++e) { float d = qp[e] - kp[e]; hs = __hadd(hs, __float2half(d * d)); }
    dot = __half2float(hd);
    dist = __half2float(hs);
  } else {
    dot = 0.f;
    dist = 0.f;
    for (int c = 0; c < C; ++c) dot += q[c] * k[c];
    for (int e = 0; e < P * 3; ++e) { float d = qp[e] - kp[e]; dist += d * d; }
  }
  const size_t bidx = (bug & BIAS_LAYOUT) ? (((size_t)b * H + h) * N + i) * N + j : (((size_t)b * N + i) * N + j) * H + h;
  O[idx] = w_s * dot + w_b * BI[bidx] - 0.5f * w_p * G[h] * dist;
}

torch::Tensor ipa_logits(torch::Tensor q, torch::Tensor k, torch::Tensor qp, torch::Tensor kp, torch::Tensor bias,
                         torch::Tensor gamma, double w_s, double w_b, double w_p, int64_t bug) {
  check(q, "q", 4);
  check(k, "k", 4);
  check(qp, "q_pts", 5);
  check(kp, "k_pts", 5);
  check(bias, "pair_bias", 4);
  check(gamma, "gamma", 1);
  const int B = q.size(0), N = q.size(1), H = q.size(2), C = q.size(3), P = qp.size(3);
  auto out = torch::empty({B, H, N, N}, q.options());
  const size_t total = (size_t)B * H * N * N;
  const int threads = 256;
  if (total > 0)
    ipa_logits_kernel<<<(total + threads - 1) / threads, threads, 0, stream()>>>(
        q.data_ptr<float>(), k.data_ptr<float>(), qp.data_ptr<float>(), kp.data_ptr<float>(), bias.data_ptr<float>(),
        gamma.data_ptr<float>(), out.data_ptr<float>(), B, N, H, C, P, (float)w_s, (float)w_b, (float)w_p, (int)bug);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
