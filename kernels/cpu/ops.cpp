// CPU C++ builds of the fused kernels the candidates in kernels/ use (float32, contiguous).
//
// Each kernel computes a real fused step.  The integer `bug` argument selects a deliberately
// broken variant (0 = correct); the broken variants are diffkit's own proving ground and each
// mirrors a bug seen in hand-written CUDA:
//   BUG_UNBIASED_VAR     LayerNorm divides the variance by K-1
//   BUG_TRANSPOSED_W     a Linear reads its [N,K] weight as if it were [K,N]
//   BUG_SKIP_TAIL        rows are processed in tiles of `tile`; the last partial tile is never written
//   BUG_NO_SCALE         attention logits are not multiplied by the scale
//   BUG_WRONG_AXIS       softmax normalises over the query axis instead of the key axis
//   BUG_TANH_GELU        GELU uses the tanh approximation instead of erf
//   BUG_SWAP_IJ          the triangle contraction writes out[j][i] instead of out[i][j]
//   BUG_BIAS_LAYOUT      the pair bias [B,N,N,H] is read as if it were [B,H,N,N]
//   BUG_NO_MAX_SUB       softmax exponentiates (in float) without subtracting the row maximum
//   BUG_TAIL_ROWS        the last partial tile of `tile` rows reads its inputs from the wrong rows
#include <torch/extension.h>
#include <cmath>
#include <vector>

enum Bug {
  BUG_UNBIASED_VAR = 1,
  BUG_TRANSPOSED_W = 2,
  BUG_SKIP_TAIL = 4,
  BUG_NO_SCALE = 8,
  BUG_WRONG_AXIS = 16,
  BUG_TANH_GELU = 32,
  BUG_SWAP_IJ = 64,
  BUG_BIAS_LAYOUT = 128,
  BUG_NO_MAX_SUB = 256,
  BUG_TAIL_ROWS = 512,
};

static void check(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  if (dim >= 0) TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.dim());
}

// y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]); rows in tiles of `tile`.
static void linear_rows(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K,
                        int64_t N, int64_t bug, int64_t tile) {
  int64_t rows = M;
  if ((bug & BUG_SKIP_TAIL) && tile > 0) rows = (M / tile) * tile;
  for (int64_t m0 = 0; m0 < rows; m0 += (tile > 0 ? tile : rows)) {
    int64_t m1 = std::min(rows, m0 + (tile > 0 ? tile : rows));
    const bool partial = tile > 0 && m1 - m0 < tile;
    for (int64_t m = m0; m < m1; ++m) {
      // BUG_TAIL_ROWS: the partial tile indexes its rows from the tile start instead of the row
      const int64_t src = ((bug & BUG_TAIL_ROWS) && partial) ? m - m0 : m;
      for (int64_t n = 0; n < N; ++n) {
        double acc = b ? b[n] : 0.0;
        for (int64_t k = 0; k < K; ++k) {
          float wv = (bug & BUG_TRANSPOSED_W) ? w[k * N + n] : w[n * K + k];
          acc += (double)x[src * K + k] * wv;
        }
        y[m * N + n] = (float)acc;
      }
    }
  }
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b, int64_t bug,
                     int64_t tile) {
  check(x, "x", 2);
  check(w, "weight", 2);
  TORCH_CHECK(x.size(1) == w.size(1), "linear: x has ", x.size(1), " features, weight expects ", w.size(1));
  const float* bp = nullptr;
  if (b.has_value() && b->defined()) {
    check(*b, "bias", 1);
    bp = b->data_ptr<float>();
  }
  auto y = torch::zeros({x.size(0), w.size(0)}, x.options());
  linear_rows(x.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), x.size(0), x.size(1),
              w.size(0), bug, tile);
  return y;
}

static void layernorm_row(const float* x, const float* g, const float* bt, float* y, int64_t K, double eps,
                          int64_t bug) {
  double mean = 0.0;
  for (int64_t k = 0; k < K; ++k) mean += x[k];
  mean /= K;
  double var = 0.0;
  for (int64_t k = 0; k < K; ++k) var += (x[k] - mean) * (x[k] - mean);
  var /= (bug & BUG_UNBIASED_VAR) ? (K - 1) : K;
  double inv = 1.0 / std::sqrt(var + eps);
  for (int64_t k = 0; k < K; ++k) y[k] = (float)((x[k] - mean) * inv * g[k] + bt[k]);
}

torch::Tensor layernorm(torch::Tensor x, torch::Tensor g, torch::Tensor b, double eps, int64_t bug) {
  check(x, "x", 2);
  auto y = torch::empty_like(x);
  const int64_t M = x.size(0), K = x.size(1);
  for (int64_t m = 0; m < M; ++m)
    layernorm_row(x.data_ptr<float>() + m * K, g.data_ptr<float>(), b.data_ptr<float>(),
                  y.data_ptr<float>() + m * K, K, eps, bug);
  return y;
}

// Fused LayerNorm + Linear: y = LN(x) W^T + b, one row at a time.
torch::Tensor layernorm_linear(torch::Tensor x, torch::Tensor g, torch::Tensor beta, double eps, torch::Tensor w,
                               c10::optional<torch::Tensor> b, int64_t bug) {
  check(x, "x", 2);
  check(w, "weight", 2);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "layernorm_linear: weight expects ", w.size(1), " features, x has ", K);
  const float* bp = (b.has_value() && b->defined()) ? b->data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  std::vector<float> row(K);
  for (int64_t m = 0; m < M; ++m) {
    layernorm_row(x.data_ptr<float>() + m * K, g.data_ptr<float>(), beta.data_ptr<float>(), row.data(), K, eps, bug);
    linear_rows(row.data(), w.data_ptr<float>(), bp, y.data_ptr<float>() + m * N, 1, K, N, bug & ~BUG_SKIP_TAIL, 0);
  }
  return y;
}

static double gelu(double v, bool tanh_approx) {
  if (tanh_approx) return 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
  return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
}

// y = GELU(x W^T + b)
torch::Tensor linear_gelu(torch::Tensor x, torch::Tensor w, torch::Tensor b, int64_t bug) {
  auto y = linear(x, w, b, bug & ~BUG_TANH_GELU, 0);
  float* p = y.data_ptr<float>();
  for (int64_t i = 0; i < y.numel(); ++i) p[i] = (float)gelu(p[i], bug & BUG_TANH_GELU);
  return y;
}

// softmax over the last axis of a [R, C] view (or the first axis with BUG_WRONG_AXIS on [.., Q, C]).
static void softmax_rows(float* s, int64_t R, int64_t C, int64_t bug) {
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * C;
    double mx = -INFINITY;
    for (int64_t c = 0; c < C; ++c) mx = std::max(mx, (double)row[c]);
    if (bug & BUG_NO_MAX_SUB) {  // float exp of the raw logits: overflows to inf beyond ~88
      float fsum = 0.0f;
      for (int64_t c = 0; c < C; ++c) fsum += std::exp(row[c]);
      for (int64_t c = 0; c < C; ++c) row[c] = std::exp(row[c]) / fsum;
      continue;
    }
    double sum = 0.0;
    for (int64_t c = 0; c < C; ++c) sum += std::exp((double)row[c] - mx);
    for (int64_t c = 0; c < C; ++c) row[c] = (float)(std::exp((double)row[c] - mx) / sum);
  }
}

// softmax over the last axis of x [..., Q, C]; with BUG_WRONG_AXIS over Q instead.
torch::Tensor softmax_lastdim(torch::Tensor x, int64_t bug) {
  check(x, "x", -1);
  TORCH_CHECK(x.dim() >= 2, "softmax_lastdim: need at least 2 dims");
  if (bug & BUG_WRONG_AXIS) {
    auto t = x.transpose(-1, -2).contiguous();
    softmax_rows(t.data_ptr<float>(), t.numel() / t.size(-1), t.size(-1), bug);
    return t.transpose(-1, -2).contiguous();
  }
  auto y = x.clone();
  softmax_rows(y.data_ptr<float>(), y.numel() / y.size(-1), y.size(-1), bug);
  return y;
}

// scores[n, h, i, j] = scale * sum_d q[n,h,i,d] k[n,h,j,d]
torch::Tensor attention_scores(torch::Tensor q, torch::Tensor k, double scale, int64_t bug) {
  check(q, "q", 4);
  check(k, "k", 4);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), D = q.size(3);
  auto s = torch::empty({B, H, L, S}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  const double sc = (bug & BUG_NO_SCALE) ? 1.0 : scale;
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j) {
        double acc = 0.0;
        for (int64_t d = 0; d < D; ++d) acc += (double)qp[(bh * L + i) * D + d] * kp[(bh * S + j) * D + d];
        sp[(bh * L + i) * S + j] = (float)(acc * sc);
      }
  return s;
}

// Fused attention: softmax(scale * q k^T) v over [B, H, L, D].
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t bug) {
  check(v, "v", 4);
  auto p = softmax_lastdim(attention_scores(q, k, scale, bug), bug);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), D = v.size(3);
  auto o = torch::empty({B, H, L, D}, q.options());
  const float *pp = p.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = o.data_ptr<float>();
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0.0;
        for (int64_t j = 0; j < S; ++j) acc += (double)pp[(bh * L + i) * S + j] * vp[(bh * S + j) * D + d];
        op[(bh * L + i) * D + d] = (float)acc;
      }
  return o;
}

// Gated projection: sigmoid(x Wg^T + bg) * (x Wp^T + bp), rows in tiles of `tile`.
torch::Tensor gated_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor bp, torch::Tensor wg, torch::Tensor bg,
                           int64_t bug, int64_t tile) {
  auto p = linear(x, wp, bp, bug, tile);
  auto g = linear(x, wg, bg, bug, tile);
  float *pp = p.data_ptr<float>(), *gp = g.data_ptr<float>();
  const int64_t M = x.size(0), N = wp.size(0);
  int64_t rows = ((bug & BUG_SKIP_TAIL) && tile > 0) ? (M / tile) * tile : M;
  for (int64_t i = 0; i < rows * N; ++i) pp[i] = (float)(pp[i] / (1.0 + std::exp(-(double)gp[i])));
  return p;
}

// Triangle update, outgoing edges: out[b,i,j,c] = sum_k a[b,i,k,c] * bb[b,j,k,c].
torch::Tensor triangle_outgoing(torch::Tensor a, torch::Tensor bb, int64_t bug) {
  check(a, "a", 4);
  check(bb, "b", 4);
  const int64_t B = a.size(0), N = a.size(1), C = a.size(3);
  auto out = torch::empty_like(a);
  const float *ap = a.data_ptr<float>(), *bp = bb.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < N; ++j)
        for (int64_t c = 0; c < C; ++c) {
          double acc = 0.0;
          for (int64_t k = 0; k < N; ++k)
            acc += (double)ap[((b * N + i) * N + k) * C + c] * bp[((b * N + j) * N + k) * C + c];
          int64_t oi = (bug & BUG_SWAP_IJ) ? j : i, oj = (bug & BUG_SWAP_IJ) ? i : j;
          op[((b * N + oi) * N + oj) * C + c] = (float)acc;
        }
  return out;
}

// Rigid frames: global = R p + t (or, inverse, local = R^T (p - t)); R [B,N,3,3], t [B,N,3], p [B,N,P,3].
torch::Tensor frame_apply(torch::Tensor R, torch::Tensor t, torch::Tensor p, bool inverse, int64_t bug) {
  check(R, "rotations", 4);
  check(t, "translations", 3);
  check(p, "points", 4);
  TORCH_CHECK(R.size(0) == p.size(0) && R.size(1) == p.size(1), "frame_apply: frames are [", R.size(0), ", ",
              R.size(1), "] but points are [", p.size(0), ", ", p.size(1), "]");
  TORCH_CHECK(p.size(3) == 3, "frame_apply: points must end in 3 coordinates, got ", p.size(3));
  const int64_t B = p.size(0), N = p.size(1), P = p.size(2);
  auto out = torch::empty_like(p);
  const float *rp = R.data_ptr<float>(), *tp = t.data_ptr<float>(), *pp = p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t bn = 0; bn < B * N; ++bn) {
    const float* r = rp + bn * 9;
    const float* tr = tp + bn * 3;
    for (int64_t q = 0; q < P; ++q) {
      const float* x = pp + (bn * P + q) * 3;
      float* y = op + (bn * P + q) * 3;
      for (int64_t a = 0; a < 3; ++a) {
        double acc = 0.0;
        for (int64_t c = 0; c < 3; ++c) {
          bool use_transpose = inverse != ((bug & BUG_TRANSPOSED_W) != 0);
          double rv = use_transpose ? r[c * 3 + a] : r[a * 3 + c];
          double xv = inverse ? (double)x[c] - tr[c] : (double)x[c];
          acc += rv * xv;
        }
        y[a] = (float)(inverse ? acc : acc + tr[a]);
      }
    }
  }
  return out;
}

// IPA logits[b,h,i,j] = w_s * q.k + w_b * bias[b,i,j,h] - 0.5 * w_p * gamma_h * sum_p |qp_i - kp_j|^2
torch::Tensor ipa_logits(torch::Tensor q, torch::Tensor k, torch::Tensor qp, torch::Tensor kp, torch::Tensor bias,
                         torch::Tensor gamma, double w_s, double w_b, double w_p, int64_t bug) {
  check(q, "q", 4);        // [B, N, H, C]
  check(k, "k", 4);
  check(qp, "q_pts", 5);   // [B, N, H, P, 3]
  check(kp, "k_pts", 5);
  check(bias, "pair_bias", 4);  // [B, N, N, H]
  const int64_t B = q.size(0), N = q.size(1), H = q.size(2), C = q.size(3), P = qp.size(3);
  auto out = torch::empty({B, H, N, N}, q.options());
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *QP = qp.data_ptr<float>(),
              *KP = kp.data_ptr<float>(), *BI = bias.data_ptr<float>(), *G = gamma.data_ptr<float>();
  float* O = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double dot = 0.0;
          for (int64_t c = 0; c < C; ++c) dot += (double)Q[((b * N + i) * H + h) * C + c] * K[((b * N + j) * H + h) * C + c];
          double dist = 0.0;
          for (int64_t p = 0; p < P; ++p)
            for (int64_t x = 0; x < 3; ++x) {
              double d = (double)QP[(((b * N + i) * H + h) * P + p) * 3 + x] - KP[(((b * N + j) * H + h) * P + p) * 3 + x];
              dist += d * d;
            }
          int64_t bidx = (bug & BUG_BIAS_LAYOUT) ? ((b * H + h) * N + i) * N + j : ((b * N + i) * N + j) * H + h;
          O[((b * H + h) * N + i) * N + j] = (float)(w_s * dot + w_b * BI[bidx] - 0.5 * w_p * G[h] * dist);
        }
  return out;
}

// Writes into `out` and returns nothing (the out-parameter style many kernels use): out = s * x.
void scale_into(torch::Tensor out, torch::Tensor x, double s) {
  check(out, "out", -1);
  check(x, "x", -1);
  TORCH_CHECK(out.numel() == x.numel(), "scale_into: out has ", out.numel(), " elements, x has ", x.numel());
  float* o = out.data_ptr<float>();
  const float* p = x.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = (float)(s * p[i]);
}
