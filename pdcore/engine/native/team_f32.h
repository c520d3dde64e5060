#pragma once
// A float32 model's decode step in ONE parallel region, with the work handed out by phase
// (team_phase.h) instead of shared out in fixed parts between barriers (#47). The separate
// operators (decode_layers) fork and join the team ~9 times a layer, and each join waits for
// every thread: with a busy neighbour on one core, each of those waits lasts as long as the
// OS keeps the preempted thread off (a bf16 step measured 1.8x slower beside half a core's
// load, where a quarter of the CPU lost explains 1.33x). Here a layer is eight phases:
//   input norm (rows) | qkv GEMM (panels) | [rotary + K/V stores (rows), where token t's K/V
//   do not go to view row t, and over the pool] | rotary + attention (rows: a sequence's
//   heads) | o GEMM (panels) | add + norm (rows) | gate_up GEMM (panels) | silu * up (rows) |
//   down GEMM (panels)
// then the next layer's add + norm (the last layer: the add alone). Each item calls the
// function the separate operator calls on the same row or panel (add_rms_norm_row, the panel
// GEMM's tiles, rope_store_row, the view's or the paged attention kernel (mode 0 / 2),
// silu_mul_rows_f32) and no sum
// crosses a row or a panel, so the residual stream is the operators' to the bit, whatever
// thread runs which item and however many there are. Where team_fits(f32) does not hold,
// decode_layers runs the operators.
#include "team_phase.h"
#include "team_step.h"

namespace {

// the panel GEMM's items: (block of rows, panel), every tile of the block down the panel, the
// tiles reading x as it lies (row-major); y = x W^T + b as panel_gemm makes it
struct TeamF32Gemm {
  const float* x;
  int64_t K;
  const float* w;
  int64_t P;
  float* y;
  int64_t N;
  const float* b;
  int64_t items(const Tiling& t) const { return P * t.blocks(); }
  void item(const Tiling& t, int64_t i) const {
    const int64_t mb = i / P, p = i % P;
    for (int64_t k = t.first[mb]; k < t.first[mb + 1]; ++k) {
      const auto [m, rows] = t.tiles[k];
      Tiles<false, float>::FN[rows - 1](x + m * K, K, w + p * K * PANEL, y + m * N, N,
                                        p * PANEL, b);
    }
  }
};

// The step (team_fits(..., f32 = true) holds): the residual stream after every layer
Tensor team_f32_layers(const Tensor& residual_in, const Tensor& cos, const Tensor& sin,
                       at::TensorList ln1, at::TensorList ln2, at::TensorList qkv_w,
                       at::TensorList qkv_b, at::TensorList o_w, at::TensorList gu_w,
                       at::TensorList down_w, at::TensorList k_pool, at::TensorList v_pool,
                       at::TensorList view_k, at::TensorList view_v, const Tensor& out_slots,
                       const Tensor& rows, const Tensor& cols, const Tensor& table,
                       const Tensor& bias_in, int64_t mode, int64_t width, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                       int64_t inter, double eps, double scale) {
  TEAM_STEPS.fetch_add(1);
  const int64_t T = residual_in.size(0), hidden = residual_in.size(1), L = ln1.size();
  const int64_t H = kv_heads, G = num_heads / kv_heads, D = head_dim, I = inter;
  const int64_t qs = num_heads * D, ks = kv_heads * D, nqkv = qs + 2 * ks;
  const auto f32 = residual_in.options().dtype(at::kFloat);
  Tensor residual = residual_in.contiguous().clone();  // the caller's embedding is not written
  Tensor qkv = at::empty({T, nqkv}, f32), q = at::empty({T, num_heads, D}, f32);
  Tensor att = at::empty({T, qs}, f32), nx = at::empty({T, hidden}, f32);
  Tensor x = at::empty({T, hidden}, f32), gu = at::empty({T, 2 * I}, f32);
  Tensor act = at::empty({T, I}, f32), down = at::empty({T, hidden}, f32);
  Tensor bias;
  if (bias_in.defined() && bias_in.numel() > 0) bias = bias_in.contiguous();
  std::vector<Tensor> qb(L);  // each layer's qkv bias in float32, or undefined
  std::vector<RopeRows<float, float>> rope(L);
  const bool paged = mode == 2;  // no view: the pool read in place through table
  for (int64_t i = 0; i < L; ++i) {
    if (qkv_b[i].defined() && qkv_b[i].numel() > 0) qb[i] = qkv_b[i].to(at::kFloat).contiguous();
    rope[i] = rope_rows<float, float>(qkv, cos, sin, k_pool[i], v_pool[i],
                                      paged ? nullptr : &view_k[i], paged ? nullptr : &view_v[i],
                                      out_slots, paged ? nullptr : rows.data_ptr<int64_t>(),
                                      paged ? nullptr : cols.data_ptr<int64_t>(), q, num_heads,
                                      kv_heads, D);
  }
  // token t's K/V go to view row t (a decode batch's usual rows): row b's attention item runs
  // its rotary first; else (and over the pool, where a sequence's slots are its table's) the
  // rotary is a phase of its own before the attention
  bool own_rows = !paged;
  for (int64_t t = 0; own_rows && t < T; ++t) own_rows = rows.data_ptr<int64_t>()[t] == t;
  const Tiling tiling(T);
  const AttendFn fn = paged ? nullptr : kernel_for<OneHead>(D, G);
  const ScaledFn<float> pfn = paged ? kernel_for<AllHeads<float>>(D, G) : nullptr;
  const int64_t* tp = paged ? table.data_ptr<int64_t>() : nullptr;
  float* rp = residual.data_ptr<float>();
  float *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>(), *ap = att.data_ptr<float>();
  float *nxp = nx.data_ptr<float>(), *xp = x.data_ptr<float>(), *gup = gu.data_ptr<float>();
  float *actp = act.data_ptr<float>(), *dp = down.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps), sc = static_cast<float>(scale);
  TeamPhases phases(2 + L * (own_rows ? 8 : 9));
  const int want = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
#pragma omp parallel num_threads(want)
  {
    PhaseCursor cur{phases};
    std::vector<float> sq(hidden), tmp(std::max<int64_t>(D, 16));
    std::vector<float> scores(G * AB_KB), work(paged ? H * G * (D + AB_KB + 2) : 0);
    const auto norm_phase = [&](const float* add, const float* w) {  // residual += add; nx
      cur.run(T, [&](int64_t t) {
        add_rms_norm_row(rp + t * hidden, add ? add + t * hidden : nullptr, w, hidden, e,
                         sq.data(), nxp + t * hidden);
      });
    };
    const auto gemm_phase = [&](const TeamF32Gemm& g) {
      cur.run(g.items(tiling), [&](int64_t i) { g.item(tiling, i); });
    };
    norm_phase(nullptr, ln1[0].data_ptr<float>());  // layer 0's: no add
    for (int64_t i = 0; i < L; ++i) {
      gemm_phase({nxp, hidden, qkv_w[i].data_ptr<float>(), qkv_w[i].size(0), qkvp, nqkv,
                  qb[i].defined() ? qb[i].data_ptr<float>() : nullptr});
      if (!own_rows) cur.run(T, [&](int64_t t) { rope_store_row<float, float>(rope[i], t, tmp.data()); });
      if (paged) {  // sequence b, every head, reading the pool through its table row
        const float* kp = k_pool[i].data_ptr<float>();
        const float* vp = v_pool[i].data_ptr<float>();
        cur.run(T, [&](int64_t b) {
          pfn(qp + b * H * G * D, kp, vp, H, tp + b * width, bp ? bp + b * width : nullptr, width,
              sc, ap + b * H * G * D, nullptr, 0, work.data(), 1.0f, 1.0f);
        });
      } else {
      const Tensor &vk = view_k[i], &vv = view_v[i];
      const float* kp = vk.data_ptr<float>();
      const float* vp = vv.data_ptr<float>();
      const int64_t ksb = vk.stride(0), ksh = vk.stride(1), ksw = vk.stride(2);
      const int64_t vsb = vv.stride(0), vsh = vv.stride(1), vsw = vv.stride(2);
      cur.run(T, [&](int64_t b) {  // sequence b: its rotary (own rows), then its heads
        if (own_rows) rope_store_row<float, float>(rope[i], b, tmp.data());
        for (int64_t h = 0; h < H; ++h) {
          const int64_t r = b * H + h;
          fn(qp + r * G * D, kp + b * ksb + h * ksh, ksw, vp + b * vsb + h * vsh, vsw,
             bp ? bp + b * width : nullptr, width, sc, ap + r * G * D, scores.data(), nullptr);
        }
      });
      }
      gemm_phase({ap, qs, o_w[i].data_ptr<float>(), o_w[i].size(0), xp, hidden, nullptr});
      norm_phase(xp, ln2[i].data_ptr<float>());
      gemm_phase({nxp, hidden, gu_w[i].data_ptr<float>(), gu_w[i].size(0), gup, 2 * I, nullptr});
      cur.run(T, [&](int64_t t) { silu_mul_rows_f32(gup, 2 * I, actp, I, t, t + 1); });
      gemm_phase({actp, I, down_w[i].data_ptr<float>(), down_w[i].size(0), dp, hidden, nullptr});
      if (i + 1 < L) norm_phase(dp, ln1[i + 1].data_ptr<float>());
    }
    cur.run(T, [&](int64_t t) {  // the last layer's residual add
      for (int64_t k = 0; k < hidden; ++k) rp[t * hidden + k] += dp[t * hidden + k];
    });
  }
  return residual;
}

}  // namespace
