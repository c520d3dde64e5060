#pragma once
#include "attn_block.h"
#include "bf16_attn.h"
#include "common.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <atomic>

namespace {

// ---- causal prefill (extend) attention over the paged K/V pool ----
// q [n, H, D]: the chunk's queries, at positions ctx - n .. ctx - 1 of their sequence; the
// sequence's context is `table` [ctx] (pool slots, the chunk's own K/V already stored there),
// k_pool / v_pool its layer's pool viewed as slots [S, KVH, D] (float32, bf16 or FP8 with a
// scale). Query i sees keys 0 .. ctx - n + i. GQA: the H / KVH query heads of a KV head (heads
// h * G .. h * G + G - 1) go through one task together, so each K/V tile serves all of them.
//
// Flash-style, blocked: a task is (KV head, block of QB queries), its rows the G x QB query
// rows; for each block of PF_KB keys, S = Q K^T (register-blocked: RB rows x 16 NH keys), the
// block's softmax, P V (RB rows x 16 * NC columns) joined into the row's output, all in the
// order every attention path shares (attn_block.h), so a row has the bits the decode kernel
// gives it. Keys past a row's position weigh 0; key blocks
// past a task's last query are skipped (the causal half is not computed). Per call, K is
// packed once per KV head into key blocks transposed ([KB][D][PF_KB], the pool's values as
// float32: the S kernel's operand), V is read from the pool in place (float32) or widened once
// (bf16 / FP8). Tasks, heaviest (latest queries) first, are taken from a shared counter by
// the OpenMP team (static halves of a causal triangle are unequal). bf16 queries over a bf16
// pool take bf16_attn.h's order (vdpbf16ps; K and V packed as bf16 pairs) where it applies.
// Where it does not apply (head_dim not a multiple of 16, other dtypes) the rows are gathered
// and SDPA runs with the causal mask.

constexpr int PF_KB = AB_KB;  // keys per block (attn_block.h: the blocks every path shares)
#if defined(PD_ISA_AVX512)
constexpr int PF_QK_RB = 4, PF_QK_NH = 2;  // 4 rows x 32 keys: 24 partials + 2 keys of 32 zmm
constexpr int PF_PV_RB = 4, PF_PV_NC = 4;  // 16 accumulators
#else
constexpr int PF_QK_RB = 1, PF_QK_NH = 1;  // 5 partials (10 ymm) of 16
constexpr int PF_PV_RB = 2, PF_PV_NC = 2;  // 8 ymm accumulators
#endif
constexpr int PF_ROWS = 96;  // target query rows (G x QB) a task: its tiles stay in L2

// s[r * PF_KB + j0 + (0 .. 16 NH)]: RB rows' scores of 16 NH keys, summed as the decode kernel
// sums a score (attn_block.h): lane partial l = sum over c of q[16c + l] kt[16c + l][key] (FMAs
// from zero, c ascending), taken for l in bit-reversed order so that a binary counter folds
// them in vreduce_add's tree: (l, l+8), then (l, l+4), (l, l+2), (0, 1). DD: the head dim as a
// constant (the c loop unrolled, each K vector loaded once for the RB rows) or 0 (D at run
// time). The counter's two upper levels (one vector each per 4 and per 8 partials) wait in
// `spill` [2][RB][NH][16] (L1), so that the registers hold RB x NH x 3 accumulators: a tile of
// 4 x 2 (8 FMAs a K vector and a broadcast each) instead of 2 x 2.
template <int RB, int NH, int DD>
inline void pf_qk(const float* q, int64_t Drt, const float* kt, int j0, float* s, float* spill) {
  const int64_t D = DD > 0 ? DD : Drt;
  V16 st[2][RB][NH], cur[RB][NH];
  PD_UNROLL for (int idx = 0; idx < 16; ++idx) {
    const int l = ((idx & 1) << 3) | ((idx & 2) << 1) | ((idx & 4) >> 1) | ((idx & 8) >> 3);
    PD_UNROLL for (int r = 0; r < RB; ++r) PD_UNROLL for (int h = 0; h < NH; ++h)
      cur[r][h] = vzero();
    PD_UNROLL for (int64_t c = l; c < D; c += 16) {
      V16 kv[NH];
      PD_UNROLL for (int h = 0; h < NH; ++h) kv[h] = vload(kt + c * PF_KB + j0 + 16 * h);
      PD_UNROLL for (int r = 0; r < RB; ++r) {
        const V16 qv = vset1(q[r * D + c]);
        PD_UNROLL for (int h = 0; h < NH; ++h) cur[r][h] = vfmadd(qv, kv[h], cur[r][h]);
      }
    }
    int lv = 0;
    PD_UNROLL for (; lv < 4 && ((idx >> lv) & 1); ++lv)
      PD_UNROLL for (int r = 0; r < RB; ++r) PD_UNROLL for (int h = 0; h < NH; ++h) {
        const V16 below = lv < 2 ? st[lv & 1][r][h]
                                 : vload(spill + (((lv - 2) * RB + r) * NH + h) * 16);
        cur[r][h] = vadd(below, cur[r][h]);
      }
    if (lv < 4)
      PD_UNROLL for (int r = 0; r < RB; ++r) PD_UNROLL for (int h = 0; h < NH; ++h) {
        if (lv < 2)
          st[lv & 1][r][h] = cur[r][h];
        else
          vstore(spill + (((lv - 2) * RB + r) * NH + h) * 16, cur[r][h]);
      }
  }
  PD_UNROLL for (int r = 0; r < RB; ++r)
    PD_UNROLL for (int h = 0; h < NH; ++h) vstore(s + r * PF_KB + j0 + 16 * h, cur[r][h]);
}

// a block's scores for rows r0 .. r0 + RB, keys 0 .. kn
template <int RB>
inline void pf_qk_block(const float* q, int64_t D, const float* kt, int kn, float* s,
                        float* spill) {
  if (D == 64) {
    for (int j0 = 0; j0 < kn; j0 += 16 * PF_QK_NH) pf_qk<RB, PF_QK_NH, 64>(q, D, kt, j0, s, spill);
  } else {
    for (int j0 = 0; j0 < kn; j0 += 16 * PF_QK_NH) pf_qk<RB, PF_QK_NH, 0>(q, D, kt, j0, s, spill);
  }
}

// o[r * D + c0 + (0 .. 16 NC)] = ab_mix(o, sum_{j < len} p[r * PF_KB + j] vrow[j][...], a[r],
// c[r]): the block's output (FMAs from zero in key order) joined into the row's
template <int RB, int NC>
inline void pf_pv(const float* p, int len, const float* const* vrow, int64_t D, int64_t c0,
                  const float* a, const float* cw, float* o) {
  V16 acc[RB][NC];
  PD_UNROLL for (int r = 0; r < RB; ++r) PD_UNROLL for (int c = 0; c < NC; ++c)
    acc[r][c] = vzero();
  for (int j = 0; j < len; ++j) {
    V16 vv[NC];
    PD_UNROLL for (int c = 0; c < NC; ++c) vv[c] = vload(vrow[j] + c0 + 16 * c);
    PD_UNROLL for (int r = 0; r < RB; ++r) {
      const V16 pj = vset1(p[r * PF_KB + j]);
      PD_UNROLL for (int c = 0; c < NC; ++c) acc[r][c] = vfmadd(pj, vv[c], acc[r][c]);
    }
  }
  PD_UNROLL for (int r = 0; r < RB; ++r) {
    const V16 av = vset1(a[r]), cv = vset1(cw[r]);
    PD_UNROLL for (int c = 0; c < NC; ++c) {
      float* dst = o + r * D + c0 + 16 * c;
      vstore(dst, ab_mix(vload(dst), acc[r][c], av, cv));
    }
  }
}

template <int RB>
inline void pf_pv_cols(const float* p, int len, const float* const* vrow, int64_t D,
                       const float* a, const float* cw, float* o) {
  int64_t c0 = 0;
  for (; c0 + 16 * PF_PV_NC <= D; c0 += 16 * PF_PV_NC)
    pf_pv<RB, PF_PV_NC>(p, len, vrow, D, c0, a, cw, o);
  for (; c0 < D; c0 += 16) pf_pv<RB, 1>(p, len, vrow, D, c0, a, cw, o);
}

template <typename T>
inline float pf_widen(T x, float scale) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return static_cast<float>(x);
  } else {
    return static_cast<float>(x) * scale;
  }
}

// K of KV head h, key block b, as float32 transposed: kt[d * PF_KB + j] (keys past ctx: 0)
template <typename T>
void pf_pack_k(const T* pool, const int64_t* tab, int64_t ctx, int64_t KVH, int64_t D,
               int64_t h, int64_t b, float scale, float* kt) {
  const int64_t k0 = b * PF_KB, kn = std::min<int64_t>(PF_KB, ctx - k0);
  if (kn < PF_KB)
    for (int64_t d = 0; d < D; ++d) std::fill(kt + d * PF_KB + kn, kt + (d + 1) * PF_KB, 0.0f);
  for (int64_t j = 0; j < kn; ++j) {
    const T* row = pool + (tab[k0 + j] * KVH + h) * D;
    for (int64_t d = 0; d < D; ++d) kt[d * PF_KB + j] = pf_widen(row[d], scale);
  }
}

struct PfShape {
  int64_t n, ctx, H, KVH, G, D, QB, nqb, nkb;
  float scale;
};

// one task: KV head h, queries q0 .. q0 + nq of the chunk
void pf_task(const PfShape& s, const float* q, int64_t qs0, int64_t qs1, const float* kt_all,
             const float* v_in_place, const float* v_wide, const int64_t* tab, int64_t h,
             int64_t q0, float* out, std::vector<float>& buf) {
  const int64_t D = s.D, G = s.G, nq = std::min(s.QB, s.n - q0), R = nq * G;
  buf.resize(R * D * 2 + R * PF_KB + R * 6 + 2 * PF_QK_RB * PF_QK_NH * 16);
  float* qp = buf.data();           // [R, D] the queries, times the scale; row r = i * G + g
  float* o = qp + R * D;            // [R, D] the running output
  float* sc = o + R * D;            // [R, PF_KB] scores, then weights
  float* m = sc + R * PF_KB;        // [R] running max
  float* l = m + R;                 // [R] running sum
  float* alpha = l + R;             // [R] this block's weights: the row's so far (a)
  float* cw = alpha + R;            // [R] and the block's (c), attn_block.h
  float* mbs = cw + R;              // [R] the block's max and sum (-inf and 0: none visible)
  float* lbs = mbs + R;
  float* spill = lbs + R;           // pf_qk's upper levels
  const float* vrow[PF_KB];          // the block's V rows (float32)
  const V16 sv = vset1(s.scale);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float* src = q + (q0 + i) * qs0 + (h * G + g) * qs1;
      float* dst = qp + (i * G + g) * D;
      for (int64_t d = 0; d < D; d += 16) vstore(dst + d, vmul(vload(src + d), sv));
    }
  std::fill(o, o + R * D, 0.0f);
  std::fill(m, m + R, -INFINITY);
  std::fill(l, l + R, 0.0f);
  const int64_t first = s.ctx - s.n + q0;  // the position of the task's first query
  const int64_t kend = first + nq;         // keys 0 .. kend - 1 are seen by some row
  for (int64_t b = 0; b * PF_KB < kend; ++b) {
    const int64_t k0 = b * PF_KB;
    const int kn = static_cast<int>(std::min<int64_t>(PF_KB, kend - k0));
    const float* kt = kt_all + (h * s.nkb + b) * D * PF_KB;
    for (int j = 0; j < kn; ++j)
      vrow[j] = v_wide ? v_wide + (h * s.ctx + k0 + j) * D
                       : v_in_place + (tab[k0 + j] * s.KVH + h) * D;
    // the next block's K tile and V rows toward L2 while this block computes (V rows sit in
    // pool slots KVH x D floats apart, in no order the hardware prefetcher follows)
    if (k0 + PF_KB < kend) {
      const int64_t k1 = k0 + PF_KB, kn1 = std::min<int64_t>(PF_KB, kend - k1);
      const char* ktn = reinterpret_cast<const char*>(kt + D * PF_KB);
      for (int64_t x = 0; x < D * PF_KB * 4; x += 64) _mm_prefetch(ktn + x, _MM_HINT_T1);
      for (int64_t j = 0; j < kn1; ++j) {
        const char* vr = reinterpret_cast<const char*>(
            v_wide ? v_wide + (h * s.ctx + k1 + j) * D : v_in_place + (tab[k1 + j] * s.KVH + h) * D);
        for (int64_t x = 0; x < D * 4; x += 64) _mm_prefetch(vr + x, _MM_HINT_T1);
      }
    }
    int64_t r = 0;
    for (; r + PF_QK_RB <= R; r += PF_QK_RB)
      pf_qk_block<PF_QK_RB>(qp + r * D, D, kt, kn, sc + r * PF_KB, spill);
    for (; r < R; ++r) pf_qk_block<1>(qp + r * D, D, kt, kn, sc + r * PF_KB, spill);
    for (r = 0; r < R; ++r) {  // a row with no visible key here: a = 1, c = 0 (unchanged)
      const int64_t pos = first + r / G;
      const int lim = static_cast<int>(std::clamp<int64_t>(pos - k0 + 1, 0, kn));
      if (!ab_softmax(sc + r * PF_KB, lim, kn, mbs[r], lbs[r])) lbs[r] = 0.0f;
    }
    ab_weights_rows(m, l, mbs, lbs, alpha, cw, R);
    for (r = 0; r + PF_PV_RB <= R; r += PF_PV_RB)
      pf_pv_cols<PF_PV_RB>(sc + r * PF_KB, kn, vrow, D, alpha + r, cw + r, o + r * D);
    for (; r < R; ++r) pf_pv_cols<1>(sc + r * PF_KB, kn, vrow, D, alpha + r, cw + r, o + r * D);
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g)
      ab_finish(o + (i * G + g) * D, D, l[i * G + g], out + ((q0 + i) * s.H + h * G + g) * D);
}

template <typename T>
void pf_pack_all(const PfShape& s, const Tensor& k_pool, const Tensor& v_pool,
                 const int64_t* tab, double k_scale, double v_scale, float* kt_all,
                 float* v_wide) {
  const T* kp = reinterpret_cast<const T*>(k_pool.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_pool.data_ptr());
  at::parallel_for(0, s.KVH * s.nkb, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / s.nkb, b = i % s.nkb;
      pf_pack_k<T>(kp, tab, s.ctx, s.KVH, s.D, h, b, static_cast<float>(k_scale),
                   kt_all + i * s.D * PF_KB);
      if (v_wide != nullptr) {
        const int64_t k0 = b * PF_KB, kn = std::min<int64_t>(PF_KB, s.ctx - k0);
        for (int64_t j = 0; j < kn; ++j) {
          const T* row = vp + (tab[k0 + j] * s.KVH + h) * s.D;
          float* dst = v_wide + (h * s.ctx + k0 + j) * s.D;
          for (int64_t d = 0; d < s.D; ++d) dst[d] = pf_widen(row[d], static_cast<float>(v_scale));
        }
      }
    }
  });
}

// the gathered rows through SDPA with the causal mask: where the kernel does not apply
Tensor prefill_attention_sdpa(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                              const Tensor& table, double scale, double k_scale,
                              double v_scale, int64_t KVH) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), ctx = table.numel();
  const auto widen = [&](const Tensor& pool, double sc) {
    Tensor rows = pool.reshape({-1, KVH, D}).index_select(0, table);
    const bool fp8 = pool.scalar_type() == at::kFloat8_e4m3fn ||
                     pool.scalar_type() == at::kFloat8_e5m2;
    rows = rows.to(q.scalar_type());
    if (fp8 && sc != 1.0) rows = rows * sc;
    return rows.transpose(0, 1).repeat_interleave(H / KVH, 0);  // [H, ctx, D]
  };
  Tensor pos = at::arange(ctx - n, ctx, table.options()).unsqueeze(1);
  Tensor mask = at::arange(ctx, table.options()).unsqueeze(0) <= pos;
  Tensor o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0),
                                              widen(k_pool, k_scale).unsqueeze(0),
                                              widen(v_pool, v_scale).unsqueeze(0), mask, 0.0,
                                              false, scale);
  return o[0].transpose(0, 1).contiguous();
}

// `out` (optional): [n, H, D] in q's dtype (or float32: the rows unrounded), written and
// returned (the caller's rows of the step's attention output: no copy of a returned tensor)
Tensor prefill_attention_paged(const Tensor& q_in, const Tensor& k_pool, const Tensor& v_pool,
                               const Tensor& table, double scale, double k_scale,
                               double v_scale, int64_t kv_heads,
                               const std::optional<Tensor>& out_opt) {
  TORCH_CHECK(q_in.dim() == 3 && table.dim() == 1 && table.scalar_type() == at::kLong,
              "prefill_attention_paged: q [n, H, D], table [ctx] long");
  const int64_t n = q_in.size(0), H = q_in.size(1), D = q_in.size(2), ctx = table.numel();
  const int64_t KVH = kv_heads;
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "prefill_attention_paged: ", H,
              " query heads do not group over ", KVH, " KV heads");
  TORCH_CHECK(n > 0 && n <= ctx, "prefill_attention_paged: ", n, " queries after a context of ",
              ctx, " slots");
  TORCH_CHECK(k_pool.numel() == v_pool.numel() && k_pool.numel() % (KVH * D) == 0 &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "prefill_attention_paged: the pools are not [slots, kv_heads, head_dim]");
  const int64_t S = k_pool.numel() / (KVH * D);
  Tensor tabc = table.contiguous();
  const int64_t* tab = tabc.data_ptr<int64_t>();
  for (int64_t i = 0; i < ctx; ++i)
    TORCH_CHECK(tab[i] >= 0 && tab[i] < S, "prefill_attention_paged: slot ", tab[i],
                " outside the pool (", S, " slots)");
  const auto pt = k_pool.scalar_type();
  const bool pool_ok = pt == at::kFloat || pt == at::kBFloat16 || pt == at::kFloat8_e4m3fn ||
                       pt == at::kFloat8_e5m2;
  const bool ok = isa_supported() && D % 16 == 0 && pool_ok && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() &&
                  (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16);
  const bool has_out = out_opt.has_value() && out_opt->defined();
  if (has_out)
    TORCH_CHECK(out_opt->sizes() == q_in.sizes() && (out_opt->scalar_type() == q_in.scalar_type()
                || out_opt->scalar_type() == at::kFloat),
                "prefill_attention_paged: out is not [n, H, D] in q's dtype or float32");
  if (!ok) {
    Tensor r = prefill_attention_sdpa(q_in, k_pool, v_pool, tabc, scale, k_scale, v_scale, KVH);
    return has_out ? out_opt->copy_(r) : r;
  }
  // float32 queries, rows D apart (the pack's q view: strided over tokens and heads)
  Tensor q = q_in.scalar_type() == at::kFloat && q_in.stride(2) == 1 ? q_in : q_in.to(at::kFloat).contiguous();
  PfShape s;
  s.n = n, s.ctx = ctx, s.H = H, s.KVH = KVH, s.G = H / KVH, s.D = D;
  s.scale = static_cast<float>(scale);
  s.nkb = (ctx + PF_KB - 1) / PF_KB;
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  // rows a task: ~PF_ROWS, fewer where the chunk is short (four tasks a thread at least)
  const int64_t want_qb = std::max<int64_t>(1, (4 * nth + KVH - 1) / KVH);
  s.QB = std::clamp<int64_t>((n + want_qb - 1) / want_qb, 1, std::max<int64_t>(1, PF_ROWS / s.G));
  s.nqb = (n + s.QB - 1) / s.QB;
  // bf16 queries over a bf16 pool: the bf16 order (bf16_attn.h) where it applies
  const bool dot = bf16_attn_applies(q_in.scalar_type(), pt, D);
  Tensor kt_all = at::empty({dot ? 0 : KVH * s.nkb * D * PF_KB}, q.options().dtype(at::kFloat));
  Tensor v_wide, pairs;  // pairs: the bf16 order's K and V blocks [2][KVH][nkb][D * PF_KB]
  if (pt != at::kFloat && !dot) v_wide = at::empty({KVH * ctx * D}, kt_all.options());
  float* ktp = kt_all.data_ptr<float>();
  float* vwp = v_wide.defined() ? v_wide.data_ptr<float>() : nullptr;
  uint16_t* kpp = nullptr;
  if (dot) {
    pairs = at::empty({2 * KVH * s.nkb * D * PF_KB}, q.options().dtype(at::kBFloat16));
    kpp = reinterpret_cast<uint16_t*>(pairs.data_ptr<at::BFloat16>());
    const auto* kp = reinterpret_cast<const uint16_t*>(k_pool.data_ptr<at::BFloat16>());
    const auto* vp = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>());
    const int64_t nb = KVH * s.nkb, bsz = D * PF_KB;
    at::parallel_for(0, nb, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        ba_pack_block(kp, vp, tab, ctx, KVH, D, i / s.nkb, i % s.nkb, kpp + i * bsz,
                      kpp + (nb + i) * bsz);
    });
  } else switch (pt) {
    case at::kFloat: pf_pack_all<float>(s, k_pool, v_pool, tab, 1.0, 1.0, ktp, vwp); break;
    case at::kBFloat16:
      pf_pack_all<c10::BFloat16>(s, k_pool, v_pool, tab, 1.0, 1.0, ktp, vwp);
      break;
    case at::kFloat8_e4m3fn:
      pf_pack_all<c10::Float8_e4m3fn>(s, k_pool, v_pool, tab, k_scale, v_scale, ktp, vwp);
      break;
    default: pf_pack_all<c10::Float8_e5m2>(s, k_pool, v_pool, tab, k_scale, v_scale, ktp, vwp);
  }
  const bool direct = has_out && out_opt->scalar_type() == at::kFloat && out_opt->is_contiguous();
  Tensor out = direct ? *out_opt : at::empty({n, H, D}, kt_all.options());
  const uint16_t* vpp = dot ? kpp + KVH * s.nkb * D * PF_KB : nullptr;
  const float* qp = q.data_ptr<float>();
  const float* vip = pt == at::kFloat ? v_pool.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ntask = KVH * s.nqb;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(nth, ntask), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t t; (t = next.fetch_add(1)) < ntask;) {
      const int64_t qb = s.nqb - 1 - t / KVH, h = t % KVH;  // the latest queries first
#if defined(PD_ISA_AVX512)
      if (dot) {
        pf_task_bf16(s, qp, q.stride(0), q.stride(1), kpp, vpp, h, qb * s.QB, op, buf);
        continue;
      }
#endif
      pf_task(s, qp, q.stride(0), q.stride(1), ktp, vip, vwp, tab, h, qb * s.QB, op, buf);
    }
  });
  if (direct) return out;
  const auto want = has_out ? out_opt->scalar_type() : q_in.scalar_type();
  Tensor r = want == at::kFloat ? out : out.to(want);
  return has_out ? out_opt->copy_(r) : r;
}

}  // namespace
