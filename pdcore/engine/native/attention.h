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
void attend_one(
    const float* q, const float* k, int64_t ksw, const float* v, int64_t vsw,
    const float* bias, int64_t W, float scale, float* out, float* scores) {
  // scores[g * W + w]: KB keys at a time against the G queries (KB x G independent sums)
  constexpr int KB = G <= 4 ? 4 : 2;
  int64_t w = 0;
  for (; w + KB <= W; w += KB) {
    V16 acc[KB][G];
    PD_UNROLL for (int j = 0; j < KB; ++j)
      PD_UNROLL for (int g = 0; g < G; ++g) acc[j][g] = vzero();
    PD_UNROLL for (int d = 0; d < DV; ++d) {
      PD_UNROLL for (int j = 0; j < KB; ++j) {
        const V16 kv = vload(k + (w + j) * ksw + d * 16);
        PD_UNROLL for (int g = 0; g < G; ++g)
          acc[j][g] = vfmadd(kv, vload(q + (g * DV + d) * 16), acc[j][g]);
      }
    }
    PD_UNROLL for (int j = 0; j < KB; ++j) {
      const float add = bias ? bias[w + j] : 0.0f;
      PD_UNROLL for (int g = 0; g < G; ++g)
        scores[g * W + w + j] = vreduce_add(acc[j][g]) * scale + add;
    }
  }
  for (; w < W; ++w) {
    V16 acc[G];
    PD_UNROLL for (int g = 0; g < G; ++g) acc[g] = vzero();
    PD_UNROLL for (int d = 0; d < DV; ++d) {
      const V16 kv = vload(k + w * ksw + d * 16);
      PD_UNROLL for (int g = 0; g < G; ++g)
        acc[g] = vfmadd(kv, vload(q + (g * DV + d) * 16), acc[g]);
    }
    const float add = bias ? bias[w] : 0.0f;
    PD_UNROLL for (int g = 0; g < G; ++g)
      scores[g * W + w] = vreduce_add(acc[g]) * scale + add;
  }
  const int64_t wfull = W & ~int64_t(15);
  const M16 tail = static_cast<M16>((1u << (W - wfull)) - 1u);
  const V16 ninf = vset1(-INFINITY);
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * W;
    V16 mx = ninf;
    for (int64_t i = 0; i < wfull; i += 16) mx = vmax(mx, vload(s + i));
    if (tail) mx = vmax(mx, vmask_load(ninf, tail, s + wfull));
    const V16 m = vset1(vreduce_max(mx));
    V16 sum = vzero();
    for (int64_t i = 0; i < wfull; i += 16) {
      const V16 e = exp_ps(vsub(vload(s + i), m));
      vstore(s + i, e);
      sum = vadd(sum, e);
    }
    if (tail) {
      const V16 e = vmaskz(
          tail, exp_ps(vsub(vmask_load(ninf, tail, s + wfull), m)));
      vmask_store(s + wfull, tail, e);
      sum = vadd(sum, e);
    }
    const V16 inv = vset1(1.0f / vreduce_add(sum));
    for (int64_t i = 0; i < wfull; i += 16)
      vstore(s + i, vmul(vload(s + i), inv));
    if (tail)
      vmask_store(s + wfull, tail, vmul(vmaskz_load(tail, s + wfull), inv));
  }
  V16 acc[G][DV];
  PD_UNROLL for (int g = 0; g < G; ++g)
    PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = vzero();
  for (int64_t i = 0; i < W; ++i) {
    V16 vr[DV];
    PD_UNROLL for (int d = 0; d < DV; ++d) vr[d] = vload(v + i * vsw + d * 16);
    PD_UNROLL for (int g = 0; g < G; ++g) {
      const V16 p = vset1(scores[g * W + i]);
      PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = vfmadd(vr[d], p, acc[g][d]);
    }
  }
  PD_UNROLL for (int g = 0; g < G; ++g)
    PD_UNROLL for (int d = 0; d < DV; ++d) vstore(out + (g * DV + d) * 16, acc[g][d]);
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
