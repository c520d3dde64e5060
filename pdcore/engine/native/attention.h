#pragma once
#include "common.h"

namespace {

// ---- decode attention: q [B, KVH, G, D] against k, v [B, KVH, W, D] (+ bias [B, 1, 1, W]) ----
// One query token per sequence, the G query heads of a KV head together: per (sequence, KV
// head) the scores of every key against the G queries (one pass over K), a softmax per query,
// then one pass over V. CPU SDPA took 145-200 us a layer for SmolLM2 at batch 8 (~150-token
// contexts); this runs in a fraction of it (the closing notes of #21 have the numbers). -inf
// scores (masked positions) weigh exactly 0 (exp_ps, common.h).

// kernels for head_dim 32 / 64 / 128 / 256 and 1-8 query heads per KV head; SDPA otherwise

template <int DV, int G>
__attribute__((target("avx512f"))) void attend_one(
    const float* q, const float* k, int64_t ksw, const float* v, int64_t vsw,
    const float* bias, int64_t W, float scale, float* out, float* scores) {
  // scores[g * W + w]: KB keys at a time against the G queries (KB x G independent sums)
  constexpr int KB = G <= 4 ? 4 : 2;
  int64_t w = 0;
  for (; w + KB <= W; w += KB) {
    __m512 acc[KB][G];
    PD_UNROLL for (int j = 0; j < KB; ++j)
      PD_UNROLL for (int g = 0; g < G; ++g) acc[j][g] = _mm512_setzero_ps();
    PD_UNROLL for (int d = 0; d < DV; ++d) {
      PD_UNROLL for (int j = 0; j < KB; ++j) {
        const __m512 kv = _mm512_loadu_ps(k + (w + j) * ksw + d * 16);
        PD_UNROLL for (int g = 0; g < G; ++g)
          acc[j][g] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q + (g * DV + d) * 16), acc[j][g]);
      }
    }
    PD_UNROLL for (int j = 0; j < KB; ++j) {
      const float add = bias ? bias[w + j] : 0.0f;
      PD_UNROLL for (int g = 0; g < G; ++g)
        scores[g * W + w + j] = _mm512_reduce_add_ps(acc[j][g]) * scale + add;
    }
  }
  for (; w < W; ++w) {
    __m512 acc[G];
    PD_UNROLL for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    PD_UNROLL for (int d = 0; d < DV; ++d) {
      const __m512 kv = _mm512_loadu_ps(k + w * ksw + d * 16);
      PD_UNROLL for (int g = 0; g < G; ++g)
        acc[g] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q + (g * DV + d) * 16), acc[g]);
    }
    const float add = bias ? bias[w] : 0.0f;
    PD_UNROLL for (int g = 0; g < G; ++g)
      scores[g * W + w] = _mm512_reduce_add_ps(acc[g]) * scale + add;
  }
  const int64_t wfull = W & ~int64_t(15);
  const __mmask16 tail = static_cast<__mmask16>((1u << (W - wfull)) - 1u);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * W;
    __m512 mx = ninf;
    for (int64_t i = 0; i < wfull; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
    if (tail) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, tail, s + wfull));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < wfull; i += 16) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
      _mm512_storeu_ps(s + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 e = _mm512_maskz_mov_ps(
          tail, exp_ps(_mm512_sub_ps(_mm512_mask_loadu_ps(ninf, tail, s + wfull), m)));
      _mm512_mask_storeu_ps(s + wfull, tail, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t i = 0; i < wfull; i += 16)
      _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
    if (tail)
      _mm512_mask_storeu_ps(s + wfull, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + wfull), inv));
  }
  __m512 acc[G][DV];
  PD_UNROLL for (int g = 0; g < G; ++g)
    PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = _mm512_setzero_ps();
  for (int64_t i = 0; i < W; ++i) {
    __m512 vr[DV];
    PD_UNROLL for (int d = 0; d < DV; ++d) vr[d] = _mm512_loadu_ps(v + i * vsw + d * 16);
    PD_UNROLL for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * W + i]);
      PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = _mm512_fmadd_ps(vr[d], p, acc[g][d]);
    }
  }
  PD_UNROLL for (int g = 0; g < G; ++g)
    PD_UNROLL for (int d = 0; d < DV; ++d) _mm512_storeu_ps(out + (g * DV + d) * 16, acc[g][d]);
}

using AttendFn = void (*)(const float*, const float*, int64_t, const float*, int64_t,
                          const float*, int64_t, float, float*, float*);

template <int DV>
AttendFn attend_g(int64_t G) {
  switch (G) {
    case 1: return attend_one<DV, 1>;
    case 2: return attend_one<DV, 2>;
    case 3: return attend_one<DV, 3>;
    case 4: return attend_one<DV, 4>;
    case 5: return attend_one<DV, 5>;
    case 6: return attend_one<DV, 6>;
    case 7: return attend_one<DV, 7>;
    case 8: return attend_one<DV, 8>;
    default: return nullptr;
  }
}

AttendFn attend_for(int64_t D, int64_t G) {
  switch (D) {
    case 32: return attend_g<2>(G);
    case 64: return attend_g<4>(G);
    case 128: return attend_g<8>(G);
    case 256: return attend_g<16>(G);
    default: return nullptr;
  }
}

Tensor decode_attention(const Tensor& q_in, const Tensor& k, const Tensor& v,
                        const std::optional<Tensor>& bias_in, double scale) {
  const int64_t B = q_in.size(0), H = q_in.size(1), G = q_in.size(2), D = q_in.size(3);
  const int64_t W = k.size(2);
  const AttendFn fn = attend_for(D, G);
  const bool ok = fn != nullptr && panel_gemm_supported() &&
                  q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && k.stride(3) == 1 && v.stride(3) == 1 &&
                  k.size(0) == B && k.size(1) == H && v.sizes() == k.sizes() && W > 0 &&
                  (!bias_in.has_value() ||
                   (bias_in->scalar_type() == at::kFloat && bias_in->numel() == B * W));
  if (!ok)
    return at::scaled_dot_product_attention(q_in, k, v, bias_in, 0.0, false, scale);
  Tensor q = q_in.contiguous();
  Tensor bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  Tensor out = at::empty({B, H, G, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ksb = k.stride(0), ksh = k.stride(1), ksw = k.stride(2);
  const int64_t vsb = v.stride(0), vsh = v.stride(1), vsw = v.stride(2);
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(G * W);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      fn(qp + i * G * D, kp + b * ksb + h * ksh, ksw, vp + b * vsb + h * vsh, vsw,
         bp ? bp + b * W : nullptr, W, static_cast<float>(scale), op + i * G * D,
         scores.data());
    }
  });
  return out;
}

}  // namespace
