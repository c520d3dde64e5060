#pragma once
// One summation order for every attention path (#48): a query row's output has the same bits
// whether the causal prefill kernel (prefill_attention.h) computes it, or the decode kernel
// (attention.h) alone, in a padded group, in parts (flash-decoding) or over the view's rows.
// Rounding activations to int8 (the packed GGUF's integer dot) turns a last-bit difference on a
// rounding boundary into a whole step, so the paths must agree to the bit, not closely.
//
// The order, for a row q (times the scale, one vmul) against keys 0 .. n - 1:
// - a score: 16 lane partials, lane l summing q[16c + l] k[16c + l] over c ascending (FMAs from
//   zero), the lanes then added in vreduce_add's tree ((l, l+8), (l, l+4), (l, l+2), (0, 1));
//   the decode kernel's row form does exactly that, the prefill kernel folds 16 partials of
//   transposed keys in the same tree (pf_qk); a bias (0 or -inf) is added after;
// - keys in blocks of AB_KB at fixed positions (block b: keys 64b .. 64b + 63); a block on its
//   own: its max mb, e_j = exp(s_j - mb) (masked: 0), lb = sum of e (16 lanes over its chunks
//   in order, then vreduce_add), ob = sum_j e_j v_j (FMAs in key order from zero);
// - the blocks joined in key order into (M, L, O) (ab_weights_v, ab_mix): m2 = max(M, mb),
//   a = exp(M - m2), c = exp(mb - m2) (exp_ps, vec.h: since s14, not std::exp, so that the
//   prefill kernels weigh 16 rows in one vector and decode takes lane 0 of the same),
//   L = fma(lb, c, L a), O = fma(ob, c, O a); a block with no visible key leaves the row as it
//   is; the row's output is O * (1 / L).
// bf16 queries over a bf16 pool where the CPU has vdpbf16ps (bf16_attn.h): the same blocks and
// join, but a score is the vdpbf16ps dot of the unscaled bf16 query (lane l sums the d-pairs
// (32c + 2l, 32c + 2l + 1), c ascending, the same tree) times the scale, e is rounded to bf16
// (lb sums the rounded e) and ob sums vdpbf16ps over key pairs (2i, 2i + 1) in key order.
// Blocks are independent until the join, so a long context can be computed in parts by
// several threads and joined after in the same order (attention.h: da_split).
#include "common.h"

namespace {

constexpr int AB_KB = 64;  // keys per block

// one row's block: s[0, lim) its visible scores (s[lim, kn) masked; any may be -inf, masked by a
// bias): e in place (0 where masked), mb and lb; false (s zeroed) when no key is visible.
// bf16_p: e rounded to bf16 (nearest even) before it is stored and summed (bf16_attn.h)
inline bool ab_softmax(float* s, int lim, int kn, float& mb, float& lb, bool bf16_p = false) {
  const V16 ninf = vset1(-INFINITY);
  V16 mx = ninf;
  for (int j = 0; j < lim; j += 16) mx = vmax(mx, vmask_load(ninf, lane_mask(lim - j), s + j));
  mb = lim > 0 ? vreduce_max(mx) : -INFINITY;
  if (mb == -INFINITY) {
    for (int j = 0; j < kn; j += 16) vmask_store(s + j, lane_mask(kn - j), vzero());
    return false;
  }
  const V16 mv = vset1(mb);
  V16 sum = vzero();
  for (int j = 0; j < kn; j += 16) {
    const M16 live = lane_mask(lim - j), in = lane_mask(kn - j);
    V16 e = vmaskz(live, exp_ps_le0(vsub(vmask_load(mv, live, s + j), mv)));
    if (bf16_p) e = vround_bf16(e);
    vmask_store(s + j, in, e);
    sum = vadd(sum, e);
  }
  lb = vreduce_add(sum);
  return true;
}

// the join's weights for 16 rows at once (one exp_ps for 16 rows' a and c, where the join took
// 2 std::exp a row before s14): lane i joins its block (mb, lb) into its row's running max M and
// sum L; a and c weigh the row's output so far and the block's: O = ab_mix(O, ob, a, c). A lane
// whose block has no visible key (mb = -inf, lb = 0) keeps M and L (a = 1, c = 0).
inline void ab_weights_v(V16& M, V16& L, V16 mb, V16 lb, V16& a, V16& c) {
  const M16 vis = vlt(vset1(-INFINITY), mb);
  const V16 m2 = vmax(M, mb);
  a = exp_ps_le0(vmaskz(vis, vsub(M, m2)));  // M = -inf (the first block): 0; none visible: 1
  c = vmaskz(vis, exp_ps_le0(vsub(mb, m2)));
  L = vfmadd(lb, c, vmul(L, a));
  M = m2;
}

// rows 0 .. n of M and L joined with their blocks' mb and lb (ab_weights_v), a and c out
inline void ab_weights_rows(float* M, float* L, const float* mb, const float* lb, float* a,
                            float* c, int64_t n) {
  for (int64_t r = 0; r < n; r += 16) {
    const M16 in = lane_mask(n - r);
    V16 m = vmaskz_load(in, M + r), l = vmaskz_load(in, L + r), av, cv;
    ab_weights_v(m, l, vmask_load(vset1(-INFINITY), in, mb + r), vmaskz_load(in, lb + r), av, cv);
    vmask_store(M + r, in, m);
    vmask_store(L + r, in, l);
    vmask_store(a + r, in, av);
    vmask_store(c + r, in, cv);
  }
}

inline V16 ab_mix(V16 o, V16 ob, V16 a, V16 c) { return vfmadd(ob, c, vmul(o, a)); }

// a visible block's output ob [D] into one row's O [D]: lane 0 of ab_weights_v (every lane
// the same), so the row has the bits the rows' form gives it
inline void ab_join(float& M, float& L, float* O, int64_t D, float mb, float lb,
                    const float* ob) {
  V16 m = vset1(M), l = vset1(L), av, cv;
  ab_weights_v(m, l, vset1(mb), vset1(lb), av, cv);
  M = vfirst(m), L = vfirst(l);
  for (int64_t d = 0; d < D; d += 16) vstore(O + d, ab_mix(vload(O + d), vload(ob + d), av, cv));
}

// the row's output: O / L into dst (may be O)
inline void ab_finish(const float* O, int64_t D, float L, float* dst) {
  const V16 inv = vset1(1.0f / L);
  for (int64_t d = 0; d < D; d += 16) vstore(dst + d, vmul(vload(O + d), inv));
}

}  // namespace
