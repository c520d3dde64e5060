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
// GGUF_X16 + a ggml type: the same blocks regrouped 16 rows at a time (gguf_x16.h)
constexpr int64_t GGUF_X16 = 64;
inline GgufBlock gguf_block(int64_t type) {
  switch (type >= GGUF_X16 ? type - GGUF_X16 : type) {
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

// the typed weight's (type, N, row bytes, K), checked; x16: regrouped (gguf_x16.h), `base`
// the ggml type of its blocks
struct GgufWeight {
  int64_t type, N, row_bytes, K;
  GgufDequantFn fn;
  const uint8_t* data;
  bool x16;
  int64_t base;
};
inline bool gguf_x16_type(int64_t base) {
  return base == GGML_Q4_0 || base == GGML_Q4_1 || base == GGML_Q8_0;
}
GgufWeight gguf_weight(const Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.stride(0) == 0 &&
                  w.stride(2) == 1 && w.stride(1) == w.size(2),
              "a GGUF weight is uint8 [type, N, row_bytes] with the type dimension of stride 0");
  const bool x16 = w.size(0) >= GGUF_X16;
  const int64_t base = x16 ? w.size(0) - GGUF_X16 : w.size(0);
  GgufWeight g{w.size(0), w.size(1), w.size(2), 0, gguf_dequant_fn(base), w.data_ptr<uint8_t>(),
               x16, base};
  const GgufBlock blk = gguf_block(g.type);
  TORCH_CHECK(g.fn != nullptr && (!x16 || gguf_x16_type(base)), "GGML type ", g.type,
              " has no packed kernel");
  TORCH_CHECK(!x16 || g.N % 16 == 0, "a 16-row GGUF weight has ", g.N, " rows");
  TORCH_CHECK(g.row_bytes % blk.bytes == 0, "row of ", g.row_bytes, " bytes is not whole blocks");
  g.K = g.row_bytes / blk.bytes * blk.weights;
  return g;
}

// row n of the 16-row layout de-quantized (gguf_x16.h)
void gx_dequant_row(const GgufWeight& g, int64_t n, float* y);

// row n de-quantized into y (K floats), as the `gguf` package computes it
inline void gguf_row(const GgufWeight& g, int64_t n, float* y) {
  if (g.x16)
    gx_dequant_row(g, n, y);
  else
    g.fn(g.data + n * g.row_bytes, g.K / gguf_block(g.type).weights, y);
}

// rows `ids` of the weight de-quantized: float32 [R, K] (an embedding's lookup; tests)
Tensor gguf_rows(const Tensor& w, const Tensor& ids_in) {
  const GgufWeight g = gguf_weight(w);
  const Tensor ids = ids_in.reshape({-1}).to(at::kLong).contiguous();
  const int64_t R = ids.numel();
  Tensor y = at::empty({R, g.K}, at::kFloat);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < g.N, "row ", ip[r], " outside [0, ", g.N, ")");
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gguf_row(g, ip[r], yp + r * g.K);
  });
  return y;
}

// y [M, N] in x's dtype and shape ([..., N])
Tensor gguf_shape(Tensor y, const Tensor& x_in, int64_t N) {
  if (x_in.scalar_type() != at::kFloat) y = y.to(x_in.scalar_type());
  if (x_in.dim() == 2) return y;
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// x [..., K] (float32; other dtypes are computed in float32 and returned in theirs), the typed
// weight [type, N, row_bytes], b [N] or empty: float activations against the de-quantized weights
Tensor gguf_linear_float(const Tensor& x_in, const Tensor& w, int64_t N,
                         const std::optional<Tensor>& b) {
  const GgufWeight g = gguf_weight(w);
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(g.K == K && g.N == N, "GGUF weight [", g.N, ", ", g.K, "] does not match the input (",
              K, " features) and ", N, " outputs");
  Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
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
        for (int64_t j = 0; j < nn; ++j) gguf_row(g, n + j, wr + j * K);
        for (int64_t m = m0; m < m0 + mb; m += 4) {
          const int64_t mt = std::min<int64_t>(4, m0 + mb - m);
          GGUF_TILES[mt - 1](xp + m * K, K, wr, yp + m * N + n, N, nn, bp ? bp + n : nullptr);
        }
      }
    });
  }
  return gguf_shape(y, x_in, N);
}


// ---- the integer-dot path -------------------------------------------------------------------
// The activations are quantized per block of 32 (each row of x on its own, like ggml's Q8
// activations): amax = max|x|, d_x = amax / 127, x_q = round_half_even(x * (127 / amax)) in
// [-127, 127] (all 0 and d_x = 0 for a block of zeros). Each weight block is read as
// w = d_w[lane] * q + m_w with q int8 (Q8_0: q; Q4_0: nibble - 8; Q4_1: nibble, m_w = m; Q4_K:
// nibble, d_w = d * sc, m_w = -dmin * mn per sub-block of 32; Q6_K: q6 - 32, d_w = d * sc per 16
// weights), d_w per lane of 4 weights. Then
//   y[m, n] = sum_b sum_lanes d_w * d_x * (exact int32 dot of the lane's 4 q and x_q)
//           + sum_b m_w[b] * (d_x[b] * sum x_q[b])  (+ bias)
// The int32 lane dots: VNNI (avx512 library on an avx512_vnni CPU) vpdpbusd of u8 (x_q + 128)
// and s8 q, started from -128 * (the lane's q sum); AVX2 vpmaddubsw of |q| and x_q with q's sign
// then vpmaddwd by 1. Both give the same integers; the float part is the same 8-lane code in
// both (even blocks in one accumulator, odd ones in another, added, then summed 4 + 4, 2 + 2,
// 1 + 1), so the two paths and both libraries give the same bits, and a row's output does not
// depend on the batch it came in. Weight rows are unpacked 4 at a time into an L1 buffer (q,
// d_w per lane, the VNNI correction, m_w) and run against up to 64 rows of x.
// Paths (gguf_linear_path's `path`): 1 AVX2 int, 2 VNNI int, 3 float activations
// (gguf_linear_float above), 0 the process default (gguf_set_path; at first the best int path).

constexpr int64_t GQ_FLOAT = 3;

bool gguf_vnni_supported() {
#if defined(PD_ISA_AVX512)
  static const bool ok = isa_supported() && __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

int64_t& gguf_default_path() {
  static int64_t path = gguf_vnni_supported() ? 2 : 1;
  return path;
}

int64_t gguf_resolve_path(int64_t path) {
  if (path == 0) path = gguf_default_path();
  TORCH_CHECK(path >= 1 && path <= 3, "GGUF GEMM path: 0 (default), 1 (avx2 integer dot), ",
              "2 (vnni integer dot) or 3 (float activations), got ", path);
  TORCH_CHECK(path != 2 || gguf_vnni_supported(),
              "the VNNI GGUF path needs the avx512 library on a CPU with avx512_vnni");
  return path;
}

// sets the path gguf_linear (and the decode loop) takes; returns the one in force
int64_t gguf_set_path(int64_t path) {
  if (path != 0) gguf_default_path() = gguf_resolve_path(path);
  return gguf_default_path();
}

// the 8 lanes summed: 4 + 4, then pairs (the same order everywhere)
inline float gq_hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(h);
}

// sum_b a[b] * c[b] over n floats: 8 lanes, then the rest one at a time (no FMA for those:
// -ffp-contract=off)
inline float gq_dot(const float* a, const float* c, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(c + i), acc);
  float s = gq_hsum8(acc);
  for (; i < n; ++i) s += a[i] * c[i];
  return s;
}

// x's rows quantized: q [M, K] (x_q, or x_q + 128 as bytes for VNNI), dl [M, K / 4] (d_x per
// lane), sx [M, K / 32] (d_x * sum x_q per block)
struct GqX {
  int8_t* q;
  float* dl;
  float* sx;
  int64_t K;
};

// one 32-value block of x to int8 (scale amax / 127, round half to even), in order: the bytes;
// d its scale, qsum the sum of its int8 values (both quantizers below share it)
static inline __m256i gq_block(const float* xb, float& d, int32_t& qsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float amax = _mm_cvtss_f32(h);
  d = amax / 127.0f;
  const __m256 vid = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i qi[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));  // round half to even
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  s4 = _mm_hadd_epi32(s4, s4);
  qsum = _mm_cvtsi128_si32(s4);
  // int32 x 32 -> int8 x 32 in order (packs work within 128-bit halves: permute back)
  const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

void gq_quantize(const float* x, int64_t M, int64_t K, bool u8, const GqX& o) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        float d;
        int32_t qsum;
        const __m256i p8 = gq_block(x + r * K + 32 * b, d, qsum);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.q + r * K + 32 * b),
                            u8 ? _mm256_xor_si256(p8, _mm256_set1_epi8(static_cast<char>(0x80))) : p8);
        _mm256_storeu_ps(o.dl + r * (K / 4) + 8 * b, _mm256_set1_ps(d));
        o.sx[r * nb + b] = d * static_cast<float>(qsum);
      }
    }
  });
}

// up to 4 weight rows unpacked (row j at j * K, j * K / 4, j * nb)
struct GqW {
  int8_t* q;
  float* dw;
  int32_t* corr;
  float* mw;
  int64_t K;
  bool has_min;
};

using GqRowsFn = void (*)(const GqX&, int64_t, const GqW&, int, float*);

inline void gq_fill8(float* p, float v) { _mm256_storeu_ps(p, _mm256_set1_ps(v)); }
inline void gq_store16(int8_t* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }

// one row's nb blocks (of its type) into q, dw, mw
void gq_unpack(int64_t type, const uint8_t* s, int64_t K, int8_t* q, float* dw, float* mw) {
  const int64_t nb = K / 32;
  const __m128i eight = _mm_set1_epi8(8);
  switch (type) {
    case GGML_Q8_0:
      for (int64_t b = 0; b < nb; ++b, s += 34) {
        std::memcpy(q + 32 * b, s + 2, 32);
        gq_fill8(dw + 8 * b, gguf_half(s));
        mw[b] = 0.0f;
      }
      return;
    case GGML_Q4_0:
    case GGML_Q4_1: {
      const bool one = type == GGML_Q4_1;
      for (int64_t b = 0; b < nb; ++b, s += one ? 20 : 18) {
        const __m128i n = load16(s + (one ? 4 : 2));
        gq_store16(q + 32 * b, one ? lo4(n) : _mm_sub_epi8(lo4(n), eight));
        gq_store16(q + 32 * b + 16, one ? hi4(n) : _mm_sub_epi8(hi4(n), eight));
        gq_fill8(dw + 8 * b, gguf_half(s));
        mw[b] = one ? gguf_half(s + 2) : 0.0f;
      }
      return;
    }
    case GGML_Q4_K:
      for (int64_t b = 0; b < nb / 8; ++b, s += 144) {
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
          const int64_t at = 8 * b + j;
          const uint8_t* qj = s + 16 + (j / 2) * 32;
          for (int h = 0; h < 2; ++h) {
            const __m128i n = load16(qj + 16 * h);
            gq_store16(q + 32 * at + 16 * h, j % 2 ? hi4(n) : lo4(n));
          }
          gq_fill8(dw + 8 * at, d * static_cast<float>(scale));
          mw[at] = -(dmin * static_cast<float>(mn));
        }
      }
      return;
    case GGML_Q6_K: {
      const __m128i three = _mm_set1_epi8(3), off = _mm_set1_epi8(32);
      for (int64_t b = 0; b < nb / 8; ++b, s += 210) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(s + 192);
        const float d = gguf_half(s + 208);
        for (int h = 0; h < 2; ++h) {
          for (int g = 0; g < 4; ++g) {
            for (int u = 0; u < 2; ++u) {
              const __m128i l = load16(s + h * 64 + (g % 2) * 32 + u * 16);
              __m128i hq = load16(s + 128 + h * 32 + u * 16);
              hq = _mm_and_si128(_mm_srl_epi16(hq, _mm_cvtsi32_si128(2 * g)), three);
              const __m128i v = _mm_or_si128(g < 2 ? lo4(l) : hi4(l), _mm_slli_epi16(hq, 4));
              const int64_t at = 256 * b + h * 128 + g * 32 + u * 16;
              gq_store16(q + at, _mm_sub_epi8(v, off));
              const __m128 ds = _mm_set1_ps(d * static_cast<float>(sc[(at % 256) / 16]));
              _mm_storeu_ps(dw + at / 4, ds);
            }
          }
        }
        for (int j = 0; j < 8; ++j) mw[8 * b + j] = 0.0f;
      }
      return;
    }
    default:
      TORCH_CHECK(false, "GGML type ", type, " has no packed kernel");
  }
}

#if defined(PD_ISA_AVX512)
#define GQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
// -128 * (the sum of each lane's 4 q): vpdpbusd's starting value
GQ_VNNI void gq_corr_vnni(const int8_t* q, int64_t K, int32_t* corr) {
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, _mm512_loadu_si512(q + k));
    _mm512_storeu_si512(corr + k / 4, _mm512_sub_epi32(_mm512_setzero_si512(), s));
  }
  if (k < K) {
    const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm512_castsi512_si256(c128),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr + k / 4),
                        _mm256_sub_epi32(_mm256_setzero_si256(), s));
  }
}

// MT rows of x (u8) against weight row j: out[m] = the scaled lane dots, summed
template <int MT>
GQ_VNNI void gq_rows_vnni(const GqX& x, int64_t m0, const GqW& w, int j, float* out) {
  const int64_t K = w.K, K4 = K / 4, nb = K / 32;
  const int8_t* q = w.q + j * K;
  const float* dw = w.dw + j * K4;
  const int32_t* corr = w.corr + j * K4;
  __m512 acc[MT];
  PD_UNROLL for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m512i wq = _mm512_loadu_si512(q + 32 * b), c = _mm512_loadu_si512(corr + 8 * b);
    const __m512 s = _mm512_loadu_ps(dw + 8 * b);
    PD_UNROLL for (int m = 0; m < MT; ++m) {
      const int64_t r = m0 + m;
      const __m512i p = _mm512_dpbusd_epi32(c, _mm512_loadu_si512(x.q + r * K + 32 * b), wq);
      const __m512 sc = _mm512_mul_ps(s, _mm512_loadu_ps(x.dl + r * K4 + 8 * b));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[m]);
    }
  }
  PD_UNROLL for (int m = 0; m < MT; ++m) {
    const int64_t r = m0 + m;
    __m256 lo = _mm512_castps512_ps256(acc[m]);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m]), 1));
    if (b < nb) {  // an odd last block: an even one
      const __m256i p = _mm256_dpbusd_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + 8 * b)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * K + 32 * b)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b)));
      const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(dw + 8 * b), _mm256_loadu_ps(x.dl + r * K4 + 8 * b));
      lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, lo);
    }
    out[m] = gq_hsum8(_mm256_add_ps(lo, hi));
  }
}
const GqRowsFn GQ_VNNI_ROWS[4] = {gq_rows_vnni<1>, gq_rows_vnni<2>, gq_rows_vnni<3>,
                                  gq_rows_vnni<4>};
#endif

// the same with AVX2 (x_q int8): even blocks in a0, odd ones in a1
template <int MT>
void gq_rows_avx2(const GqX& x, int64_t m0, const GqW& w, int j, float* out) {
  const int64_t K = w.K, K4 = K / 4, nb = K / 32;
  const int8_t* q = w.q + j * K;
  const float* dw = w.dw + j * K4;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a[2][MT];
  PD_UNROLL for (int m = 0; m < MT; ++m) a[0][m] = a[1][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
    const __m256i aw = _mm256_abs_epi8(wq);
    const __m256 s = _mm256_loadu_ps(dw + 8 * b);
    const int e = static_cast<int>(b & 1);
    PD_UNROLL for (int m = 0; m < MT; ++m) {
      const int64_t r = m0 + m;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * K + 32 * b));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wq)), ones);
      const __m256 sc = _mm256_mul_ps(s, _mm256_loadu_ps(x.dl + r * K4 + 8 * b));
      a[e][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, a[e][m]);
    }
  }
  PD_UNROLL for (int m = 0; m < MT; ++m) out[m] = gq_hsum8(_mm256_add_ps(a[0][m], a[1][m]));
}
const GqRowsFn GQ_AVX2_ROWS[4] = {gq_rows_avx2<1>, gq_rows_avx2<2>, gq_rows_avx2<3>,
                                  gq_rows_avx2<4>};

// ---- the direct integer dot (Q8_0, Q4_0, Q4_1) -----------------------------------------------
// The same math as above (per lane of 4 weights: float(int32 dot) * (d_w * d_x), fused-added
// into 8 lanes, even blocks and odd blocks apart, then 4 + 4, 2 + 2, 1 + 1), but read straight
// from the file's blocks, two at a time, without the L1 unpack: the nibbles are split in
// registers, both blocks' f16 (d, m) pairs converted with one vcvtph2ps and multiplied by the
// row of x's (d_x, d_x * sum x_q) pairs in one product: lanes 0 and 2 are the blocks' lane
// scales, lanes 1 and 3 their min terms m * d_x * sum x_q (Q4_1), summed apart and added once at
// the end. Integer dots: Q4_1 nibbles (unsigned) against x_q; Q4_0 the same plus -8 * (the
// lane's x_q sum), precomputed per row of x; Q8_0 |q| against x_q with q's sign (AVX2 maddubs)
// or x_q + 128 against q less 128 * (the lane's q sum) (VNNI). Every output is computed by the
// same code whatever the batch (row-invariant), and the AVX2 and VNNI code give the same bits.

inline bool gd_direct(int64_t type) {
  return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0;
}

// x quantized for the direct kernels: qs [M, K] x_q; qu [M, K] x_q + 128 (VNNI Q8_0); ds
// [M, 2 nb] (d_x, d_x * sum x_q) per block; c8 [M, K / 4] -8 * (each lane's x_q sum) (Q4_0)
struct GdX {
  const int8_t* qs;
  const uint8_t* qu;
  const float* ds;
  const int32_t* c8;
  int64_t K;
  const float* dl;  // [M, K / 4] d_x per lane (VNNI Q8_0 / Q4_0)
};

void gd_quantize(const float* x, int64_t M, int64_t K, int8_t* qs, uint8_t* qu, float* ds,
                 int32_t* c8, float* dl) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M, 4, [&](int64_t r0, int64_t r1) {
    const __m256i one8 = _mm256_set1_epi8(1), one16 = _mm256_set1_epi16(1);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        float d;
        int32_t qsum;
        const __m256i p8 = gq_block(x + r * K + 32 * b, d, qsum);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + r * K + 32 * b), p8);
        if (qu != nullptr)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qu + r * K + 32 * b),
                              _mm256_xor_si256(p8, _mm256_set1_epi8(static_cast<char>(0x80))));
        if (c8 != nullptr) {  // -8 * (x_q summed per 4)
          const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(one8, p8), one16);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c8 + r * (K / 4) + 8 * b),
                              _mm256_mullo_epi32(s4, _mm256_set1_epi32(-8)));
        }
        if (dl != nullptr) _mm256_storeu_ps(dl + r * (K / 4) + 8 * b, _mm256_set1_ps(d));
        ds[r * 2 * nb + 2 * b] = d;
        ds[r * 2 * nb + 2 * b + 1] = d * static_cast<float>(qsum);
      }
    }
  });
}

#define GD_F16C __attribute__((target("f16c")))

// the (f16, f16) pairs at p and p2 (a block's d and m, or d and the first quants) as float
// [d, m, d2, m2]
GD_F16C inline __m128 gd_pairs(const uint8_t* p, const uint8_t* p2) {
  int32_t a, c;
  std::memcpy(&a, p, 4);
  std::memcpy(&c, p2, 4);
  return _mm_cvtph_ps(_mm_setr_epi32(a, c, 0, 0));
}

// the 32 weights of a Q4 block (16 bytes of nibbles) in order: low nibbles, then high
inline __m256i gd_nibbles(const uint8_t* p) {
  const __m128i n = load16(p);
  return _mm256_set_m128i(hi4(n), lo4(n));
}

// AVX2: one block's 8 lane dots of weights w against x_q (int32)
template <int64_t TYPE>
inline __m256i gd_dot8(__m256i w, const int8_t* xq, const int32_t* c8) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i ones = _mm256_set1_epi16(1);
  if (TYPE == GGML_Q8_0)
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), ones);
  const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
  if (TYPE == GGML_Q4_0)
    return _mm256_add_epi32(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c8)));
  return p;
}

template <int64_t TYPE>
constexpr int64_t gd_bytes() {
  return TYPE == GGML_Q8_0 ? 34 : TYPE == GGML_Q4_1 ? 20 : 18;
}
template <int64_t TYPE>
constexpr int64_t gd_qoff() {
  return TYPE == GGML_Q4_1 ? 4 : 2;
}

template <int64_t TYPE>
inline __m256i gd_weights(const uint8_t* s) {
  if (TYPE == GGML_Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2));
  return gd_nibbles(s + gd_qoff<TYPE>());
}

// the lane scales of the pair (lanes 0, 2 of pr) as 8-lane vectors
inline __m256 gd_lo(__m128 pr) { return _mm256_broadcastss_ps(pr); }
inline __m256 gd_hi(__m128 pr) { return _mm256_broadcastss_ps(_mm_movehl_ps(pr, pr)); }

// the last (odd) block's (d_x, d_x * sum) pair as [a, b, 0, 0]
inline __m128 gd_ds_tail(const float* p) {
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
}

// finishes a row's output: 8 lanes summed, the min terms (lanes 1 and 3), the bias
inline float gd_finish(__m256 acc, __m128 mins, bool has_min, const float* b) {
  float v = gq_hsum8(acc);
  if (has_min) {
    alignas(16) float m4[4];
    _mm_store_ps(m4, mins);
    v += m4[1] + m4[3];
  }
  if (b) v += *b;
  return v;
}

// an odd last block k of weight row s against MT rows of x from m0: lo[m] += its dot, mins[m]
// += its min terms (the tail of both the AVX2 and the VNNI kernel)
template <int64_t TYPE, int MT>
GD_F16C inline void gd_tail(const uint8_t* s, int64_t nb, int64_t k, const GdX& x, int64_t m0,
                            __m256* lo, __m128* mins) {
  const int64_t K = x.K, K4 = K / 4;
  const __m128 wd = gd_pairs(s, s);
  const __m256i w0 = gd_weights<TYPE>(s);
  PD_UNROLL for (int m = 0; m < MT; ++m) {
    const int64_t r = m0 + m;
    const __m128 pr = _mm_mul_ps(wd, gd_ds_tail(x.ds + r * 2 * nb + 2 * k));
    mins[m] = _mm_add_ps(mins[m], pr);
    const int32_t* c8 = x.c8 ? x.c8 + r * K4 + 8 * k : nullptr;
    lo[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gd_dot8<TYPE>(w0, x.qs + r * K + 32 * k, c8)),
                            gd_lo(pr), lo[m]);
  }
}

// AVX2: weight row s (nb blocks) against MT rows of x from m0: y[m * ldy]
template <int64_t TYPE, int MT>
GD_F16C void gd_row_avx2(const uint8_t* s, int64_t nb, const GdX& x, int64_t m0, float* y,
                         int64_t ldy, const float* b) {
  constexpr int64_t BY = gd_bytes<TYPE>();
  const int64_t K = x.K, K4 = K / 4;
  __m256 a0[MT], a1[MT];
  __m128 mins[MT];
  PD_UNROLL for (int m = 0; m < MT; ++m) {
    a0[m] = a1[m] = _mm256_setzero_ps();
    mins[m] = _mm_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 2 <= nb; k += 2, s += 2 * BY) {
    const __m128 wd = gd_pairs(s, s + BY);
    const __m256i w0 = gd_weights<TYPE>(s), w1 = gd_weights<TYPE>(s + BY);
    PD_UNROLL for (int m = 0; m < MT; ++m) {
      const int64_t r = m0 + m;
      const __m128 pr = _mm_mul_ps(wd, _mm_loadu_ps(x.ds + r * 2 * nb + 2 * k));
      mins[m] = _mm_add_ps(mins[m], pr);
      const int8_t* xq = x.qs + r * K + 32 * k;
      const int32_t* c8 = x.c8 ? x.c8 + r * K4 + 8 * k : nullptr;
      a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gd_dot8<TYPE>(w0, xq, c8)), gd_lo(pr), a0[m]);
      a1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gd_dot8<TYPE>(w1, xq + 32, c8 ? c8 + 8 : nullptr)),
                              gd_hi(pr), a1[m]);
    }
  }
  if (k < nb) gd_tail<TYPE, MT>(s, nb, k, x, m0, a0, mins);
  PD_UNROLL for (int m = 0; m < MT; ++m)
    y[m * ldy] = gd_finish(_mm256_add_ps(a0[m], a1[m]), mins[m], TYPE == GGML_Q4_1, b);
}

#if defined(PD_ISA_AVX512)
#define GD_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")))

// two blocks' 64 weights: block k in the low 256 bits, k + 1 in the high
template <int64_t TYPE>
GD_VNNI inline __m512i gd_weights2(const uint8_t* s) {
  constexpr int64_t BY = gd_bytes<TYPE>(), QO = gd_qoff<TYPE>();
  if (TYPE == GGML_Q8_0)
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(s + QO))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + BY + QO)), 1);
  const __m256i n = _mm256_set_m128i(load16(s + BY + QO), load16(s + QO));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(n, mask), hi = _mm256_and_si256(_mm256_srli_epi16(n, 4), mask);
  // [lo k, lo k+1, hi k, hi k+1] -> [lo k, hi k, lo k+1, hi k+1]
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

template <int64_t TYPE, int MT>
GD_VNNI void gd_row_vnni(const uint8_t* s, int64_t nb, const GdX& x, int64_t m0, float* y,
                         int64_t ldy, const float* b) {
  constexpr int64_t BY = gd_bytes<TYPE>();
  const int64_t K = x.K, K4 = K / 4;
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i sel = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc[MT];
  __m128 mins[MT];
  PD_UNROLL for (int m = 0; m < MT; ++m) {
    acc[m] = _mm512_setzero_ps();
    mins[m] = _mm_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 2 <= nb; k += 2, s += 2 * BY) {
    const __m128 wd = gd_pairs(s, s + BY);
    const __m512i w = gd_weights2<TYPE>(s);
    if (TYPE == GGML_Q4_1) {  // the min terms: (d, m) x (d_x, d_x * sum) in one product
      PD_UNROLL for (int m = 0; m < MT; ++m) {
        const int64_t r = m0 + m;
        const __m128 pr = _mm_mul_ps(wd, _mm_loadu_ps(x.ds + r * 2 * nb + 2 * k));
        mins[m] = _mm_add_ps(mins[m], pr);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                              _mm512_loadu_si512(x.qs + r * K + 32 * k));
        const __m512 sc = _mm512_permutexvar_ps(sel, _mm512_castps128_ps512(pr));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[m]);
      }
    } else {  // no mins: the blocks' d once as 16 lanes, times x's d_x lanes (the same product)
      const __m512 dw = _mm512_permutexvar_ps(sel, _mm512_castps128_ps512(wd));
      __m512i ncw;  // Q8_0: -128 * (each lane's q sum), vpdpbusd's start
      if (TYPE == GGML_Q8_0)
        ncw = _mm512_sub_epi32(_mm512_setzero_si512(),
                               _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, w));
      PD_UNROLL for (int m = 0; m < MT; ++m) {
        const int64_t r = m0 + m;
        __m512i p;
        if (TYPE == GGML_Q8_0)
          p = _mm512_dpbusd_epi32(ncw, _mm512_loadu_si512(x.qu + r * K + 32 * k), w);
        else
          p = _mm512_dpbusd_epi32(_mm512_loadu_si512(x.c8 + r * K4 + 8 * k), w,
                                  _mm512_loadu_si512(x.qs + r * K + 32 * k));
        const __m512 sc = _mm512_mul_ps(dw, _mm512_loadu_ps(x.dl + r * K4 + 8 * k));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[m]);
      }
    }
  }
  __m256 lo[MT];
  PD_UNROLL for (int m = 0; m < MT; ++m) lo[m] = _mm512_castps512_ps256(acc[m]);
  if (k < nb) gd_tail<TYPE, MT>(s, nb, k, x, m0, lo, mins);  // an odd last block
  PD_UNROLL for (int m = 0; m < MT; ++m) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m]), 1));
    y[m * ldy] = gd_finish(_mm256_add_ps(lo[m], hi), mins[m], TYPE == GGML_Q4_1, b);
  }
}
#endif

using GdRowFn = void (*)(const uint8_t*, int64_t, const GdX&, int64_t, float*, int64_t,
                         const float*);

template <int64_t TYPE>
GdRowFn gd_row_fn(bool vnni, int mt) {
#if defined(PD_ISA_AVX512)
  if (vnni) {
    static const GdRowFn f[8] = {gd_row_vnni<TYPE, 1>, gd_row_vnni<TYPE, 2>,
                                 gd_row_vnni<TYPE, 3>, gd_row_vnni<TYPE, 4>,
                                 gd_row_vnni<TYPE, 5>, gd_row_vnni<TYPE, 6>,
                                 gd_row_vnni<TYPE, 7>, gd_row_vnni<TYPE, 8>};
    return f[mt - 1];
  }
#endif
  static const GdRowFn f[4] = {gd_row_avx2<TYPE, 1>, gd_row_avx2<TYPE, 2>, gd_row_avx2<TYPE, 3>,
                               gd_row_avx2<TYPE, 4>};
  return f[mt - 1];
}

GdRowFn gd_pick(int64_t type, bool vnni, int mt) {
  switch (type) {
    case GGML_Q4_0: return gd_row_fn<GGML_Q4_0>(vnni, mt);
    case GGML_Q4_1: return gd_row_fn<GGML_Q4_1>(vnni, mt);
    default: return gd_row_fn<GGML_Q8_0>(vnni, mt);
  }
}

// y [M, N] for a Q8_0 / Q4_0 / Q4_1 weight: x quantized once; then up to 64 rows of x at a
// time, each weight row read once per 8 of them (VNNI; 4 with AVX2), parallel over its rows
void gd_linear(const float* xp, int64_t M, const GgufWeight& g, int64_t N, const float* bp,
               float* yp, bool vnni) {
  const int64_t K = g.K, nb = K / 32;
  std::vector<int8_t> qs(M * K);
  std::vector<uint8_t> qu(vnni && g.type == GGML_Q8_0 ? M * K : 0);
  std::vector<float> ds(M * 2 * nb);
  std::vector<int32_t> c8(g.type == GGML_Q4_0 ? M * (K / 4) : 0);
  std::vector<float> dl(vnni && g.type != GGML_Q4_1 ? M * (K / 4) : 0);
  gd_quantize(xp, M, K, qs.data(), qu.empty() ? nullptr : qu.data(), ds.data(),
              c8.empty() ? nullptr : c8.data(), dl.empty() ? nullptr : dl.data());
  const GdX xs{qs.data(), qu.empty() ? nullptr : qu.data(), ds.data(),
               c8.empty() ? nullptr : c8.data(), K, dl.empty() ? nullptr : dl.data()};
  const int64_t group = vnni ? 8 : 4;  // rows of x a weight row's unpacked blocks serve
  for (int64_t m0 = 0; m0 < M; m0 += GGUF_ROW_BLOCK) {
    const int64_t mb = std::min(GGUF_ROW_BLOCK, M - m0);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t m = m0; m < m0 + mb; m += group) {
        const int mt = static_cast<int>(std::min<int64_t>(group, m0 + mb - m));
        const GdRowFn fn = gd_pick(g.type, vnni, mt);
        for (int64_t n = n0; n < n1; ++n)
          fn(g.data + n * g.row_bytes, nb, xs, m, yp + m * N + n, N, bp ? bp + n : nullptr);
      }
    });
  }
}

#include "gguf_x16.h"  // the 16-row layout's kernels (they use gd_quantize's helpers)

Tensor gguf_linear_int(const Tensor& x_in, const GgufWeight& g, int64_t N,
                       const std::optional<Tensor>& b, int64_t path) {
  const int64_t K = g.K, K4 = K / 4, nb = K / 32;
  Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  Tensor y = at::empty({M, N}, x.options());
  Tensor bc;
  const float* bp = nullptr;
  if (b.has_value() && b->defined() && b->numel() > 0) {
    bc = b->to(at::kFloat).contiguous();
    bp = bc.data_ptr<float>();
  }
  float* yp = y.data_ptr<float>();
  if (g.x16) {
    gx_linear(x.data_ptr<float>(), M, g, N, bp, yp, path == 2);
    return gguf_shape(y, x_in, N);
  }
  if (gd_direct(g.type)) {
    gd_linear(x.data_ptr<float>(), M, g, N, bp, yp, path == 2);
    return gguf_shape(y, x_in, N);
  }
  std::vector<int8_t> xq(M * K);
  std::vector<float> xl(M * K4 + M * nb);
  const GqX xs{xq.data(), xl.data(), xl.data() + M * K4, K};
  gq_quantize(x.data_ptr<float>(), M, K, path == 2, xs);
  const bool has_min = g.type == GGML_Q4_1 || g.type == GGML_Q4_K;
  for (int64_t m0 = 0; m0 < M; m0 += GGUF_ROW_BLOCK) {
    const int64_t mb = std::min(GGUF_ROW_BLOCK, M - m0);
    at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t q0, int64_t q1) {
      std::vector<int8_t> wq(4 * K);
      std::vector<float> wf(4 * K4 + 4 * nb);
      std::vector<int32_t> corr(path == 2 ? 4 * K4 : 0);
      const GqW w{wq.data(), wf.data(), corr.data(), wf.data() + 4 * K4, K, has_min};
      float dots[4];
      for (int64_t qq = q0; qq < q1; ++qq) {
        const int64_t n = 4 * qq, nn = std::min<int64_t>(4, N - n);
        for (int64_t j = 0; j < nn; ++j) {
          gq_unpack(g.type, g.data + (n + j) * g.row_bytes, K, w.q + j * K, w.dw + j * K4,
                    w.mw + j * nb);
#if defined(PD_ISA_AVX512)
          if (path == 2) gq_corr_vnni(w.q + j * K, K, w.corr + j * K4);
#endif
        }
        for (int64_t m = m0; m < m0 + mb; m += 4) {
          const int64_t mt = std::min<int64_t>(4, m0 + mb - m);
          for (int j = 0; j < nn; ++j) {
#if defined(PD_ISA_AVX512)
            if (path == 2) {
              GQ_VNNI_ROWS[mt - 1](xs, m, w, j, dots);
            } else
#endif
              GQ_AVX2_ROWS[mt - 1](xs, m, w, j, dots);
            for (int64_t i = 0; i < mt; ++i) {
              float v = dots[i];
              if (has_min) v += gq_dot(w.mw + j * nb, xs.sx + (m + i) * nb, nb);
              if (bp) v += bp[n + j];
              yp[(m + i) * N + n + j] = v;
            }
          }
        }
      }
    });
  }
  return gguf_shape(y, x_in, N);
}

// the GGUF GEMM on `path` (0: the process default)
Tensor gguf_linear_path(const Tensor& x_in, const Tensor& w, int64_t N,
                        const std::optional<Tensor>& b, int64_t path) {
  path = gguf_resolve_path(path);
  if (path == GQ_FLOAT) return gguf_linear_float(x_in, w, N, b);
  const GgufWeight g = gguf_weight(w);
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(g.K == K && g.N == N, "GGUF weight [", g.N, ", ", g.K, "] does not match the input (",
              K, " features) and ", N, " outputs");
  TORCH_CHECK(isa_supported(), "the GGUF integer dot needs AVX2 and FMA");
  return gguf_linear_int(x_in, g, N, b, path);
}

Tensor gguf_linear(const Tensor& x_in, const Tensor& w, int64_t N,
                   const std::optional<Tensor>& b) {
  return gguf_linear_path(x_in, w, N, b, 0);
}

}  // namespace
