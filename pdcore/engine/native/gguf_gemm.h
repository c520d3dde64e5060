#pragma once
// GEMMs over GGUF weights kept packed (engine/model/gguf_packed.py): y[M, N] = x[M, K] W[N, K]^T
// where W's rows are GGUF blocks as the file stores them (ggml's layouts): Q8_0, Q4_0, Q4_1 (32
// weights a block) and Q4_K, Q6_K (256 a block). The weight arrives as a uint8 tensor
// [type, N, row_bytes] whose first dimension has stride 0: its size is the ggml type number (2
// Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K), so the decode loop's GEMM (gemm.h: any_linear) tells
// it from the float layouts without another argument.
//
// The GEMM de-quantizes 4 weight rows at a time into a float buffer (L1) and takes their dot
// products with every row of x (a decode step: the weights stream from memory once, at their
// packed size, Q4_1: 5 bits a weight against float32's 32; a prefill: once per 64 rows of x).
// Each weight is computed as the `gguf` package computes it (float32: d * q, d * q + m, (d * sc) * q - dmin * m), so the
// weights are those of the de-quantized model to the bit; the sums run in another order than
// oneDNN's (float32 rounding differs, not the weights), the same for every row count.
#include "common.h"

#include <c10/util/Half.h>

namespace {

constexpr int64_t GGUF_ROW_BLOCK = 64;  // rows of x a pass over the weight runs against
constexpr int64_t GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q6_K = 14;

// weights a block holds and the block's bytes; {0, 0} for a type these kernels do not read
struct GgufBlock {
  int64_t weights, bytes;
};
inline GgufBlock gguf_block(int64_t type) {
  switch (type) {
    case GGML_Q4_0: return {32, 18};
    case GGML_Q4_1: return {32, 20};
    case GGML_Q8_0: return {32, 34};
    case GGML_Q4_K: return {256, 144};
    case GGML_Q6_K: return {256, 210};
    default: return {0, 0};
  }
}

inline float gguf_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// 16 bytes as 16 float lanes: unsigned (`vu8`) or signed (`vi8`); `lo4` / `hi4`: the low / high
// nibbles of each byte
#if defined(PD_ISA_AVX512)
inline V16 vu8(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))}; }
inline V16 vi8(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))}; }
#else
inline V16 vu8(__m128i q) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))};
}
inline V16 vi8(__m128i q) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}
#endif
inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline __m128i lo4(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(0x0F)); }
inline __m128i hi4(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)); }

// one row's `nb` blocks into y (nb * block weights floats), each weight rounded as the `gguf`
// package computes it (a product and a sum rounded apart: the build has -ffp-contract=off and
// these use no FMA)
void gguf_dequant_q8_0(const uint8_t* s, int64_t nb, float* y) {
  for (int64_t b = 0; b < nb; ++b, s += 34, y += 32) {
    const V16 d = vset1(gguf_half(s));
    vstore(y, vmul(d, vi8(load16(s + 2))));
    vstore(y + 16, vmul(d, vi8(load16(s + 18))));
  }
}

void gguf_dequant_q4_0(const uint8_t* s, int64_t nb, float* y) {
  const V16 eight = vset1(8.0f);
  for (int64_t b = 0; b < nb; ++b, s += 18, y += 32) {
    const V16 d = vset1(gguf_half(s));
    const __m128i q = load16(s + 2);
    vstore(y, vmul(d, vsub(vu8(lo4(q)), eight)));
    vstore(y + 16, vmul(d, vsub(vu8(hi4(q)), eight)));
  }
}

void gguf_dequant_q4_1(const uint8_t* s, int64_t nb, float* y) {
  for (int64_t b = 0; b < nb; ++b, s += 20, y += 32) {
    const V16 d = vset1(gguf_half(s)), m = vset1(gguf_half(s + 2));
    const __m128i q = load16(s + 4);
    vstore(y, vadd(vmul(d, vu8(lo4(q))), m));
    vstore(y + 16, vadd(vmul(d, vu8(hi4(q))), m));
  }
}

// Q4_K: d, dmin (f16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
// nibbles (32 bytes: sub-block 2j in the low nibbles, 2j + 1 in the high ones)
void gguf_dequant_q4_k(const uint8_t* s, int64_t nb, float* y) {
  for (int64_t b = 0; b < nb; ++b, s += 144, y += 256) {
    const float d = gguf_half(s), dmin = gguf_half(s + 2);
    const uint8_t* sc = s + 4;
    for (int j = 0; j < 8; ++j) {
      int scale, mn;
      if (j < 4) {
        scale = sc[j] & 63;
        mn = sc[j + 4] & 63;
      } else {
        scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
        mn = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
      }
      const V16 ds = vset1(d * static_cast<float>(scale));
      const V16 dm = vset1(dmin * static_cast<float>(mn));
      const uint8_t* qj = s + 16 + (j / 2) * 32;
      for (int h = 0; h < 2; ++h) {
        const __m128i q = load16(qj + 16 * h);
        vstore(y + j * 32 + 16 * h, vsub(vmul(ds, vu8(j % 2 ? hi4(q) : lo4(q))), dm));
      }
    }
  }
}

// Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 weights), d
// (f16). In each half of 128 weights, group g of 32 takes the low (g < 2) or high nibbles of
// ql[32 (g % 2) :][:32] and bits 2g, 2g + 1 of qh[:32]
void gguf_dequant_q6_k(const uint8_t* s, int64_t nb, float* y) {
  const V16 off = vset1(32.0f);
  const __m128i three = _mm_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b, s += 210, y += 256) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(s + 192);
    const float d = gguf_half(s + 208);
    for (int h = 0; h < 2; ++h) {
      for (int g = 0; g < 4; ++g) {
        for (int u = 0; u < 2; ++u) {  // 16 weights: one scale
          const __m128i l = load16(s + h * 64 + (g % 2) * 32 + u * 16);
          const __m128i lq = g < 2 ? lo4(l) : hi4(l);
          __m128i hq = load16(s + 128 + h * 32 + u * 16);
          // (qh >> 2g) & 3, moved to bits 4-5; 16-bit shifts, then masked per byte
          hq = _mm_and_si128(_mm_srl_epi16(hq, _mm_cvtsi32_si128(2 * g)), three);
          const __m128i q = _mm_or_si128(lq, _mm_slli_epi16(hq, 4));
          const int at = h * 128 + g * 32 + u * 16;
          const V16 ds = vset1(d * static_cast<float>(sc[at / 16]));
          vstore(y + at, vmul(ds, vsub(vu8(q), off)));
        }
      }
    }
  }
}

using GgufDequantFn = void (*)(const uint8_t*, int64_t, float*);
inline GgufDequantFn gguf_dequant_fn(int64_t type) {
  switch (type) {
    case GGML_Q4_0: return gguf_dequant_q4_0;
    case GGML_Q4_1: return gguf_dequant_q4_1;
    case GGML_Q8_0: return gguf_dequant_q8_0;
    case GGML_Q4_K: return gguf_dequant_q4_k;
    case GGML_Q6_K: return gguf_dequant_q6_k;
    default: return nullptr;
  }
}

// [sum of a, sum of b, sum of c, sum of d]: each vector's lanes i and i + 8 added first, then
// pairwise (the same order on both ISAs: the same bits)
inline void vreduce4(const V16& a, const V16& b, const V16& c, const V16& d, float* out) {
#if defined(PD_ISA_AVX512)
  auto half = [](const V16& v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v.v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v.v), 1)));
  };
#else
  auto half = [](const V16& v) { return _mm256_add_ps(v.lo, v.hi); };
#endif
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)),
                                  _mm256_hadd_ps(half(c), half(d)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// MT rows of x (row-major, K apart) against 4 de-quantized weight rows w (K apart): y[m, 0:nn]
template <int MT>
void gguf_tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy, int64_t nn,
               const float* b) {
  V16 acc[MT][4];
  PD_UNROLL for (int m = 0; m < MT; ++m) {
    PD_UNROLL for (int j = 0; j < 4; ++j) acc[m][j] = vzero();
  }
  for (int64_t k = 0; k < K; k += 16) {
    const V16 w0 = vload(w + k), w1 = vload(w + K + k), w2 = vload(w + 2 * K + k),
              w3 = vload(w + 3 * K + k);
    PD_UNROLL for (int m = 0; m < MT; ++m) {
      const V16 xv = vload(x + m * K + k);
      acc[m][0] = vfmadd(xv, w0, acc[m][0]);
      acc[m][1] = vfmadd(xv, w1, acc[m][1]);
      acc[m][2] = vfmadd(xv, w2, acc[m][2]);
      acc[m][3] = vfmadd(xv, w3, acc[m][3]);
    }
  }
  PD_UNROLL for (int m = 0; m < MT; ++m) {
    float sums[4];
    vreduce4(acc[m][0], acc[m][1], acc[m][2], acc[m][3], sums);
    for (int j = 0; j < nn; ++j) y[m * ldy + j] = sums[j] + (b ? b[j] : 0.0f);
  }
}
using GgufTileFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t,
                            const float*);
const GgufTileFn GGUF_TILES[4] = {gguf_tile<1>, gguf_tile<2>, gguf_tile<3>, gguf_tile<4>};

// the typed weight's (type, N, row bytes, K), checked
struct GgufWeight {
  int64_t type, N, row_bytes, K;
  GgufDequantFn fn;
  const uint8_t* data;
};
GgufWeight gguf_weight(const Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.stride(0) == 0 &&
                  w.stride(2) == 1 && w.stride(1) == w.size(2),
              "a GGUF weight is uint8 [type, N, row_bytes] with the type dimension of stride 0");
  GgufWeight g{w.size(0), w.size(1), w.size(2), 0, gguf_dequant_fn(w.size(0)),
               w.data_ptr<uint8_t>()};
  const GgufBlock blk = gguf_block(g.type);
  TORCH_CHECK(g.fn != nullptr, "GGML type ", g.type, " has no packed kernel");
  TORCH_CHECK(g.row_bytes % blk.bytes == 0, "row of ", g.row_bytes, " bytes is not whole blocks");
  g.K = g.row_bytes / blk.bytes * blk.weights;
  return g;
}

// rows `ids` of the weight de-quantized: float32 [R, K] (an embedding's lookup; tests)
Tensor gguf_rows(const Tensor& w, const Tensor& ids_in) {
  const GgufWeight g = gguf_weight(w);
  const Tensor ids = ids_in.reshape({-1}).to(at::kLong).contiguous();
  const int64_t R = ids.numel(), nb = g.K / gguf_block(g.type).weights;
  Tensor y = at::empty({R, g.K}, at::kFloat);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < g.N, "row ", ip[r], " outside [0, ", g.N, ")");
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) g.fn(g.data + ip[r] * g.row_bytes, nb, yp + r * g.K);
  });
  return y;
}

// x [..., K] (float32; other dtypes are computed in float32 and returned in theirs), the typed
// weight [type, N, row_bytes], b [N] or empty
Tensor gguf_linear(const Tensor& x_in, const Tensor& w, int64_t N,
                   const std::optional<Tensor>& b) {
  const GgufWeight g = gguf_weight(w);
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(g.K == K && g.N == N, "GGUF weight [", g.N, ", ", g.K, "] does not match the input (",
              K, " features) and ", N, " outputs");
  Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0), nb = K / gguf_block(g.type).weights;
  Tensor y = at::empty({M, N}, x.options());
  Tensor bc;
  const float* bp = nullptr;
  if (b.has_value() && b->defined() && b->numel() > 0) {
    bc = b->to(at::kFloat).contiguous();
    bp = bc.data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // blocks of up to GGUF_ROW_BLOCK rows of x (in L2); in each, 4 weight rows at a time are
  // de-quantized once (zeros past N) and run against every row of the block in tiles of 4.
  // Each output is summed in the same order whatever M is: a row's result does not depend on
  // the batch it came in (decode and prefill give the same bits, as the float32 panels do)
  for (int64_t m0 = 0; m0 < M; m0 += GGUF_ROW_BLOCK) {
    const int64_t mb = std::min(GGUF_ROW_BLOCK, M - m0);
    at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t q0, int64_t q1) {
      std::vector<float> buf(4 * K, 0.0f);
      float* wr = buf.data();
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t n = 4 * q, nn = std::min<int64_t>(4, N - n);
        for (int64_t j = 0; j < nn; ++j) g.fn(g.data + (n + j) * g.row_bytes, nb, wr + j * K);
        for (int64_t m = m0; m < m0 + mb; m += 4) {
          const int64_t mt = std::min<int64_t>(4, m0 + mb - m);
          GGUF_TILES[mt - 1](xp + m * K, K, wr, yp + m * N + n, N, nn, bp ? bp + n : nullptr);
        }
      }
    });
  }
  if (x_in.scalar_type() != at::kFloat) y = y.to(x_in.scalar_type());
  if (x_in.dim() == 2) return y;
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace
