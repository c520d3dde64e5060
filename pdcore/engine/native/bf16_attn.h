#pragma once
// bf16 attention with vdpbf16ps (#47): a bf16 model's queries against a bf16 pool, both
// kernels (the paged decode kernel, attention.h; the causal prefill kernel,
// prefill_attention.h) in the bf16 order of attn_block.h, so a row has the same bits in every
// phase. The widening kernels (bf16 -> float32, float32 FMAs) spent 61% of a 4096-token
// SmolLM2 bf16 prefill in attention (s12: 1.96 of 3.27 s, ~296 GFLOP/s); one vdpbf16ps does a
// pair of products per lane (twice the FMA's work) on half the bytes.
// - q . k: 16 lane partials, lane l summing vdpbf16ps over the d-pairs (32c + 2l, 32c + 2l + 1),
//   c ascending, from zero (a = the key's pair, b = the query's), the lanes then added in
//   vreduce_add's tree; the score is that sum times the scale (the dot of the unscaled bf16
//   query: a bf16 model's q is bf16-valued before the scale), a bias added after.
// - the block's weights e rounded to bf16 (as GPU flash attention's P for a bf16 model), lb the
//   sum of the rounded e (so O / L weighs each V by exactly its bf16 weight);
// - P V: ob lane d = vdpbf16ps over the key pairs (2i, 2i + 1) of the block in key order, from
//   zero (a = the V pair, b = the P pair); an odd block's last pair has a zero weight and a zero
//   (decode) or unseen (prefill) V: a zero product either way, the same sum.
// The decode kernel reads K rows (a 64-byte load is 16 d-pairs) and pairs V rows as it goes;
// the prefill kernel packs K as transposed pairs [D/2][PF_KB][2] (a load is one d-pair of 16
// keys) and V as key pairs [PF_KB/2][D][2] once per call. Where vdpbf16ps is missing (AVX2,
// AVX-512 without BF16) or head_dim is not a multiple of 32, every path keeps the widening
// order: bits then differ across ISAs, which is allowed (a server runs one ISA).
#include "attn_block.h"
#include "common.h"

namespace {

inline bool bf16_attn_supported() {
#if defined(PD_ISA_AVX512)
  static const bool ok = isa_supported() && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// whether a call takes the bf16 order: bf16 queries (a bf16 model), a bf16 pool, head_dim a
// multiple of 32, vdpbf16ps on this CPU (a float32 model's queries over a bf16 pool: widened)
inline bool bf16_attn_applies(at::ScalarType q, at::ScalarType pool, int64_t D) {
  return q == at::kBFloat16 && pool == at::kBFloat16 && D % 32 == 0 && bf16_attn_supported();
}

// ---- prefill: prefill_attention.h's pf_task in the bf16 order ----
// KV head h's key block b: K as transposed pairs kt[(p * AB_KB + j) * 2 + t] = k_j[2p + t], V as
// key pairs vt[((j / 2) * D + d) * 2 + j % 2] = v_j[d] (keys past ctx: 0)
inline void ba_pack_block(const uint16_t* kpool, const uint16_t* vpool, const int64_t* tab,
                          int64_t ctx, int64_t KVH, int64_t D, int64_t h, int64_t b,
                          uint16_t* kt, uint16_t* vt) {
  const int64_t k0 = b * AB_KB, kn = std::min<int64_t>(AB_KB, ctx - k0);
  if (kn < AB_KB) {
    std::fill(kt, kt + D * AB_KB, uint16_t(0));
    std::fill(vt, vt + D * AB_KB, uint16_t(0));
  }
  for (int64_t j = 0; j < kn; ++j) {
    const int64_t row = (tab[k0 + j] * KVH + h) * D;
    const uint16_t* kr = kpool + row;
    const uint16_t* vr = vpool + row;
    for (int64_t p = 0; p < D / 2; ++p) std::memcpy(kt + (p * AB_KB + j) * 2, kr + 2 * p, 4);
    uint16_t* vd = vt + (j / 2) * D * 2 + (j % 2);
    for (int64_t d = 0; d < D; ++d) vd[2 * d] = vr[d];
  }
}

#if defined(PD_ISA_AVX512)
#define BA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// n floats (bf16-valued: exact; else rounded to nearest even) to bf16, n a multiple of 16
inline void ba_to_bf16(const float* x, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 16) vstore_upper_halves(dst + i, vround_bf16(vload(x + i)));
}

// two bf16-valued weights as one vdpbf16ps pair (p0 in the low half)
inline int32_t ba_pair(float p0, float p1) {
  uint32_t a, b;
  std::memcpy(&a, &p0, 4);
  std::memcpy(&b, &p1, 4);
  return static_cast<int32_t>((a >> 16) | (b & 0xFFFF0000u));
}

inline int32_t ba_load32(const uint16_t* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

// 16 columns of V rows a and b (nullptr: zeros) as pairs (a[d], b[d])
BA_TARGET inline __m512bh ba_pair_rows(const uint16_t* a, const uint16_t* b) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  if (b == nullptr) return (__m512bh)lo;
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  return (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// ---- decode: attention.h's attend_heads (the same blocks, passes and join) in the bf16 order;
// q [H, G, D] float32 bf16-valued, the pools bf16; work as attend_heads' (the bf16 queries in
// the first half of its query room)
template <int DV, int G>
BA_TARGET void attend_heads_bf16(const float* q, const uint16_t* kp, const uint16_t* vp,
                                 int64_t H, const int64_t* tab, const float* bias, int64_t W,
                                 float scale, float* out, float* blocks, int64_t hstride,
                                 float* work) {
  constexpr int64_t D = DV * 16;
  constexpr int DP = DV / 2;  // 64-byte loads (16 d-pairs) a row
  const int64_t rs = H * D, HG = H * G;
  uint16_t* qb = reinterpret_cast<uint16_t*>(work);  // [H, G, D] bf16
  float* sc = work + HG * D;                         // [H, G, AB_KB] scores, then weights
  float* M = sc + HG * AB_KB;
  float* L = M + HG;
  ba_to_bf16(q, HG * D, qb);
  if (out != nullptr) {
    std::fill(out, out + HG * D, 0.0f);
    std::fill(M, M + HG, -INFINITY);
    std::fill(L, L + HG, 0.0f);
  }
  alignas(64) float ob[D];
  for (int64_t b0 = 0; b0 < W; b0 += AB_KB) {
    const int kn = static_cast<int>(std::min<int64_t>(AB_KB, W - b0));
    for (int j = 0; j < kn; ++j) {
      const uint16_t* kr = kp + tab[b0 + j] * rs;
      const char* vr = reinterpret_cast<const char*>(vp + tab[b0 + j] * rs);
      for (int64_t l = 0; l < rs * 2; l += 64) _mm_prefetch(vr + l, _MM_HINT_T0);
      const float add = bias ? bias[b0 + j] : 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        const uint16_t* kh = kr + h * D;
        const uint16_t* qh = qb + h * G * D;
        __m512 acc[G];
        PD_UNROLL for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        PD_UNROLL for (int d = 0; d < DP; ++d) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(kh + d * 32);
          PD_UNROLL for (int g = 0; g < G; ++g)
            acc[g] = _mm512_dpbf16_ps(acc[g], kv, (__m512bh)_mm512_loadu_si512(qh + g * D + d * 32));
        }
        PD_UNROLL for (int g = 0; g < G; ++g)
          sc[(h * G + g) * AB_KB + j] = _mm512_reduce_add_ps(acc[g]) * scale + add;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      float* sh = sc + h * G * AB_KB;
      float mb[G], lb[G];
      bool vis[G], any = false;
      PD_UNROLL for (int g = 0; g < G; ++g) {
        vis[g] = ab_softmax(sh + g * AB_KB, kn, kn, mb[g], lb[g], true);
        any = any || vis[g];
      }
      float* bp = blocks ? blocks + h * hstride + (b0 / AB_KB) * G * (D + 2) : nullptr;
      if (!any) {
        if (bp) PD_UNROLL for (int g = 0; g < G; ++g) bp[g * (D + 2)] = -INFINITY;
        continue;
      }
      __m512 acc[G][DV];
      PD_UNROLL for (int g = 0; g < G; ++g)
        PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = _mm512_setzero_ps();
      for (int i = 0; i < kn; i += 2) {
        const bool two = i + 1 < kn;
        const uint16_t* va = vp + tab[b0 + i] * rs + h * D;
        const uint16_t* vb = two ? vp + tab[b0 + i + 1] * rs + h * D : nullptr;
        __m512bh vv[DV];
        PD_UNROLL for (int d = 0; d < DV; ++d)
          vv[d] = ba_pair_rows(va + d * 16, vb ? vb + d * 16 : nullptr);
        PD_UNROLL for (int g = 0; g < G; ++g) {
          const float* pg = sh + g * AB_KB;
          const __m512bh pv = (__m512bh)_mm512_set1_epi32(ba_pair(pg[i], two ? pg[i + 1] : 0.0f));
          PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = _mm512_dpbf16_ps(acc[g][d], vv[d], pv);
        }
      }
      PD_UNROLL for (int g = 0; g < G; ++g) {
        if (bp) {
          float* dst = bp + g * (D + 2);
          dst[0] = vis[g] ? mb[g] : -INFINITY;
          dst[1] = lb[g];
          PD_UNROLL for (int d = 0; d < DV; ++d) _mm512_storeu_ps(dst + 2 + d * 16, acc[g][d]);
        } else if (vis[g]) {
          const int64_t r = h * G + g;
          PD_UNROLL for (int d = 0; d < DV; ++d) _mm512_storeu_ps(ob + d * 16, acc[g][d]);
          ab_join(M[r], L[r], out + r * D, D, mb[g], lb[g], ob);
        }
      }
    }
  }
  if (out != nullptr)
    for (int64_t r = 0; r < HG; ++r) ab_finish(out + r * D, D, L[r], out + r * D);
}

// s[r * AB_KB + j0 + (0 .. 16 NH)] = RB rows' scores of 16 NH keys: pf_qk's partials and fold
// (bit-reversed lanes, a binary counter in vreduce_add's tree), each partial l a vdpbf16ps
// chain over the d-pairs 16c + l; then times the scale
template <int RB, int NH, int DD>
BA_TARGET inline void ba_qk(const uint16_t* q, int64_t Drt, const uint16_t* kt, int j0,
                            float scale, float* s, float* spill) {
  const int64_t D = DD > 0 ? DD : Drt, NP = D / 2;
  __m512 st[2][RB][NH], cur[RB][NH];
  PD_UNROLL for (int idx = 0; idx < 16; ++idx) {
    const int l = ((idx & 1) << 3) | ((idx & 2) << 1) | ((idx & 4) >> 1) | ((idx & 8) >> 3);
    PD_UNROLL for (int r = 0; r < RB; ++r) PD_UNROLL for (int h = 0; h < NH; ++h)
      cur[r][h] = _mm512_setzero_ps();
    PD_UNROLL for (int64_t p = l; p < NP; p += 16) {
      __m512bh kv[NH];
      PD_UNROLL for (int h = 0; h < NH; ++h)
        kv[h] = (__m512bh)_mm512_loadu_si512(kt + (p * AB_KB + j0 + 16 * h) * 2);
      PD_UNROLL for (int r = 0; r < RB; ++r) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(ba_load32(q + r * D + 2 * p));
        PD_UNROLL for (int h = 0; h < NH; ++h) cur[r][h] = _mm512_dpbf16_ps(cur[r][h], kv[h], qv);
      }
    }
    int lv = 0;
    PD_UNROLL for (; lv < 4 && ((idx >> lv) & 1); ++lv)
      PD_UNROLL for (int r = 0; r < RB; ++r) PD_UNROLL for (int h = 0; h < NH; ++h) {
        const __m512 below = lv < 2 ? st[lv & 1][r][h]
                                    : _mm512_loadu_ps(spill + (((lv - 2) * RB + r) * NH + h) * 16);
        cur[r][h] = _mm512_add_ps(below, cur[r][h]);
      }
    if (lv < 4)
      PD_UNROLL for (int r = 0; r < RB; ++r) PD_UNROLL for (int h = 0; h < NH; ++h) {
        if (lv < 2)
          st[lv & 1][r][h] = cur[r][h];
        else
          _mm512_storeu_ps(spill + (((lv - 2) * RB + r) * NH + h) * 16, cur[r][h]);
      }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  PD_UNROLL for (int r = 0; r < RB; ++r) PD_UNROLL for (int h = 0; h < NH; ++h)
    _mm512_storeu_ps(s + r * AB_KB + j0 + 16 * h, _mm512_mul_ps(cur[r][h], sv));
}

template <int RB>
BA_TARGET inline void ba_qk_block(const uint16_t* q, int64_t D, const uint16_t* kt, int kn,
                                  float scale, float* s, float* spill) {
  constexpr int NH = 2;
  if (D == 64) {
    for (int j0 = 0; j0 < kn; j0 += 16 * NH) ba_qk<RB, NH, 64>(q, D, kt, j0, scale, s, spill);
  } else if (D == 128) {
    for (int j0 = 0; j0 < kn; j0 += 16 * NH) ba_qk<RB, NH, 128>(q, D, kt, j0, scale, s, spill);
  } else {
    for (int j0 = 0; j0 < kn; j0 += 16 * NH) ba_qk<RB, NH, 0>(q, D, kt, j0, scale, s, spill);
  }
}

// o[r * D + c0 + (0 .. 16 NC)] = ab_mix(o, the block's P V, a[r], c[r]); pb: the rows' bf16
// weights (AB_KB apart, zero past the block's keys), np key pairs
template <int RB, int NC>
BA_TARGET inline void ba_pv(const uint16_t* pb, int np, const uint16_t* vt, int64_t D,
                            int64_t c0, const float* a, const float* cw, float* o) {
  __m512 acc[RB][NC];
  PD_UNROLL for (int r = 0; r < RB; ++r) PD_UNROLL for (int c = 0; c < NC; ++c)
    acc[r][c] = _mm512_setzero_ps();
  for (int i = 0; i < np; ++i) {
    __m512bh vv[NC];
    PD_UNROLL for (int c = 0; c < NC; ++c)
      vv[c] = (__m512bh)_mm512_loadu_si512(vt + (i * D + c0 + 16 * c) * 2);
    PD_UNROLL for (int r = 0; r < RB; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(ba_load32(pb + r * AB_KB + 2 * i));
      PD_UNROLL for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pv);
    }
  }
  PD_UNROLL for (int r = 0; r < RB; ++r) {
    const V16 av = vset1(a[r]), cv = vset1(cw[r]);
    PD_UNROLL for (int c = 0; c < NC; ++c) {
      float* dst = o + r * D + c0 + 16 * c;
      vstore(dst, ab_mix(vload(dst), V16{acc[r][c]}, av, cv));
    }
  }
}

template <int RB>
BA_TARGET inline void ba_pv_cols(const uint16_t* pb, int np, const uint16_t* vt, int64_t D,
                                 const float* a, const float* cw, float* o) {
  int64_t c0 = 0;
  for (; c0 + 64 <= D; c0 += 64) ba_pv<RB, 4>(pb, np, vt, D, c0, a, cw, o);
  for (; c0 < D; c0 += 16) ba_pv<RB, 1>(pb, np, vt, D, c0, a, cw, o);
}

// ab_softmax(s, lim, kn, mb, lb, true) for the prefill task, e written as bf16 straight into
// pb [kn rounded up to 16] (zero past lim) for ba_pv, s left as it is; lb = 0 where no key is
// visible. The same bits: vcvtneps2bf16 rounds to nearest even as vround_bf16 does for these e
// (0, or normal in [2^-126, 1]: exp_ps_le0 is 0 below -87; the instruction would flush
// denormals), lb sums the rounded e, and the max (exact in any order) is taken across lanes in
// the register, with no scalar round trip.
BA_TARGET inline bool ba_softmax(const float* s, int lim, int kn, float& mb, float& lb,
                                 uint16_t* pb) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 mx = ninf;
  for (int j = 0; j < lim; j += 16)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, lane_mask(lim - j), s + j));
  mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, 0x4E));
  mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, 0xB1));
  mx = _mm512_max_ps(mx, _mm512_permute_ps(mx, 0x4E));
  mx = _mm512_max_ps(mx, _mm512_permute_ps(mx, 0xB1));
  mb = _mm512_cvtss_f32(mx);
  if (mb == -INFINITY) {
    for (int j = 0; j < kn; j += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), _mm256_setzero_si256());
    lb = 0.0f;
    return false;
  }
  const V16 mv{mx};
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < kn; j += 16) {
    const M16 live = lane_mask(lim - j);
    const V16 e = vmaskz(live, exp_ps_le0(vsub(vmask_load(mv, live, s + j), mv)));
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(e.v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), h);
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  lb = _mm512_reduce_add_ps(sum);
  return true;
}

// one task (KV head h, queries q0 .. q0 + nq): pf_task's blocks, softmax and join; kt_all /
// vt_all: the packed blocks [KVH][nkb][D * AB_KB] (ba_pack_block). Shape: prefill_attention.h's
template <typename Shape>
BA_TARGET void pf_task_bf16(const Shape& s, const float* q, int64_t qs0, int64_t qs1,
                            const uint16_t* kt_all, const uint16_t* vt_all, int64_t h,
                            int64_t q0, float* out, std::vector<float>& buf) {
  constexpr int RB = 4;
  const int64_t D = s.D, G = s.G, nq = std::min(s.QB, s.n - q0), R = nq * G;
  buf.resize(R * D + R * AB_KB + R * 6 + 2 * RB * 2 * 16 + R * D / 2 + R * AB_KB / 2);
  float* o = buf.data();          // [R, D] the running output; row r = i * G + g
  float* sc = o + R * D;          // [R, AB_KB] scores, then weights
  float* m = sc + R * AB_KB;      // [R] running max, sum, the block's a and c
  float* l = m + R;
  float* alpha = l + R;
  float* cw = alpha + R;
  float* mbs = cw + R;            // [R] the block's max and sum (-inf and 0: none visible)
  float* lbs = mbs + R;
  float* spill = lbs + R;         // ba_qk's upper levels
  uint16_t* qb = reinterpret_cast<uint16_t*>(spill + 2 * RB * 2 * 16);  // [R, D] bf16
  uint16_t* pb = qb + R * D;      // [R, AB_KB] the block's weights in bf16
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g)
      ba_to_bf16(q + (q0 + i) * qs0 + (h * G + g) * qs1, D, qb + (i * G + g) * D);
  std::fill(o, o + R * D, 0.0f);
  std::fill(m, m + R, -INFINITY);
  std::fill(l, l + R, 0.0f);
  const int64_t first = s.ctx - s.n + q0, kend = first + nq;
  const int64_t bsz = D * AB_KB;  // a block's bf16 elements (K, and V)
  for (int64_t b = 0; b * AB_KB < kend; ++b) {
    const int64_t k0 = b * AB_KB;
    const int kn = static_cast<int>(std::min<int64_t>(AB_KB, kend - k0));
    const uint16_t* kt = kt_all + (h * s.nkb + b) * bsz;
    const uint16_t* vt = vt_all + (h * s.nkb + b) * bsz;
    if (k0 + AB_KB < kend) {  // the next block's K and V toward L2
      for (int64_t x = 0; x < bsz * 2; x += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kt + bsz) + x, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vt + bsz) + x, _MM_HINT_T1);
      }
    }
    int64_t r = 0;
    for (; r + RB <= R; r += RB)
      ba_qk_block<RB>(qb + r * D, D, kt, kn, s.scale, sc + r * AB_KB, spill);
    for (; r < R; ++r) ba_qk_block<1>(qb + r * D, D, kt, kn, s.scale, sc + r * AB_KB, spill);
    for (r = 0; r < R; ++r) {  // a row with no visible key here: a = 1, c = 0 (unchanged)
      const int64_t pos = first + r / G;
      const int lim = static_cast<int>(std::clamp<int64_t>(pos - k0 + 1, 0, kn));
      ba_softmax(sc + r * AB_KB, lim, kn, mbs[r], lbs[r], pb + r * AB_KB);
    }
    ab_weights_rows(m, l, mbs, lbs, alpha, cw, R);
    const int np = (kn + 1) / 2;
    for (r = 0; r + RB <= R; r += RB)
      ba_pv_cols<RB>(pb + r * AB_KB, np, vt, D, alpha + r, cw + r, o + r * D);
    for (; r < R; ++r) ba_pv_cols<1>(pb + r * AB_KB, np, vt, D, alpha + r, cw + r, o + r * D);
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g)
      ab_finish(o + (i * G + g) * D, D, l[i * G + g], out + ((q0 + i) * s.H + h * G + g) * D);
}

#endif  // PD_ISA_AVX512

}  // namespace
