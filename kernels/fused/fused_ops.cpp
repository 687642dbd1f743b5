// Fused CPU kernels for the what-if proving ground (issue 16): one function per reference model,
// computing the model's WHOLE forward from its inputs and parameters in a single extension call, so
// diffkit sees nothing between the input and the output.
//
// Each function takes an integer `bug` selecting one planted mistake (0 = correct).  The mistakes are
// the ones of the broken variants in kernels/*.py and kernels/corpus/*.py, planted in the same place;
// kernels/fused/README.md lists which candidate uses which.  The codes are mirrored in
// kernels/fused/_ops.py.  Inside, the computation is ATen calls (invisible to diffkit's capture,
// which sees Python-level torch calls only) plus plain loops where a mistake needs one.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <string>

using torch::Tensor;

namespace {

// ---------------------------------------------------------------- bug codes (see _ops.py)
enum AxialBug {
  AX_OUT_NO_BIAS = 1,          // both blocks: the output projection is computed without its bias
  AX_OUT_TAIL = 2,             // row block: output projection over 16-row tiles, last partial tile never written
  AX_QKV_READ_AS_IN_OUT = 3,   // row block: the [3D, D] qkv weight's memory read as a [D, 3D] matrix
  AX_SCORES_MODEL_WIDTH = 4,   // both blocks: scores scaled by 1/sqrt(D) (model width) instead of 1/sqrt(d)
  AX_SOFTMAX_QUERY_AXIS = 5,   // both blocks: softmax over the query axis instead of the key axis
  AX_COL_NORM_NEGATED = 6,     // column block: LayerNorm computes (mean - x) instead of (x - mean)
};

enum TransformerBug {
  TB_LN1_UNBIASED = 1,         // ln1's variance divided by D - 1
  TB_QKV_BF16 = 2,             // the qkv projection stored in bfloat16, read back as float32
  TB_NO_SCALE = 3,             // scores not multiplied by 1/sqrt(d)
  TB_NEG_SCALE = 4,            // scores multiplied by -1/sqrt(d)
  TB_SOFTMAX_QUERY_AXIS = 5,   // softmax over the query axis
  TB_LOGITS_JI = 6,            // logit (i, j) stored at (j, i)
  TB_PROJ_BIAS_TWICE = 7,      // proj's bias added twice
  TB_PROJ_READ_AS_IN_OUT = 8,  // proj computes x W + b (weight read as [in, out])
  TB_FC1_NO_BIAS = 9,          // fc1 without its bias
  TB_TANH_GELU = 10,           // the MLP's GELU through the tanh approximation
  TB_TILED_TAIL_ROWS = 11,     // every Linear in 16-row tiles; a ragged last tile stores rows of the tile ending at M
};

enum TriangleBug {
  TR_A_TAIL = 1,               // a's gated projection in 32-row tiles, last partial tile never written
  TR_A_TAIL_ROWS = 2,          // a's last partial 32-row tile reads its inputs from rows 0.. instead of its own
  TR_SWAP_IJ = 3,              // the contraction stores x[i, j] at [j, i]
  TR_BF16_SUM = 4,             // the contraction's running sum kept in bfloat16
  TR_AFFINE_BIAS_TWICE = 5,    // proj_out and gate_out add their bias twice
};

enum IpaBug {
  IPA_ROT_TRANSPOSED = 1,      // q/kv points moved to the global frame with R^T instead of R
  IPA_BIAS_LAYOUT = 2,         // pair bias [B, N, N, H] read as if it were [B, H, N, N]
};

enum GemmBnBug { GB_RUNNING_STATS = 1 };                       // BatchNorm normalises with running statistics
enum TemperedBug { TS_NO_MAX = 1, TS_MAX_FIRST = 2 };          // softmax(x/T) without / with a misplaced max
enum SwigluBug { SW_RMS_SUM = 1, SW_FAST_SILU = 2 };           // RMSNorm by sqrt(sum x^2); SiLU by a rational tanh
enum GeluBug { GELU_FLUSH_TAIL = 1 };                          // GELU(x) := 0 for x < -3

void expect(const Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), what, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, " must be float32, got ", t.scalar_type());
}

// LayerNorm over the last axis, written out (mean, biased or unbiased variance, affine).
Tensor layer_norm_manual(const Tensor& x, const Tensor& g, const Tensor& b, double eps, bool unbiased) {
  const int64_t D = x.size(-1);
  auto mean = x.mean(-1, /*keepdim=*/true);
  auto c = x - mean;
  auto var = (c * c).sum(-1, /*keepdim=*/true) / static_cast<double>(unbiased ? D - 1 : D);
  return c * at::rsqrt(var + eps) * g + b;
}

// Rows of `y` ([..., N], any leading shape) as a [M, N] view.
Tensor rows(const Tensor& y) { return y.reshape({-1, y.size(-1)}); }

// Linear over rows in tiles of `tile` whose grid stops at the last full tile: the rows of the last
// partial tile stay zero (neither the product nor the bias is written).
Tensor linear_full_tiles(const Tensor& x, const Tensor& W, const c10::optional<Tensor>& b, int64_t tile) {
  auto xr = rows(x);
  const int64_t M = xr.size(0), covered = (M / tile) * tile;
  auto y = at::zeros({M, W.size(0)}, x.options());
  if (covered > 0) y.narrow(0, 0, covered).copy_(at::linear(xr.narrow(0, 0, covered), W, b));
  auto shape = x.sizes().vec();
  shape.back() = W.size(0);
  return y.view(shape);
}

// A kernel that handles a ragged last tile of `tile` rows by re-reading the full tile that ends at
// the last row, but stores it from the top of the ragged tile: rows t0.. get rows M - tile.. .
void ragged_tile_reads_tile_ending_at_m(Tensor y2d, int64_t tile) {
  const int64_t M = y2d.size(0);
  if (M < tile || M % tile == 0) return;
  const int64_t t0 = M - M % tile, n = M - t0;
  auto src = y2d.narrow(0, M - tile, n).clone();
  y2d.narrow(0, t0, n).copy_(src);
}

// ---------------------------------------------------------------- axial attention

struct AxialParams {
  Tensor ln_w, ln_b, qkv_w, qkv_b, out_w, out_b;
  double eps;
};

// One pre-norm attention block over N independent sequences x [N, L, D]: x + out(attn(LN(x))).
Tensor axial_block(const Tensor& x, const AxialParams& p, int64_t heads, bool is_row, int64_t bug) {
  const int64_t n = x.size(0), L = x.size(1), D = x.size(2), d = D / heads;
  Tensor xn;
  if (!is_row && bug == AX_COL_NORM_NEGATED) {
    auto mean = x.mean(-1, true);
    auto c = x - mean;
    auto rstd = at::rsqrt((c * c).mean(-1, true) + p.eps);
    xn = (mean - x) * rstd * p.ln_w + p.ln_b;
  } else {
    xn = at::layer_norm(x, {D}, p.ln_w, p.ln_b, p.eps);
  }
  Tensor qkv = (is_row && bug == AX_QKV_READ_AS_IN_OUT)
                   ? at::matmul(xn, p.qkv_w.contiguous().view({D, 3 * D})) + p.qkv_b
                   : at::linear(xn, p.qkv_w, p.qkv_b);
  qkv = qkv.view({n, L, 3, heads, d}).permute({2, 0, 3, 1, 4});
  auto q = qkv[0], k = qkv[1], v = qkv[2];
  const double width = bug == AX_SCORES_MODEL_WIDTH ? static_cast<double>(D) : static_cast<double>(d);
  auto scores = at::matmul(q, k.transpose(-1, -2)) / std::sqrt(width);
  auto attn = at::softmax(scores, bug == AX_SOFTMAX_QUERY_AXIS ? -2 : -1);
  auto ctx = at::matmul(attn, v).transpose(1, 2).reshape({n, L, D});
  c10::optional<Tensor> out_b = p.out_b;
  if (bug == AX_OUT_NO_BIAS) out_b = c10::nullopt;
  Tensor out = (is_row && bug == AX_OUT_TAIL) ? linear_full_tiles(ctx, p.out_w, out_b, 16)
                                              : at::linear(ctx, p.out_w, out_b);
  return x + out;
}

Tensor axial_attention(Tensor x, Tensor r_ln_w, Tensor r_ln_b, double r_eps, Tensor r_qkv_w, Tensor r_qkv_b,
                       Tensor r_out_w, Tensor r_out_b, Tensor c_ln_w, Tensor c_ln_b, double c_eps, Tensor c_qkv_w,
                       Tensor c_qkv_b, Tensor c_out_w, Tensor c_out_b, int64_t heads, int64_t bug) {
  expect(x, "x");
  TORCH_CHECK(x.dim() == 4, "axial_attention: x must be [B, H, W, D]");
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), D = x.size(3);
  AxialParams row{r_ln_w, r_ln_b, r_qkv_w, r_qkv_b, r_out_w, r_out_b, r_eps};
  AxialParams col{c_ln_w, c_ln_b, c_qkv_w, c_qkv_b, c_out_w, c_out_b, c_eps};
  auto y = axial_block(x.reshape({B * H, W, D}), row, heads, true, bug).reshape({B, H, W, D});
  auto cols = y.permute({0, 2, 1, 3}).reshape({B * W, H, D});
  return axial_block(cols, col, heads, false, bug).reshape({B, W, H, D}).permute({0, 2, 1, 3}).contiguous();
}

// ---------------------------------------------------------------- transformer block

Tensor transformer_block(Tensor x, Tensor ln1_w, Tensor ln1_b, double eps1, Tensor qkv_w, Tensor qkv_b, Tensor proj_w,
                         Tensor proj_b, Tensor ln2_w, Tensor ln2_b, double eps2, Tensor fc1_w, Tensor fc1_b,
                         Tensor fc2_w, Tensor fc2_b, int64_t heads, int64_t bug) {
  expect(x, "x");
  TORCH_CHECK(x.dim() == 3, "transformer_block: x must be [B, S, D]");
  const int64_t b = x.size(0), s = x.size(1), D = x.size(2), h = heads, d = D / heads;
  auto lin = [&](const Tensor& in, const Tensor& W, const c10::optional<Tensor>& bias) {
    auto y = at::linear(in, W, bias);
    if (bug == TB_TILED_TAIL_ROWS) ragged_tile_reads_tile_ending_at_m(rows(y), 16);
    return y;
  };
  auto y = bug == TB_LN1_UNBIASED ? layer_norm_manual(x, ln1_w, ln1_b, eps1, true)
                                  : at::layer_norm(x, {D}, ln1_w, ln1_b, eps1);
  auto qkv = lin(y, qkv_w, qkv_b);
  if (bug == TB_QKV_BF16) qkv = qkv.to(at::kBFloat16).to(at::kFloat);
  auto parts = qkv.reshape({b, s, 3, h, d}).permute({2, 0, 3, 1, 4}).unbind(0);
  const auto& q = parts[0];
  const auto& k = parts[1];
  const auto& v = parts[2];
  double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (bug == TB_NO_SCALE) scale = 1.0;
  if (bug == TB_NEG_SCALE) scale = -scale;
  auto scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (bug == TB_LOGITS_JI) scores = scores.transpose(-2, -1).contiguous();
  auto attn = at::softmax(scores, bug == TB_SOFTMAX_QUERY_AXIS ? -2 : -1);
  auto ctx = at::matmul(attn, v).transpose(1, 2).reshape({b, s, D});
  Tensor proj;
  if (bug == TB_PROJ_READ_AS_IN_OUT) {
    proj = at::matmul(ctx, proj_w.contiguous().view({proj_w.size(1), proj_w.size(0)})) + proj_b;
  } else {
    proj = lin(ctx, proj_w, proj_b);
    if (bug == TB_PROJ_BIAS_TWICE) proj = proj + proj_b;
  }
  auto x1 = x + proj;
  auto y2 = at::layer_norm(x1, {D}, ln2_w, ln2_b, eps2);
  c10::optional<Tensor> b1 = fc1_b;
  if (bug == TB_FC1_NO_BIAS) b1 = c10::nullopt;
  auto hidden = at::gelu(lin(y2, fc1_w, b1), bug == TB_TANH_GELU ? "tanh" : "none");
  return x1 + lin(hidden, fc2_w, fc2_b);
}

// ---------------------------------------------------------------- triangle multiplicative update

Tensor contraction_bf16_accumulator(const Tensor& a, const Tensor& b) {
  auto ac = a.contiguous(), bc = b.contiguous();
  const int64_t B = ac.size(0), N = ac.size(1), C = ac.size(3);
  auto out = at::empty({B, N, N, C}, ac.options());
  auto A = ac.accessor<float, 4>(), Bt = bc.accessor<float, 4>();
  auto O = out.accessor<float, 4>();
  for (int64_t s = 0; s < B; ++s)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < N; ++j)
        for (int64_t c = 0; c < C; ++c) {
          c10::BFloat16 acc = 0.f;  // rounded to bfloat16 after every add
          for (int64_t k = 0; k < N; ++k) acc = static_cast<float>(acc) + A[s][i][k][c] * Bt[s][j][k][c];
          O[s][i][j][c] = static_cast<float>(acc);
        }
  return out;
}

Tensor triangle_multiplicative_update(Tensor z, Tensor nin_w, Tensor nin_b, double eps_in, Tensor pa_w, Tensor pa_b,
                                      Tensor ga_w, Tensor ga_b, Tensor pb_w, Tensor pb_b, Tensor gb_w, Tensor gb_b,
                                      Tensor nout_w, Tensor nout_b, double eps_out, Tensor po_w, Tensor po_b,
                                      Tensor go_w, Tensor go_b, int64_t bug) {
  expect(z, "z");
  TORCH_CHECK(z.dim() == 4, "triangle_multiplicative_update: z must be [B, N, N, C]");
  const int64_t C = z.size(3), Hc = pa_w.size(0);
  auto zn = at::layer_norm(z, {C}, nin_w, nin_b, eps_in);
  auto a = (at::sigmoid(at::linear(zn, ga_w, ga_b)) * at::linear(zn, pa_w, pa_b)).contiguous();
  if (bug == TR_A_TAIL || bug == TR_A_TAIL_ROWS) {
    auto ar = a.view({-1, Hc});
    const int64_t M = ar.size(0), t0 = (M / 32) * 32;
    if (t0 < M) {
      if (bug == TR_A_TAIL) ar.narrow(0, t0, M - t0).zero_();
      else ar.narrow(0, t0, M - t0).copy_(ar.narrow(0, 0, M - t0).clone());
    }
  }
  auto b = at::sigmoid(at::linear(zn, gb_w, gb_b)) * at::linear(zn, pb_w, pb_b);
  Tensor x = bug == TR_BF16_SUM ? contraction_bf16_accumulator(a, b) : at::einsum("bikc,bjkc->bijc", {a, b});
  if (bug == TR_SWAP_IJ) x = x.transpose(1, 2).contiguous();
  auto xo = at::linear(at::layer_norm(x, {Hc}, nout_w, nout_b, eps_out), po_w, po_b);
  auto gp = at::linear(zn, go_w, go_b);
  if (bug == TR_AFFINE_BIAS_TWICE) {
    xo = xo + po_b;
    gp = gp + go_b;
  }
  return at::sigmoid(gp) * xo;
}

// ---------------------------------------------------------------- invariant point attention

Tensor ipa_to_global(const Tensor& pts, const Tensor& rot, const Tensor& trans, bool transposed) {
  auto rotated = at::einsum(transposed ? "bnji,bnhpj->bnhpi" : "bnij,bnhpj->bnhpi", {rot, pts});
  return rotated + trans.unsqueeze(2).unsqueeze(3);
}

Tensor invariant_point_attention(Tensor s, Tensor z, Tensor rot, Tensor trans, Tensor q_w, Tensor q_b, Tensor kv_w,
                                 Tensor kv_b, Tensor qp_w, Tensor qp_b, Tensor kvp_w, Tensor kvp_b, Tensor pb_w,
                                 Tensor pb_b, Tensor head_weights, Tensor out_w, Tensor out_b, int64_t heads,
                                 int64_t c_hidden, int64_t n_qk, int64_t n_v, int64_t bug) {
  expect(s, "s");
  expect(z, "z");
  const int64_t B = s.size(0), N = s.size(1), h = heads, c = c_hidden;
  auto q = at::linear(s, q_w, q_b).view({B, N, h, c});
  auto kv = at::linear(s, kv_w, kv_b).view({B, N, h, 2 * c}).split(c, -1);
  const auto& k = kv[0];
  const auto& v = kv[1];
  const bool rt = bug == IPA_ROT_TRANSPOSED;
  auto q_pts = ipa_to_global(at::linear(s, qp_w, qp_b).view({B, N, h, n_qk, 3}), rot, trans, rt);
  auto kv_pts = ipa_to_global(at::linear(s, kvp_w, kvp_b).view({B, N, h, n_qk + n_v, 3}), rot, trans, rt);
  auto kvs = kv_pts.split_with_sizes({n_qk, n_v}, 3);
  const auto& k_pts = kvs[0];
  const auto& v_pts = kvs[1];
  auto pair_bias = at::linear(z, pb_w, pb_b).contiguous();  // [B, N, N, H]
  const double w_s = std::sqrt(1.0 / (3 * c)), w_b = std::sqrt(1.0 / 3),
               w_p = std::sqrt(1.0 / (3 * (n_qk * 9.0 / 2)));
  auto gamma = at::softplus(head_weights);
  auto scalar = at::einsum("bihc,bjhc->bhij", {q, k});
  auto dist = (q_pts.unsqueeze(2) - k_pts.unsqueeze(1)).pow(2).sum({-1, -2});
  auto bias_term = bug == IPA_BIAS_LAYOUT ? pair_bias.view({B, h, N, N}) : pair_bias.permute({0, 3, 1, 2});
  auto logits = w_s * scalar + w_b * bias_term - 0.5 * w_p * gamma.view({1, h, 1, 1}) * dist.permute({0, 3, 1, 2});
  auto attn = at::softmax(logits, -1);
  auto o = at::einsum("bhij,bjhc->bihc", {attn, v});
  auto o_pts = at::einsum("bhij,bjhpx->bihpx", {attn, v_pts});
  o_pts = at::einsum("bnji,bnhpj->bnhpi", {rot, o_pts - trans.unsqueeze(2).unsqueeze(3)});
  auto o_norm = at::sqrt(o_pts.pow(2).sum(-1) + 1e-8);
  auto o_pair = at::einsum("bhij,bijc->bihc", {attn, z});
  auto feats = at::cat({o.reshape({B, N, -1}), o_pts.reshape({B, N, -1}), o_norm.reshape({B, N, -1}),
                        o_pair.reshape({B, N, -1})},
                       -1);
  return at::linear(feats, out_w, out_b);
}

// ---------------------------------------------------------------- gemm + batchnorm + softmax

Tensor gemm_batchnorm_softmax(Tensor x, Tensor W, Tensor b, Tensor bn_w, Tensor bn_b, Tensor running_mean,
                              Tensor running_var, Tensor num_batches_tracked, double eps, double momentum,
                              bool training, int64_t bug) {
  expect(x, "x");
  auto y = at::linear(x, W, b);
  Tensor normed;
  if (bug == GB_RUNNING_STATS || !training) {
    normed = (y - running_mean) * at::rsqrt(running_var + eps) * bn_w + bn_b;  // eval()'s statistics
  } else {
    // the batch's statistics, and the running ones updated the way nn.BatchNorm1d does
    normed = at::batch_norm(y, bn_w, bn_b, running_mean, running_var, true, momentum, eps, false);
    at::NoGradGuard guard;
    num_batches_tracked.add_(1);
  }
  return at::softmax(normed, 1);
}

// ---------------------------------------------------------------- tempered softmax pooling

Tensor tempered_softmax(Tensor x, Tensor score_w, Tensor score_b, Tensor value_w, Tensor value_b, double temperature,
                        int64_t bug) {
  expect(x, "x");
  Tensor weights;
  if (bug == TS_MAX_FIRST) {
    // the row maximum of the raw logits, subtracted after dividing by T: exp(u/T - max(u))
    auto u = at::linear(x, score_w, score_b).contiguous();
    auto ur = rows(u);
    weights = at::empty_like(ur);
    auto U = ur.accessor<float, 2>();
    auto P = weights.accessor<float, 2>();
    const float inv_t = 1.0f / static_cast<float>(temperature);
    for (int64_t m = 0; m < ur.size(0); ++m) {
      float mx = U[m][0];
      for (int64_t j = 1; j < ur.size(1); ++j) mx = std::max(mx, U[m][j]);
      float sum = 0.f;
      for (int64_t j = 0; j < ur.size(1); ++j) sum += (P[m][j] = std::exp(U[m][j] * inv_t - mx));
      for (int64_t j = 0; j < ur.size(1); ++j) P[m][j] /= sum;
    }
    weights = weights.view(u.sizes());
  } else {
    auto logits = at::linear(x, score_w, score_b) / temperature;
    if (bug == TS_NO_MAX) {
      // float exp of the raw logits: beyond ~88 it overflows to inf, and inf / inf is NaN
      auto lr = rows(logits.contiguous());
      weights = at::empty_like(lr);
      auto Lg = lr.accessor<float, 2>();
      auto P = weights.accessor<float, 2>();
      for (int64_t m = 0; m < lr.size(0); ++m) {
        float sum = 0.f;
        for (int64_t j = 0; j < lr.size(1); ++j) sum += std::exp(Lg[m][j]);
        for (int64_t j = 0; j < lr.size(1); ++j) P[m][j] = std::exp(Lg[m][j]) / sum;
      }
      weights = weights.view(logits.sizes());
    } else {
      weights = at::softmax(logits, -1);
    }
  }
  return weights * at::linear(x, value_w, value_b);
}

// ---------------------------------------------------------------- SwiGLU MLP

Tensor swiglu_mlp(Tensor x, Tensor norm_w, double eps, Tensor gate_w, Tensor gate_b, Tensor up_w, Tensor up_b,
                  Tensor down_w, Tensor down_b, int64_t bug) {
  expect(x, "x");
  auto ss = bug == SW_RMS_SUM ? x.pow(2).sum(-1, true) : x.pow(2).mean(-1, true);
  auto h = x * at::rsqrt(ss + eps) * norm_w;
  auto g = at::linear(h, gate_w, gate_b);
  Tensor gate;
  if (bug == SW_FAST_SILU) {  // sigmoid(t) = 0.5 + 0.5 tanh(t/2), tanh through the rational t(27 + t^2)/(27 + 9t^2)
    auto t = 0.5 * g;
    auto th = (t * (27.0 + t * t) / (27.0 + 9.0 * t * t)).clamp(-1.0, 1.0);
    gate = g * (0.5 + 0.5 * th);
  } else {
    gate = at::silu(g);
  }
  auto act = gate * at::linear(h, up_w, up_b);
  return x + at::linear(act, down_w, down_b);
}

// ---------------------------------------------------------------- GELU

Tensor gelu(Tensor x, int64_t bug) {
  expect(x, "x");
  auto y = at::gelu(x);
  if (bug == GELU_FLUSH_TAIL) y = at::where(x < -3.0, at::zeros_like(x), y);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("axial_attention", &axial_attention, "axial attention (row block, then column block), one call");
  m.def("transformer_block", &transformer_block, "pre-norm transformer block, one call");
  m.def("triangle_multiplicative_update", &triangle_multiplicative_update, "triangle update (outgoing), one call");
  m.def("invariant_point_attention", &invariant_point_attention, "invariant point attention, one call");
  m.def("gemm_batchnorm_softmax", &gemm_batchnorm_softmax, "Linear + BatchNorm1d + softmax, one call");
  m.def("tempered_softmax", &tempered_softmax, "softmax(x Wq^T / T) * (x Wv^T), one call");
  m.def("swiglu_mlp", &swiglu_mlp, "x + SwiGLU(RMSNorm(x)), one call");
  m.def("gelu", &gelu, "GELU (erf), one call");
}
