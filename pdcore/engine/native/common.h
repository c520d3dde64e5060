#pragma once
// Shared by the native kernels' files (one translation unit: decode_step.cpp includes them all).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#include <torch/library.h>

namespace {

using at::Tensor;
using at::indexing::Slice;

bool panel_gemm_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}

#define PD_UNROLL _Pragma("GCC unroll 16")

// the first `valid` of 16 lanes (all for 16 or more, none for 0 or less): the output columns of
// a panel half that exist (the last panel's padding rows are not written)
inline __mmask16 lane_mask(int64_t valid) {
  return static_cast<__mmask16>(valid >= 16 ? 0xFFFF : valid <= 0 ? 0 : (1u << valid) - 1u);
}

// exp of 16 floats: a degree-6 polynomial on the reduced argument (relative error ~2e-7); below
// -87 it is exactly 0 (masked scores weigh nothing)
__attribute__((target("avx512f"))) inline __m512 exp_ps(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
  const __mmask16 dead = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~dead), _mm512_scalef_ps(p, n));
}

}  // namespace
