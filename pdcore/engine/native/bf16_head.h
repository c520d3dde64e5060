#pragma once
// A float32 model's lm_head over bf16 weights with bf16 dot products (AVX-512 BF16): a W8A8
// model's head (PDCORE_W8A8_LM_HEAD=bf16_dot, loader.bf16_dot_lm_head), float32 logits out.
//
// The float32 panel GEMM (gemm.h) on bf16 weight panels widens each weight and multiplies
// float32 x: at 8 rows of SmolLM2's tied 49152 x 576 head that is 14.2M 512-bit FMAs, more
// time than streaming its 57 MB (FMA-bound). Here x is rounded to bf16 (to nearest even, as
// torch's .bfloat16()) and the weights sit in pair panels ([ceil(N / 32), K / 2, 32, 2],
// layers.pack_panels_bf16, as the bf16 GEMM's): one vdpbf16ps multiplies 16 outputs' weights
// for k and k + 1 by the broadcast pair (x[m, k], x[m, k + 1]) and adds both products to a
// float32 accumulator, half the instructions of the widening kernel. Unlike linear_bf16 (whose
// output is a bf16 model's activations, rounded to bf16), the logits stay float32: sampling at
// temperature 1 reads them as they are.
// Each output is one accumulator summed over the pairs in k order, whatever the row count or
// the thread count: a row's logits have the same bits alone, in a batch or in a prefill.
#include "gemm.h"

namespace {

#if defined(PD_ISA_AVX512)
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void head_tile_bf16(
    const uint16_t* x, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t n0,
    const float* b) {
  __m512 acc[MB][2];
  pair_dots<MB>(x, K, w, acc);  // gemm.h: the pairs in k order, 128 bytes of the panel a pair
  const __mmask16 m0 = lane_mask(N - n0), m1 = lane_mask(N - n0 - 16);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (b) {
    b0 = _mm512_maskz_loadu_ps(m0, b + n0);
    b1 = _mm512_maskz_loadu_ps(m1, b + n0 + 16);
  }
  PD_UNROLL for (int m = 0; m < MB; ++m) {
    _mm512_mask_storeu_ps(y + m * N + n0, m0, _mm512_add_ps(acc[m][0], b0));
    _mm512_mask_storeu_ps(y + m * N + n0 + 16, m1, _mm512_add_ps(acc[m][1], b1));
  }
}

using HeadTileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, float*, int64_t, int64_t,
                            const float*);
const HeadTileFn HEAD_TILES[TILE] = {
    head_tile_bf16<1>, head_tile_bf16<2>, head_tile_bf16<3>,  head_tile_bf16<4>,
    head_tile_bf16<5>, head_tile_bf16<6>, head_tile_bf16<7>,  head_tile_bf16<8>,
    head_tile_bf16<9>, head_tile_bf16<10>, head_tile_bf16<11>, head_tile_bf16<12>};
#endif

// x [..., K] float32 (rounded to bf16 here) or bf16, panels [ceil(N / 32), K / 2, 32, 2] bf16,
// b [N] or empty: y [..., N] float32
Tensor panel_linear_bf16_f32(const Tensor& x_in, const Tensor& panels, int64_t N,
                             const std::optional<Tensor>& b) {
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(bf16_gemm_supported(), "the bf16 dot-product head needs AVX-512 BF16");
  TORCH_CHECK((x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) &&
                  panels.scalar_type() == at::kBFloat16,
              "the bf16 dot-product head takes float32 or bf16 x and bf16 panels");
  TORCH_CHECK(panels.dim() == 4 && panels.size(1) * 2 == K && panels.size(2) == PANEL &&
                  panels.size(3) == 2 && panels.size(0) * PANEL >= N && panels.is_contiguous(),
              "panels do not match the input");
  // round to nearest even (NaN stays NaN): torch's conversion, the reference's
  Tensor x = x_in.reshape({-1, K}).to(at::kBFloat16).contiguous();
  const int64_t M = x.size(0), P = panels.size(0);
  Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  Tensor bc;
  const float* bp = nullptr;
  if (b.has_value() && b->defined() && b->numel() > 0) {
    TORCH_CHECK(b->numel() == N, "the bias does not match the panels");
    bc = b->to(at::kFloat).contiguous();
    bp = bc.data_ptr<float>();
  }
#if defined(PD_ISA_AVX512)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  float* yp = y.data_ptr<float>();
  for_tiles(Tiling(M), P, [&](int64_t m, int64_t rows, int64_t p) {
    HEAD_TILES[rows - 1](xp + m * K, K, wp + p * K * PANEL, yp + m * N, N, p * PANEL, bp);
  });
#endif
  return with_lead(y, x_in);
}

}  // namespace
