#pragma once
// float32 and bf16 GEMMs over weight panels, and oneDNN's for the weights it holds
#include "common.h"
#include "gguf_gemm.h"
#include "panel_gemm.h"

namespace {

// mkldnn::_linear_pointwise over a weight reordered once at load (models/layers.py: linear)
Tensor linear(const c10::OperatorHandle& op, const Tensor& x, const Tensor& packed,
              const std::optional<Tensor>& bias) {
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// ---- bfloat16 GEMM over weight panels (AVX-512 BF16) ----------------------------------------
// Panels of 32 output features with k in pairs: [ceil(N / 32), K / 2, 32, 2] bf16 (K even), so
// one 64-byte load holds 16 outputs x 2 k; vdpbf16ps multiplies them by the broadcast pair
// (x[m, k], x[m, k + 1]) and accumulates in float32; the output is rounded to bf16 once.
bool bf16_gemm_supported() {
#if defined(PD_ISA_AVX512)
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;  // the AVX2 library has no bf16 kernel
#endif
}

#if defined(PD_ISA_AVX512)

// acc[m][0 / 1] = the MB rows' sums over the pairs (k, k + 1) in k order, from zero, of the
// panel's 32 outputs: one vdpbf16ps per 16 outputs and pair (the bf16 GEMM's tiles and the
// bf16-dot lm_head's, bf16_head.h, share it)
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void pair_dots(
    const uint16_t* x, int64_t K, const uint16_t* w, __m512 (&acc)[MB][2]) {
  PD_UNROLL for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 2 * PD_PF) * PANEL), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 2 * PD_PF) * PANEL + 32), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k * PANEL);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k * PANEL + 32);
    PD_UNROLL for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + k, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xv);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xv);
    }
  }
}

template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void panel_tile_bf16(
    const uint16_t* x, int64_t K, const uint16_t* w, uint16_t* y, int64_t N, int64_t n0,
    const uint16_t* b) {
  __m512 acc[MB][2];
  pair_dots<MB>(x, K, w, acc);
  const __mmask16 m0 = lane_mask(N - n0), m1 = lane_mask(N - n0 - 16);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (b) {  // bf16 bias widened to float32 (a shift: exact)
    b0 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m0, b + n0)), 16));
    b1 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m1, b + n0 + 16)), 16));
  }
  PD_UNROLL for (int m = 0; m < MB; ++m) {
    const __m256i r0 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][0], b0));
    const __m256i r1 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][1], b1));
    _mm256_mask_storeu_epi16(y + m * N + n0, m0, r0);
    _mm256_mask_storeu_epi16(y + m * N + n0 + 16, m1, r1);
  }
}

using TileBf16Fn = void (*)(const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t,
                            int64_t, const uint16_t*);
const TileBf16Fn TILES_BF16[TILE] = {
    panel_tile_bf16<1>, panel_tile_bf16<2>, panel_tile_bf16<3>, panel_tile_bf16<4>,
    panel_tile_bf16<5>, panel_tile_bf16<6>, panel_tile_bf16<7>, panel_tile_bf16<8>,
    panel_tile_bf16<9>, panel_tile_bf16<10>, panel_tile_bf16<11>, panel_tile_bf16<12>};
#endif

// x [..., K] bf16, panels [ceil(N / 32), K / 2, 32, 2] bf16, b [N] bf16 or empty
Tensor panel_linear_bf16(const Tensor& x_in, const Tensor& panels, int64_t N,
                         const std::optional<Tensor>& b) {
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(bf16_gemm_supported(), "the bf16 panel GEMM needs AVX-512 BF16");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16,
              "the bf16 panel GEMM takes bfloat16");
  TORCH_CHECK(panels.dim() == 4 && panels.size(1) * 2 == K && panels.size(2) == PANEL &&
                  panels.size(3) == 2 && panels.size(0) * PANEL >= N && panels.is_contiguous(),
              "panels do not match the input");
  Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), P = panels.size(0);
  Tensor y = at::empty({M, N}, x.options());
  Tensor bc;
  const uint16_t* bp = nullptr;
  if (b.has_value() && b->defined() && b->numel() > 0) {
    bc = b->to(at::kBFloat16).contiguous();
    bp = reinterpret_cast<const uint16_t*>(bc.data_ptr());
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
#if defined(PD_ISA_AVX512)
  for_tiles(Tiling(M), P, [&](int64_t m, int64_t rows, int64_t p) {
    TILES_BF16[rows - 1](xp + m * K, K, wp + p * K * PANEL, yp + m * N, N, p * PANEL, bp);
  });
#endif
  return with_lead(y, x_in);
}

Tensor int8_linear(const Tensor& x, const Tensor& packed, int64_t N,
                   const std::optional<Tensor>& b, int64_t path);  // int8_gemm.h

// a GEMM of the decode loop: panels (3-D), W8A8 int8 panels (int8) or oneDNN's reordered weight
Tensor any_linear(const c10::OperatorHandle& lin, const Tensor& x, const Tensor& w, int64_t N,
                  const std::optional<Tensor>& b) {
  if (w.scalar_type() == at::kByte) return gguf_linear(x, w, N, b);  // GGUF blocks (gguf_gemm.h)
  if (w.scalar_type() == at::kChar) return int8_linear(x, w, N, b, 0);
  if (w.dim() == 3) return panel_linear(x, w, N, b);
  if (w.dim() == 4) return panel_linear_bf16(x, w, N, b);
  return linear(lin, x, w, b);
}

}  // namespace
