#pragma once
// FP8 pool lanes for the paged decode kernel (attention.h's kv_load): 16 bytes widened to 16
// float lanes exactly (integer ops and one int -> float conversion, no F16C: the AVX2 library
// is built without it), then times the layer's scale: float(x) * scale, the value
// prefill_attention.h's pf_widen gives each element, so a row has the same bits in prefill
// and decode (attn_block.h). e4m3fn: bias 7, no infinities, S.1111.111 is NaN; e5m2: bias
// 15, IEEE-like (exponent 31: inf / NaN). Subnormals (exponent 0): m * 2^(1 - bias - M).
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include "common.h"

namespace {

template <int M, int BIAS>
struct Fp8Fmt {
  static constexpr int mant = M, bias = BIAS;
};
using Fp8E4M3 = Fp8Fmt<3, 7>;
using Fp8E5M2 = Fp8Fmt<2, 15>;

// 2^(1 - bias - M): a subnormal's unit
template <typename F>
constexpr float fp8_sub_unit() {
  float u = 1.0f;
  for (int i = 0; i < F::bias + F::mant - 1; ++i) u *= 0.5f;
  return u;
}

#if defined(PD_ISA_AVX512)
template <typename F>
inline __m512 fp8_widen16(const uint8_t* p) {
  const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
  const __m512i e = _mm512_srli_epi32(mag, F::mant);
  __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - F::mant),
                                  _mm512_set1_epi32((127 - F::bias) << 23));
  if constexpr (F::mant == 3) {  // e4m3fn: only S.1111.111 is NaN
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
    bits = _mm512_mask_mov_epi32(bits, nan, _mm512_set1_epi32(0x7FC00000));
  } else {  // e5m2: exponent 31 is inf (mantissa 0) or NaN
    const __mmask16 top = _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(31));
    const __m512i m = _mm512_and_si512(mag, _mm512_set1_epi32(3));
    const __m512i sp = _mm512_or_si512(_mm512_set1_epi32(0x7F800000), _mm512_slli_epi32(m, 21));
    bits = _mm512_mask_mov_epi32(bits, top, sp);
  }
  const __mmask16 sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  const __m512 sv = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(fp8_sub_unit<F>()));
  bits = _mm512_mask_mov_epi32(bits, sub, _mm512_castps_si512(sv));
  return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}
template <typename F>
inline V16 fp8_load(const uint8_t* p, float scale) {
  return {_mm512_mul_ps(fp8_widen16<F>(p), _mm512_set1_ps(scale))};
}
#else
template <typename F>
inline __m256 fp8_widen8(const uint8_t* p) {
  const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
  const __m256i e = _mm256_srli_epi32(mag, F::mant);
  __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(mag, 23 - F::mant),
                                  _mm256_set1_epi32((127 - F::bias) << 23));
  if constexpr (F::mant == 3) {
    const __m256i nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), nan);
  } else {
    const __m256i top = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(31));
    const __m256i m = _mm256_and_si256(mag, _mm256_set1_epi32(3));
    const __m256i sp = _mm256_or_si256(_mm256_set1_epi32(0x7F800000), _mm256_slli_epi32(m, 21));
    bits = _mm256_blendv_epi8(bits, sp, top);
  }
  const __m256i sub = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
  const __m256 sv = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(fp8_sub_unit<F>()));
  bits = _mm256_blendv_epi8(bits, _mm256_castps_si256(sv), sub);
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}
template <typename F>
inline V16 fp8_load(const uint8_t* p, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  return {_mm256_mul_ps(fp8_widen8<F>(p), s), _mm256_mul_ps(fp8_widen8<F>(p + 8), s)};
}
#endif

// the paged kernel's pool elements: float and bf16 (scale unused: only FP8 pools are scaled,
// as pf_widen), FP8 widened then scaled
inline V16 kv_load(const float* p, float) { return vload(p); }
inline V16 kv_load(const uint16_t* p, float) { return vload_bf16(p); }
inline V16 kv_load(const c10::Float8_e4m3fn* p, float s) {
  return fp8_load<Fp8E4M3>(reinterpret_cast<const uint8_t*>(p), s);
}
inline V16 kv_load(const c10::Float8_e5m2* p, float s) {
  return fp8_load<Fp8E5M2>(reinterpret_cast<const uint8_t*>(p), s);
}

}  // namespace
