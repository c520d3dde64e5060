#pragma once
// The kernels' vector layer: 16 float lanes (`V16`) and 16-lane masks (`M16`), one __m512 where
// the library is built for AVX-512 (PD_ISA_AVX512), two __m256 where it is built for AVX2
// (PD_ISA_AVX2; native/__init__.py builds one library per ISA and loads the best this CPU has).
// Every operation rounds lane by lane as its AVX-512 form does, and the reductions add in
// _mm512_reduce_add_ps's order, so both libraries compute the same bits (the reciprocal in
// rcp_refined aside: AVX2's estimate has 12 bits, AVX-512's 14; one Newton step follows both).
#include <immintrin.h>

#include <cstdint>

// aten's exp for Vectorized<float> (Sleef, exported by libtorch_cpu): kernels that must equal
// an aten operator to the bit call it (elementwise.h: float32 silu)
extern "C" {
#if defined(PD_ISA_AVX512)
__m512 Sleef_expf16_u10(__m512);
#else
__m256 Sleef_expf8_u10(__m256);
#endif
}

#if !defined(PD_ISA_AVX512) && !defined(PD_ISA_AVX2)
#error "build with -DPD_ISA_AVX512 or -DPD_ISA_AVX2 (native/__init__.py does)"
#endif

namespace {

using M16 = uint16_t;  // bit i: lane i

#if defined(PD_ISA_AVX512)
constexpr const char* ISA_NAME = "avx512";

struct V16 {
  __m512 v;
};
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset1(float f) { return {_mm512_set1_ps(f)}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vmaskz_load(M16 m, const float* p) { return {_mm512_maskz_loadu_ps(m, p)}; }
inline V16 vmask_load(V16 src, M16 m, const float* p) {
  return {_mm512_mask_loadu_ps(src.v, m, p)};
}
inline void vmask_store(float* p, M16 m, V16 a) { _mm512_mask_storeu_ps(p, m, a.v); }
inline V16 vmaskz(M16 m, V16 a) { return {_mm512_maskz_mov_ps(m, a.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 vmin(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline V16 vneg(V16 a) {  // the sign bit flipped
  return {_mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(static_cast<int>(0x80000000u))))};
}
inline float vreduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float vfirst(V16 a) { return _mm512_cvtss_f32(a.v); }
inline float vreduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline M16 vlt(V16 a, V16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
inline V16 vround(V16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline V16 vscalef(V16 p, V16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }
inline V16 aten_exp(V16 a) { return {Sleef_expf16_u10(a.v)}; }
inline V16 rcp_refined(V16 d) {  // 1 / d: the estimate and one Newton step (~1 ulp)
  __m512 r = _mm512_rcp14_ps(d.v);
  return {_mm512_mul_ps(r, _mm512_fnmadd_ps(d.v, r, _mm512_set1_ps(2.0f)))};
}
// bf16 <-> float32 lanes: widen (a shift, exact), round to nearest even as c10::BFloat16 does
// (denormals kept, NaN stays NaN), and the upper halves of rounded lanes stored
inline V16 vload_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline V16 vround_bf16(V16 a) {
  const __m512i b = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
  return {_mm512_castsi512_ps(r)};
}
inline void vstore_upper_halves(uint16_t* p, V16 a) {
  const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(a.v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
}

#else  // PD_ISA_AVX2
constexpr const char* ISA_NAME = "avx2";

struct V16 {
  __m256 lo, hi;
};
// the lanes of a 16-bit mask as two 8-lane all-ones / zero masks
inline __m256i mask8(unsigned bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_set1_epi32(static_cast<int>(bits & 0xFF));
  return _mm256_cmpeq_epi32(_mm256_and_si256(b, sel), sel);
}
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 vmaskz_load(M16 m, const float* p) {
  return {_mm256_maskload_ps(p, mask8(m)), _mm256_maskload_ps(p + 8, mask8(m >> 8))};
}
inline V16 vmask_load(V16 src, M16 m, const float* p) {
  const __m256i a = mask8(m), b = mask8(m >> 8);
  return {_mm256_blendv_ps(src.lo, _mm256_maskload_ps(p, a), _mm256_castsi256_ps(a)),
          _mm256_blendv_ps(src.hi, _mm256_maskload_ps(p + 8, b), _mm256_castsi256_ps(b))};
}
inline void vmask_store(float* p, M16 m, V16 a) {
  _mm256_maskstore_ps(p, mask8(m), a.lo);
  _mm256_maskstore_ps(p + 8, mask8(m >> 8), a.hi);
}
inline V16 vmaskz(M16 m, V16 a) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(mask8(m))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(mask8(m >> 8)))};
}
#define PD_V2(name, f) \
  inline V16 name(V16 a, V16 b) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }
PD_V2(vadd, _mm256_add_ps)
PD_V2(vsub, _mm256_sub_ps)
PD_V2(vmul, _mm256_mul_ps)
PD_V2(vdiv, _mm256_div_ps)
PD_V2(vmax, _mm256_max_ps)
PD_V2(vmin, _mm256_min_ps)
#undef PD_V2
inline V16 vfmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 vfnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 vneg(V16 a) {
  const __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  return {_mm256_xor_ps(a.lo, s), _mm256_xor_ps(a.hi, s)};
}
inline float vfirst(V16 a) { return _mm256_cvtss_f32(a.lo); }
// _mm512_reduce_add_ps's order: the 256-bit halves, the 128-bit halves, then pairs
inline float vreduce_add(V16 a) {
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
}
inline float vreduce_max(V16 a) {
  const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  const float a0 = _mm_cvtss_f32(t8), a1 = _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
  return a0 > a1 ? a0 : a1;
}
inline M16 vlt(V16 a, V16 b) {
  const unsigned lo = _mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ));
  const unsigned hi = _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ));
  return static_cast<M16>(lo | (hi << 8));
}
inline V16 vround(V16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// p * 2^n for integral n in [-126, 127] (exp_ps's range): the power built in the exponent field,
// one multiply (rounds as vscalef does)
inline __m256 scalef8(__m256 p, __m256 n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline V16 vscalef(V16 p, V16 n) { return {scalef8(p.lo, n.lo), scalef8(p.hi, n.hi)}; }
inline V16 aten_exp(V16 a) { return {Sleef_expf8_u10(a.lo), Sleef_expf8_u10(a.hi)}; }
inline V16 rcp_refined(V16 d) {
  const __m256 two = _mm256_set1_ps(2.0f);
  const __m256 a = _mm256_rcp_ps(d.lo), b = _mm256_rcp_ps(d.hi);
  return {_mm256_mul_ps(a, _mm256_fnmadd_ps(d.lo, a, two)),
          _mm256_mul_ps(b, _mm256_fnmadd_ps(d.hi, b, two))};
}
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V16 vload_bf16(const uint16_t* p) { return {widen8(p), widen8(p + 8)}; }
inline __m256 round8(__m256 a) {
  const __m256i b = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}
inline V16 vround_bf16(V16 a) { return {round8(a.lo), round8(a.hi)}; }
inline void upper8(uint16_t* p, __m256 a) {
  const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(a), 16);
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), w);
}
inline void vstore_upper_halves(uint16_t* p, V16 a) {
  upper8(p, a.lo);
  upper8(p + 8, a.hi);
}
#endif

// exp of 16 floats: a degree-6 polynomial on the reduced argument (relative error ~2e-7); below
// -87 it is exactly 0 (masked scores weigh nothing)
// HI: clamp above (x > 88); exp_ps_le0 leaves it out for x <= 0 (or -inf), the same bits there
template <bool HI = true>
inline V16 exp_ps_t(V16 x) {
  const V16 lo = vset1(-87.0f);
  const M16 dead = vlt(x, lo);
  x = vmax(x, lo);
  if constexpr (HI) x = vmin(x, vset1(88.0f));
  const V16 n = vround(vmul(x, vset1(1.44269504088896341f)));
  V16 r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  V16 p = vset1(1.0f / 720);
  p = vfmadd(p, r, vset1(1.0f / 120));
  p = vfmadd(p, r, vset1(1.0f / 24));
  p = vfmadd(p, r, vset1(1.0f / 6));
  p = vfmadd(p, r, vset1(0.5f));
  p = vfmadd(p, r, vset1(1.0f));
  p = vfmadd(p, r, vset1(1.0f));
  return vmaskz(static_cast<M16>(~dead), vscalef(p, n));
}
inline V16 exp_ps(V16 x) { return exp_ps_t<true>(x); }
inline V16 exp_ps_le0(V16 x) { return exp_ps_t<false>(x); }

}  // namespace
