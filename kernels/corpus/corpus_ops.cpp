// CPU kernels behind the candidates in kernels/corpus/ (float32).
//
// Written the way a kernel author who is not us would write them: one function per fused step,
// TensorAccessor indexing, a signature per use.  Some are correct; the others carry one realistic
// bug each, and only the corpus candidate that is meant to show that bug calls them.  Which
// function is broken, and how, is documented in the candidate file that calls it (its docstring
// and DIFFKIT_EXPECT), not here: the comments below say what a function computes as its author
// believed.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

using Acc1 = at::TensorAccessor<float, 1>;

void expect_float(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, what, ": expected a float32 CPU tensor");
}

torch::Tensor rows_of(const torch::Tensor& x) {  // [..., D] -> contiguous [M, D]
  expect_float(x, "input");
  return x.contiguous().view({-1, x.size(-1)});
}

std::vector<int64_t> with_last(const torch::Tensor& x, int64_t last) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = last;
  return s;
}

inline float erf_gelu(float v) { return 0.5f * v * (1.0f + std::erf(v * 0.7071067811865476f)); }
inline float logistic(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// LayerNorm of one row (two-pass, biased variance) into dst.
template <typename Src>
void normalize_row(const Src& src, const Acc1& g, const Acc1& beta, float eps, float* dst, int64_t D) {
  float mean = 0.f;
  for (int64_t k = 0; k < D; ++k) mean += src[k];
  mean /= D;
  float var = 0.f;
  for (int64_t k = 0; k < D; ++k) {
    const float c = src[k] - mean;
    var += c * c;
  }
  const float rstd = 1.0f / std::sqrt(var / D + eps);
  for (int64_t k = 0; k < D; ++k) dst[k] = (src[k] - mean) * rstd * g[k] + beta[k];
}

// dst[n] = <src, W[n]> (+ bias[n])
void dot_rows(const float* src, const at::TensorAccessor<float, 2>& W, const float* bias, float* dst) {
  const int64_t N = W.size(0), K = W.size(1);
  for (int64_t n = 0; n < N; ++n) {
    float s = bias ? bias[n] : 0.f;
    for (int64_t k = 0; k < K; ++k) s += src[k] * W[n][k];
    dst[n] = s;
  }
}

}  // namespace

// ---------------------------------------------------------------- normalisation

torch::Tensor layer_norm(torch::Tensor x, torch::Tensor g, torch::Tensor beta, double eps) {
  auto xr = rows_of(x);
  auto out = torch::empty_like(xr);
  auto X = xr.accessor<float, 2>();
  auto Y = out.accessor<float, 2>();
  auto G = g.accessor<float, 1>(), B = beta.accessor<float, 1>();
  for (int64_t m = 0; m < xr.size(0); ++m) normalize_row(X[m], G, B, (float)eps, Y[m].data(), xr.size(1));
  return out.view(x.sizes());
}

// LayerNorm over the last axis of a tensor of any strides (row and column passes of a 2-D grid
// hand it views); contiguous inputs take the flat path.
torch::Tensor layer_norm_nd(torch::Tensor x, torch::Tensor g, torch::Tensor beta, double eps) {
  expect_float(x, "x");
  auto G = g.accessor<float, 1>(), B = beta.accessor<float, 1>();
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t D = x.size(-1);
  const int64_t M = x.numel() / D;
  float* y = out.data_ptr<float>();
  if (x.is_contiguous()) {
    auto xv = x.view({M, D});
    auto X = xv.accessor<float, 2>();
    for (int64_t m = 0; m < M; ++m) normalize_row(X[m], G, B, (float)eps, y + m * D, D);
    return out;
  }
  const float* base = x.data_ptr<float>();
  const int64_t nd = x.dim();
  const int64_t sd = x.stride(nd - 1);
  for (int64_t m = 0; m < M; ++m) {
    int64_t off = 0, rest = m;
    for (int64_t d = nd - 2; d >= 0; --d) {
      off += (rest % x.size(d)) * x.stride(d);
      rest /= x.size(d);
    }
    const float* row = base + off;
    float mean = 0.f;
    for (int64_t k = 0; k < D; ++k) mean += row[k * sd];
    mean /= D;
    float var = 0.f;
    for (int64_t k = 0; k < D; ++k) {
      const float c = row[k * sd] - mean;
      var += c * c;
    }
    const float rstd = 1.0f / std::sqrt(var / D + (float)eps);
    for (int64_t k = 0; k < D; ++k) y[m * D + k] = (mean - row[k * sd]) * rstd * G[k] + B[k];
  }
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  auto xr = rows_of(x);
  auto out = torch::empty_like(xr);
  auto X = xr.accessor<float, 2>();
  auto Y = out.accessor<float, 2>();
  auto W = w.accessor<float, 1>();
  const int64_t D = xr.size(1);
  for (int64_t m = 0; m < xr.size(0); ++m) {
    float ss = 0.f;
    for (int64_t k = 0; k < D; ++k) ss += X[m][k] * X[m][k];
    const float inv = 1.0f / std::sqrt(ss + (float)eps);
    for (int64_t k = 0; k < D; ++k) Y[m][k] = X[m][k] * inv * W[k];
  }
  return out.view(x.sizes());
}

// ---------------------------------------------------------------- projections

// LayerNorm then Linear, one row at a time (the normalised row never leaves the stack).
torch::Tensor norm_project(torch::Tensor x, torch::Tensor g, torch::Tensor beta, double eps, torch::Tensor W,
                           torch::Tensor b) {
  auto xr = rows_of(x);
  const int64_t D = xr.size(1), N = W.size(0);
  auto out = torch::empty({xr.size(0), N}, xr.options());
  auto X = xr.accessor<float, 2>();
  auto Wa = W.accessor<float, 2>();
  auto G = g.accessor<float, 1>(), Bt = beta.accessor<float, 1>();
  std::vector<float> tmp(D);
  for (int64_t m = 0; m < xr.size(0); ++m) {
    normalize_row(X[m], G, Bt, (float)eps, tmp.data(), D);
    dot_rows(tmp.data(), Wa, b.data_ptr<float>(), out.data_ptr<float>() + m * N);
  }
  return out.view(with_last(x, N));
}

// LayerNorm -> Linear -> GELU(erf) in one pass: the first half of a transformer MLP.
torch::Tensor ln_linear_gelu(torch::Tensor x, torch::Tensor g, torch::Tensor beta, double eps, torch::Tensor W,
                             torch::Tensor b) {
  auto h = norm_project(x, g, beta, eps, W, b);
  float* p = h.data_ptr<float>();
  for (int64_t i = 0; i < h.numel(); ++i) p[i] = erf_gelu(p[i]);
  return h;
}

// The same step for an MLP whose first layer is given as (gamma, beta, W).
torch::Tensor ln_mlp_in(torch::Tensor x, torch::Tensor g, torch::Tensor beta, double eps, torch::Tensor W) {
  auto xr = rows_of(x);
  const int64_t D = xr.size(1), N = W.size(0);
  auto out = torch::empty({xr.size(0), N}, xr.options());
  auto X = xr.accessor<float, 2>();
  auto Y = out.accessor<float, 2>();
  auto Wa = W.accessor<float, 2>();
  auto G = g.accessor<float, 1>(), Bt = beta.accessor<float, 1>();
  std::vector<float> tmp(D);
  for (int64_t m = 0; m < xr.size(0); ++m) {
    normalize_row(X[m], G, Bt, (float)eps, tmp.data(), D);
    for (int64_t n = 0; n < N; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < D; ++k) s += tmp[k] * Wa[n][k];
      Y[m][n] = erf_gelu(s);
    }
  }
  return out.view(with_last(x, N));
}

// y = x W + b for a dense layer.
torch::Tensor dense(torch::Tensor x, torch::Tensor W, torch::Tensor b) {
  auto xr = rows_of(x);
  const int64_t K = xr.size(1), N = W.size(0);
  TORCH_CHECK(W.numel() == K * N, "dense: weight has ", W.numel(), " elements, expected ", K * N);
  auto Wf = W.contiguous();
  const float* w = Wf.data_ptr<float>();
  auto out = torch::empty({xr.size(0), N}, xr.options());
  auto X = xr.accessor<float, 2>();
  auto Y = out.accessor<float, 2>();
  auto Bv = b.accessor<float, 1>();
  for (int64_t m = 0; m < xr.size(0); ++m)
    for (int64_t n = 0; n < N; ++n) {
      float s = Bv[n];
      for (int64_t k = 0; k < K; ++k) s += X[m][k] * w[k * N + n];
      Y[m][n] = s;
    }
  return out.view(with_last(x, N));
}

// Linear over rows in tiles of 16 rows; a ragged last tile is handled by re-reading a full tile
// that ends at the last row, so every load stays in bounds.
torch::Tensor linear_tiled(torch::Tensor x, torch::Tensor W, torch::Tensor b) {
  constexpr int64_t TILE = 16;
  auto xr = rows_of(x);
  const int64_t M = xr.size(0), N = W.size(0);
  auto out = torch::empty({M, N}, xr.options());
  auto X = xr.accessor<float, 2>();
  auto Wa = W.accessor<float, 2>();
  const float* bias = b.data_ptr<float>();
  float* y = out.data_ptr<float>();
  for (int64_t t0 = 0; t0 < M; t0 += TILE) {
    const int64_t rows = std::min(TILE, M - t0);
    const int64_t src0 = (rows == TILE || M < TILE) ? t0 : M - TILE;
    for (int64_t i = 0; i < rows; ++i) dot_rows(X[src0 + i].data(), Wa, bias, y + (t0 + i) * N);
  }
  return out.view(with_last(x, N));
}

// y = x W^T + b, bias folded into the accumulator's start and into the store.
torch::Tensor affine(torch::Tensor x, torch::Tensor W, torch::Tensor b) {
  auto xr = rows_of(x);
  const int64_t K = xr.size(1), N = W.size(0);
  auto out = torch::empty({xr.size(0), N}, xr.options());
  auto X = xr.accessor<float, 2>();
  auto Y = out.accessor<float, 2>();
  auto Wa = W.accessor<float, 2>();
  auto Bv = b.accessor<float, 1>();
  for (int64_t m = 0; m < xr.size(0); ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = Bv[n];
      for (int64_t k = 0; k < K; ++k) acc += X[m][k] * Wa[n][k];
      Y[m][n] = acc + Bv[n];
    }
  return out.view(with_last(x, N));
}

// ---------------------------------------------------------------- gated units

// RMSNorm -> [gate | up] projection with one concatenated weight [2H, D] -> silu(gate) * up.
torch::Tensor rms_swiglu(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor Wgu, torch::Tensor bgu) {
  auto xr = rows_of(x);
  const int64_t D = xr.size(1), H = Wgu.size(0) / 2;
  auto out = torch::empty({xr.size(0), H}, xr.options());
  auto X = xr.accessor<float, 2>();
  auto Y = out.accessor<float, 2>();
  auto Wv = w.accessor<float, 1>();
  auto Wa = Wgu.accessor<float, 2>();
  auto Bv = bgu.accessor<float, 1>();
  std::vector<float> h(D);
  for (int64_t m = 0; m < xr.size(0); ++m) {
    float ss = 0.f;
    for (int64_t k = 0; k < D; ++k) ss += X[m][k] * X[m][k];
    const float inv = 1.0f / std::sqrt(ss / D + (float)eps);
    for (int64_t k = 0; k < D; ++k) h[k] = X[m][k] * inv * Wv[k];
    for (int64_t j = 0; j < H; ++j) {
      float gs = Bv[j], us = Bv[H + j];
      for (int64_t k = 0; k < D; ++k) {
        gs += h[k] * Wa[j][k];
        us += h[k] * Wa[H + j][k];
      }
      Y[m][j] = gs * logistic(gs) * us;
    }
  }
  return out.view(with_last(x, H));
}

// silu(x) = x * sigmoid(x), sigmoid through a rational tanh (no exp on the hot path).
torch::Tensor silu(torch::Tensor x) {
  auto xc = x.contiguous();
  expect_float(xc, "x");
  auto out = torch::empty_like(xc);
  const float* p = xc.data_ptr<float>();
  float* q = out.data_ptr<float>();
  for (int64_t i = 0; i < xc.numel(); ++i) {
    const float t = 0.5f * p[i];
    float th = t * (27.f + t * t) / (27.f + 9.f * t * t);
    th = std::max(-1.f, std::min(1.f, th));
    q[i] = p[i] * (0.5f + 0.5f * th);
  }
  return out;
}

// Both gated projections of a triangle update from one packed weight
// W4 = [proj_a; gate_a; proj_b; gate_b] ([4H, C]) and bias b4 ([4H]): returns (a, b).
std::tuple<torch::Tensor, torch::Tensor> gated_pair(torch::Tensor z, torch::Tensor W4, torch::Tensor b4) {
  auto zr = rows_of(z);
  const int64_t H = W4.size(0) / 4;
  auto pa = torch::empty({zr.size(0), H}, zr.options());
  auto pb = torch::empty({zr.size(0), H}, zr.options());
  auto Z = zr.accessor<float, 2>();
  auto A = pa.accessor<float, 2>(), Bo = pb.accessor<float, 2>();
  auto Wa = W4.accessor<float, 2>();
  auto Bv = b4.accessor<float, 1>();
  std::vector<float> t(4 * H);
  for (int64_t m = 0; m < zr.size(0); ++m) {
    dot_rows(Z[m].data(), Wa, Bv.data(), t.data());
    for (int64_t j = 0; j < H; ++j) {
      A[m][j] = logistic(t[H + j]) * t[j];
      Bo[m][j] = logistic(t[3 * H + j]) * t[2 * H + j];
    }
  }
  return {pa.view(with_last(z, H)), pb.view(with_last(z, H))};
}

// ---------------------------------------------------------------- attention pieces

// Softmax of attention scores [..., Lq, Lk].
torch::Tensor attn_softmax(torch::Tensor s) {
  auto sc = s.contiguous();
  expect_float(sc, "scores");
  const int64_t R = sc.size(-2), C = sc.size(-1);
  auto s3 = sc.view({-1, R, C});
  auto out = torch::empty_like(sc);
  auto p3 = out.view({-1, R, C});
  auto S = s3.accessor<float, 3>();
  auto P = p3.accessor<float, 3>();
  for (int64_t b = 0; b < S.size(0); ++b)
    for (int64_t c = 0; c < C; ++c) {
      float mx = -INFINITY;
      for (int64_t r = 0; r < R; ++r) mx = std::max(mx, S[b][r][c]);
      float sum = 0.f;
      for (int64_t r = 0; r < R; ++r) {
        P[b][r][c] = std::exp(S[b][r][c] - mx);
        sum += P[b][r][c];
      }
      for (int64_t r = 0; r < R; ++r) P[b][r][c] /= sum;
    }
  return out;
}

// Scaled q.k^T per head straight from the packed projection qkv [n, L, 3*D] -> [n, heads, L, L].
torch::Tensor packed_scores(torch::Tensor qkv, int64_t heads) {
  auto t = qkv.contiguous();
  expect_float(t, "qkv");
  const int64_t n = t.size(0), L = t.size(1), D = t.size(2) / 3, d = D / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  auto Q = t.accessor<float, 3>();
  auto out = torch::empty({n, heads, L, L}, t.options());
  auto O = out.accessor<float, 4>();
  for (int64_t b = 0; b < n; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < L; ++j) {
          float s = 0.f;
          for (int64_t e = 0; e < d; ++e) s += Q[b][i][h * d + e] * Q[b][j][D + h * d + e];
          O[b][h][i][j] = s * scale;
        }
  return out;
}

// scale * q k^T for q, k [B, H, L, d].
torch::Tensor qk_logits(torch::Tensor q, torch::Tensor k, double scale) {
  auto qc = q.contiguous(), kc = k.contiguous();
  expect_float(qc, "q");
  expect_float(kc, "k");
  const int64_t B = qc.size(0), H = qc.size(1), L = qc.size(2), d = qc.size(3);
  auto Q = qc.accessor<float, 4>(), Kt = kc.accessor<float, 4>();
  auto out = torch::empty({B, H, L, L}, qc.options());
  auto O = out.accessor<float, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < L; ++j) {
          float s = 0.f;
          for (int64_t e = 0; e < d; ++e) s += Q[b][h][i][e] * Kt[b][h][j][e];
          O[b][h][j][i] = s * (float)scale;
        }
  return out;
}

// softmax(logits / T) along the last axis, for sharp (small-T) softmaxes.
torch::Tensor softmax_temp(torch::Tensor logits, double temperature) {
  auto xr = rows_of(logits);
  auto out = torch::empty_like(xr);
  auto X = xr.accessor<float, 2>();
  auto Y = out.accessor<float, 2>();
  const float inv_t = 1.0f / (float)temperature;
  const int64_t N = xr.size(1);
  for (int64_t m = 0; m < xr.size(0); ++m) {
    float mx = X[m][0];
    for (int64_t j = 1; j < N; ++j) mx = std::max(mx, X[m][j]);
    float sum = 0.f;
    for (int64_t j = 0; j < N; ++j) {
      Y[m][j] = std::exp(X[m][j] * inv_t - mx);
      sum += Y[m][j];
    }
    for (int64_t j = 0; j < N; ++j) Y[m][j] /= sum;
  }
  return out.view(logits.sizes());
}

// Triangle contraction, outgoing edges: x[b, i, j, c] = sum_k a[b, i, k, c] * b[b, j, k, c].
torch::Tensor outer_sum(torch::Tensor a, torch::Tensor b) {
  auto ac = a.contiguous(), bc = b.contiguous();
  expect_float(ac, "a");
  expect_float(bc, "b");
  const int64_t B = ac.size(0), N = ac.size(1), C = ac.size(3);
  auto A = ac.accessor<float, 4>(), Bt = bc.accessor<float, 4>();
  auto out = torch::empty({B, N, N, C}, ac.options());
  auto O = out.accessor<float, 4>();
  for (int64_t s = 0; s < B; ++s)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < N; ++j)
        for (int64_t c = 0; c < C; ++c) {
          c10::BFloat16 acc = 0.f;
          for (int64_t k = 0; k < N; ++k) acc = acc + A[s][i][k][c] * Bt[s][j][k][c];
          O[s][i][j][c] = static_cast<float>(acc);
        }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_norm", &layer_norm);
  m.def("layer_norm_nd", &layer_norm_nd);
  m.def("rms_norm", &rms_norm);
  m.def("norm_project", &norm_project);
  m.def("ln_linear_gelu", &ln_linear_gelu);
  m.def("ln_mlp_in", &ln_mlp_in);
  m.def("dense", &dense);
  m.def("linear_tiled", &linear_tiled);
  m.def("affine", &affine);
  m.def("rms_swiglu", &rms_swiglu);
  m.def("silu", &silu);
  m.def("gated_pair", &gated_pair);
  m.def("attn_softmax", &attn_softmax);
  m.def("packed_scores", &packed_scores);
  m.def("qk_logits", &qk_logits);
  m.def("softmax_temp", &softmax_temp);
  m.def("outer_sum", &outer_sum);
}
