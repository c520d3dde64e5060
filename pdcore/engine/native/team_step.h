#pragma once
// A W8A8 decode step's layer loop in ONE OpenMP parallel region (#48). decode_layers (in
// decode_step.cpp) runs each operator on its own: a GEMM, the attention and silu_mul each fork
// and join the team (a fork and a join each wake the sleeping threads under the engine's
// passive or bounded-spin wait, runtime_env.py), and between them the calling thread alone
// runs the norms, the rotary and K/V stores and o_proj's quantization while the others wait.
// Here the team is made once a step (every shared buffer allocated before it) and a layer has
// five barriers, one after each shared phase:
//   qkv GEMM (panels) | rotary + K/V stores, attention, o_proj's quantization (a thread's
//   rows) | o GEMM | [every row's add + RMSNorm + quantization, by each thread for itself]
//   gate_up GEMM | [every row's silu * up + quantization, each thread] down GEMM | [the next
//   layer's add + RMSNorm + quantization, each thread]
// Each thread keeps its own copy of the residual stream (thread 0's is the result): a GEMM's
// panels need every row of its input, so a thread making all of them itself (a few us at
// decode sizes) needs no barrier between the row pass and the GEMM.
// Every phase calls the functions the separate operators call (i8_gemm_item, rope_store_row,
// the attention kernel, add_rms_norm_row, silu_mul_rows_f32, i8_quantize_row) on the same
// rows and panels, and no sum crosses a row or a panel, so the residual stream is the
// operators' to the bit, whatever the thread count. Where any condition of the fused path
// does not hold (team_fits), decode_layers runs the operators as before.
#include <omp.h>

#include <atomic>

#include "attention.h"
#include "elementwise.h"
#include "int8_act.h"
#include "int8_gemm.h"

namespace {

std::atomic<int64_t> TEAM_STEPS{0};  // steps run in the team region (tests: the path ran)
int64_t team_steps() { return TEAM_STEPS.load(); }

// [lo, hi) of n items for thread tid of nt: at::parallel_for's contiguous chunks
inline std::pair<int64_t, int64_t> team_share(int64_t n, int tid, int nt) {
  const int64_t chunk = (n + nt - 1) / nt;
  const int64_t lo = std::min<int64_t>(n, tid * chunk);
  return {lo, std::min<int64_t>(n, lo + chunk)};
}

struct TeamGemm {  // one int8 GEMM of the step: its tiles x panels, shared out as for_tiles
  const int8_t* xq;
  int64_t Kp;
  const int8_t* w;
  int64_t P;
  I8Out o;
};

inline void team_gemm(const TeamGemm& g, const Tiling& tiling, int64_t path, int tid, int nt) {
  const auto [i0, i1] = team_share(g.P * tiling.blocks(), tid, nt);
  I8AmxCfg cfg;  // AMX: this thread's tile configuration, for its share of this GEMM
  tiles_of_share(tiling, g.P, i0, i1, [&](int64_t m, int64_t rows, int64_t p) {
    i8_gemm_item(g.xq, g.Kp, g.w, path, g.o, m, rows, p, cfg);
  });
}

// Whether the team region runs this step: W8A8 (every GEMM weight int8 panels; f32: float32
// panels, team_f32.h), float32, the view appended to (mode 0) in float32 with one row per
// token, or (f32 only) the float32 pool read in place (mode 2: table, the paged kernel whole,
// not in parts), and the fused rotary, the norm's, silu_mul's and the attention's fast kernels
// (not in parts) all applying
bool team_fits(const Tensor& residual, const Tensor& cos, const Tensor& sin, at::TensorList ln1,
               at::TensorList ln2, at::TensorList qkv_w, at::TensorList qkv_b,
               at::TensorList o_w, at::TensorList gu_w, at::TensorList down_w,
               at::TensorList k_pool, at::TensorList v_pool, at::TensorList view_k,
               at::TensorList view_v, const Tensor& out_slots, const Tensor& rows,
               const Tensor& cols, const Tensor& bias, int64_t mode, int64_t width,
               int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
               bool f32 = false, const Tensor* table = nullptr) {
  const int64_t L = static_cast<int64_t>(ln1.size());
  const bool paged = f32 && mode == 2 && table != nullptr;
  if (L == 0 || (mode != 0 && !paged) || residual.dim() != 2 ||
      view_k.size() != (paged ? 0 : ln1.size()) || kv_heads <= 0 ||
      num_heads % kv_heads != 0 || width <= 0 || inter % 32 != 0 || !panel_gemm_supported())
    return false;
  const int64_t T = residual.size(0), hidden = residual.size(1);
  const int64_t qs = num_heads * head_dim, ks = kv_heads * head_dim;
  const int64_t G = num_heads / kv_heads;
  if (T == 0)
    return false;
  if (paged) {  // decode_attention_paged's float32 kernel, whole sequences, slots in the pool
    if (kernel_for<AllHeads<float>>(head_dim, G) == nullptr ||
        dp_use_parts(T, width, dp_part_len(width)) || table->scalar_type() != at::kLong ||
        !table->is_contiguous() || table->numel() != T * width)
      return false;
    for (int64_t i = 0; i < L; ++i)
      if (k_pool[i].scalar_type() != at::kFloat || !k_pool[i].is_contiguous() ||
          k_pool[i].sizes() != k_pool[0].sizes())
        return false;
    const int64_t S = k_pool[0].numel() / (kv_heads * head_dim);
    const int64_t* tp = table->data_ptr<int64_t>();
    for (int64_t j = 0; j < T * width; ++j)
      if (tp[j] < 0 || tp[j] >= S) return false;  // the operator refuses it (an error)
  } else if (!long_rows(rows, T) || !long_rows(cols, T) ||
             kernel_for<OneHead>(head_dim, G) == nullptr ||
             da_use_parts(T, kv_heads, width, da_part_len(kv_heads, head_dim))) {
    return false;
  }
  if (bias.defined() && bias.numel() > 0 &&
      !(bias.scalar_type() == at::kFloat && bias.numel() == T * width))
    return false;
  const Tensor qkv_like = at::empty({T, qs + 2 * ks}, residual.options());
  const Tensor none = at::empty({0}, residual.options());
  for (int64_t i = 0; i < L; ++i) {
    if (!f32) {
      for (const Tensor* w : {&qkv_w[i], &o_w[i], &gu_w[i], &down_w[i]})
        if (w->scalar_type() != at::kChar || w->dim() != 2 || !w->is_contiguous()) return false;
    } else {  // float32 panels [ceil(N / 32), K, 32] (team_f32.h)
      const std::pair<const Tensor*, std::pair<int64_t, int64_t>> ws[] = {
          {&qkv_w[i], {hidden, qs + 2 * ks}}, {&o_w[i], {qs, hidden}},
          {&gu_w[i], {hidden, 2 * inter}}, {&down_w[i], {inter, hidden}}};
      for (const auto& [w, kn] : ws)
        if (w->scalar_type() != at::kFloat || w->dim() != 3 || !w->is_contiguous() ||
            w->size(1) != kn.first || w->size(2) != PANEL || w->size(0) * PANEL < kn.second)
          return false;
    }
    if (!add_rms_norm_fits(residual, none, ln1[i]) ||
        !add_rms_norm_fits(residual, none, ln2[i]))
      return false;
    if (paged) {
      if (!rope_store_fits(qkv_like, cos, sin, k_pool[i], v_pool[i], nullptr, nullptr, out_slots,
                           num_heads, kv_heads, head_dim))
        return false;
    } else if (const Tensor& vk = view_k[i];
               vk.scalar_type() != at::kFloat || vk.dim() != 4 || vk.size(0) != T ||
               vk.size(1) != kv_heads || vk.size(2) < width || vk.size(3) != head_dim ||
               !rope_store_fits(qkv_like, cos, sin, k_pool[i], v_pool[i], &view_k[i],
                                &view_v[i], out_slots, num_heads, kv_heads, head_dim)) {
      return false;
    }
    if (qkv_b[i].defined() && qkv_b[i].numel() > 0 && qkv_b[i].numel() != qs + 2 * ks)
      return false;
  }
  (void)hidden;
  return true;
}

// The step (team_fits holds): the residual stream after every layer, as decode_layers gives it
Tensor team_decode_layers(const Tensor& residual_in, const Tensor& cos, const Tensor& sin,
                          at::TensorList ln1, at::TensorList ln2, at::TensorList qkv_w,
                          at::TensorList qkv_b, at::TensorList o_w, at::TensorList gu_w,
                          at::TensorList down_w, at::TensorList k_pool, at::TensorList v_pool,
                          at::TensorList view_k, at::TensorList view_v, const Tensor& out_slots,
                          const Tensor& rows, const Tensor& cols, const Tensor& bias_in,
                          int64_t width, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                          int64_t inter, double eps, double scale) {
  TEAM_STEPS.fetch_add(1);
  const int64_t T = residual_in.size(0), hidden = residual_in.size(1), L = ln1.size();
  // the quantization's path; the GEMMs' (i8_gemm_path: VNNI for few rows on the AMX path)
  const int64_t chosen = int8_resolve_path(0);
  const bool u8 = i8_u8(chosen);
  const int64_t path = i8_gemm_path(chosen, T);
  const int64_t H = kv_heads, G = num_heads / kv_heads, D = head_dim, I = inter;
  const int64_t qs = num_heads * D, ks = kv_heads * D, nqkv = qs + 2 * ks;
  const int64_t Kh = i8_kp(hidden), Kq = i8_kp(qs), Ki = i8_kp(I);
  const auto f32 = residual_in.options().dtype(at::kFloat);
  Tensor residual = residual_in.contiguous().clone();  // the caller's embedding is not written
  Tensor qkv = at::empty({T, nqkv}, f32), q = at::empty({T, num_heads, D}, f32);
  Tensor att = at::empty({T, qs}, f32), x = at::empty({T, hidden}, f32);
  Tensor gu = at::empty({T, 2 * I}, f32), down = at::empty({T, hidden}, f32);
  Tensor xq_q = at::empty({T, Kq}, f32.dtype(at::kChar)), xs_q = at::empty({T}, f32);
  Tensor bias;
  if (bias_in.defined() && bias_in.numel() > 0) bias = bias_in.contiguous();
  std::vector<Tensor> qb(L);  // each layer's qkv bias in float32, or undefined
  std::vector<RopeRows<float, float>> rope(L);
  std::vector<const float*> n1(L), n2(L);
  for (int64_t i = 0; i < L; ++i) {
    if (qkv_b[i].defined() && qkv_b[i].numel() > 0) qb[i] = qkv_b[i].to(at::kFloat).contiguous();
    rope[i] = rope_rows<float, float>(qkv, cos, sin, k_pool[i], v_pool[i], &view_k[i],
                                      &view_v[i], out_slots, rows.data_ptr<int64_t>(),
                                      cols.data_ptr<int64_t>(), q, num_heads, kv_heads, D);
    n1[i] = ln1[i].data_ptr<float>();
    n2[i] = ln2[i].data_ptr<float>();
  }
  // token t's K/V go to view row t (a decode batch's usual rows): a thread's rotary rows are
  // its attention rows, no barrier between
  bool own_rows = true;
  for (int64_t t = 0; t < T; ++t) own_rows = own_rows && rows.data_ptr<int64_t>()[t] == t;
  const Tiling tiling(T);
  const AttendFn fn = kernel_for<OneHead>(D, G);
  float* res0 = residual.data_ptr<float>();
  float *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>(), *ap = att.data_ptr<float>();
  float *xp = x.data_ptr<float>(), *gup = gu.data_ptr<float>(), *dp = down.data_ptr<float>();
  int8_t* xqq = xq_q.data_ptr<int8_t>();
  float* sq = xs_q.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps), sc = static_cast<float>(scale);
  const int want = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
  // Every thread keeps its own copy of the residual stream and makes every row's norm / silu
  // rows and their quantization itself (a few us of arithmetic at decode sizes): its GEMM
  // panels need all the rows, so this saves the barrier a shared copy would need after each
  // of those passes. The copies hold the same bits (the same operations in the same order);
  // thread 0's is the result.
#pragma omp parallel num_threads(want)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const auto [r0, r1] = team_share(T, tid, nt);  // this thread's rows of the attention
    std::vector<float> mine(tid == 0 ? 0 : T * hidden);
    if (tid != 0) std::memcpy(mine.data(), res0, sizeof(float) * T * hidden);
    float* rp = tid == 0 ? res0 : mine.data();
    std::vector<int8_t> xh(T * Kh), xi(T * Ki);
    std::vector<float> sh(T), si(T), tmp(std::max({hidden, I, D})), sqs(hidden);
    std::vector<float> scores(G * AB_KB);
    const auto norm_rows = [&](const float* add, const float* w) {  // residual += add; x_q
      for (int64_t t = 0; t < T; ++t) {
        add_rms_norm_row(rp + t * hidden, add ? add + t * hidden : nullptr, w, hidden, e,
                         sqs.data(), tmp.data());
        sh[t] = i8_quantize_row(tmp.data(), hidden, Kh, u8, xh.data() + t * Kh);
      }
    };
    norm_rows(nullptr, n1[0]);  // layer 0's input norm: no add, the residual is not written
    for (int64_t i = 0; i < L; ++i) {
      const Tensor& vk = view_k[i];
      team_gemm({xh.data(), Kh, qkv_w[i].data_ptr<int8_t>(), qkv_w[i].size(0),
                 {qkvp, nqkv, sh.data(), qb[i].defined() ? qb[i].data_ptr<float>() : nullptr}},
                tiling, path, tid, nt);
#pragma omp barrier
      for (int64_t t = r0; t < r1; ++t) rope_store_row<float, float>(rope[i], t, tmp.data());
      if (!own_rows) {
#pragma omp barrier
      }
      // attention: sequence b's heads (b = the query row), then its o_proj input quantized
      const float* kp = vk.data_ptr<float>();
      const float* vp = view_v[i].data_ptr<float>();
      const int64_t ksb = vk.stride(0), ksh = vk.stride(1), ksw = vk.stride(2);
      const int64_t vsb = view_v[i].stride(0), vsh = view_v[i].stride(1),
                    vsw = view_v[i].stride(2);
      for (int64_t b = r0; b < r1; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t r = b * H + h;
          fn(qp + r * G * D, kp + b * ksb + h * ksh, ksw, vp + b * vsb + h * vsh, vsw,
             bp ? bp + b * width : nullptr, width, sc, ap + r * G * D, scores.data(), nullptr);
        }
        sq[b] = i8_quantize_row(ap + b * qs, qs, Kq, u8, xqq + b * Kq);
      }
#pragma omp barrier
      team_gemm({xqq, Kq, o_w[i].data_ptr<int8_t>(), o_w[i].size(0), {xp, hidden, sq, nullptr}},
                tiling, path, tid, nt);
#pragma omp barrier
      norm_rows(xp, n2[i]);
      team_gemm({xh.data(), Kh, gu_w[i].data_ptr<int8_t>(), gu_w[i].size(0),
                 {gup, 2 * I, sh.data(), nullptr}},
                tiling, path, tid, nt);
#pragma omp barrier
      for (int64_t t = 0; t < T; ++t) {
        silu_mul_rows_f32(gup + t * 2 * I, 2 * I, tmp.data(), I, 0, 1);
        si[t] = i8_quantize_row(tmp.data(), I, Ki, u8, xi.data() + t * Ki);
      }
      team_gemm({xi.data(), Ki, down_w[i].data_ptr<int8_t>(), down_w[i].size(0),
                 {dp, hidden, si.data(), nullptr}},
                tiling, path, tid, nt);
#pragma omp barrier
      if (i + 1 < L) {
        norm_rows(dp, n1[i + 1]);
      } else {
        for (int64_t k = 0; k < T * hidden; ++k) rp[k] += dp[k];
      }
    }
  }
  return residual;
}

}  // namespace
