#pragma once
// Q8_0, Q4_0 and Q4_1 weights regrouped 16 rows at a time (type GGUF_X16 + the ggml type; made
// once at load by gguf_repack, the same bytes in another order): a decode step's integer dot
// then keeps 16 output columns in the lanes of one vector, so a block's int32 dot product ends
// whole in its lane (no per-lane float work, no horizontal sums) and each weight vector serves
// every row of x.
//
// Layout: group g (rows 16g .. 16g + 15), block b (32 weights) at (g * nb + b) * 16 * bytes:
//   the 16 rows' d (f16, 32 bytes); Q4_1: then their m (f16, 32 bytes); then the quants in
//   chunks of 64 bytes, lane j (row 16g + j) holding 4 bytes of each chunk:
//   Q8_0: 8 chunks, chunk c = weights 4c .. 4c + 3, each q + 128 (u8);
//   Q4_0, Q4_1: 4 chunks, chunk c = the row's file bytes 4c .. 4c + 3 (low nibbles: weights
//   4c .. 4c + 3, high nibbles: 16 + 4c .. 16 + 4c + 3).
//
// Math (the same on AVX2 and VNNI, to the bit; a row's output whatever its batch): x quantized
// per block of 32 (gq_block: x_q int8, d_x, the sum of x_q); per block the exact int32 dot
// D = sum q * x_q (Q4_0: q = nibble - 8; Q4_1: q = nibble); then, per output, in block order:
//   acc = fma(float(D), d_w * d_x, acc);   Q4_1: mins = fma(m_w, d_x * sum x_q, mins)
// and y = acc (+ mins) (+ bias). VNNI: vpdpbusd of u8 weights (Q8_0: q + 128, less 128 * sum
// x_q) against the broadcast x_q; AVX2: vpmaddubsw of |q| and sign-adjusted x_q (Q8_0) or of the
// nibbles and x_q, then vpmaddwd by 1; both are exact.

// row n (lane n % 16 of its group) de-quantized, each weight as the `gguf` package computes it
// (d * q, d * (q - 8), d * q + m: a product and a sum rounded apart)
void gx_dequant_row(const GgufWeight& g, int64_t n, float* y) {
  const int64_t nb = g.K / 32, j = n % 16, by = gguf_block(g.type).bytes;
  const bool q41 = g.base == GGML_Q4_1;
  const uint8_t* p = g.data + (n / 16) * nb * 16 * by;
  for (int64_t b = 0; b < nb; ++b, p += 16 * by, y += 32) {
    const float d = gguf_half(p + 2 * j), m = q41 ? gguf_half(p + 32 + 2 * j) : 0.0f;
    const uint8_t* q = p + (q41 ? 64 : 32) + 4 * j;
    for (int t = 0; t < 32; ++t) {
      if (g.base == GGML_Q8_0) {
        y[t] = d * static_cast<float>(static_cast<int8_t>(q[64 * (t / 4) + t % 4] ^ 0x80));
      } else {
        const int u = t % 16;
        const int nib = (q[64 * (u / 4) + u % 4] >> (t < 16 ? 0 : 4)) & 0x0F;
        if (q41) {
          const float dq = d * static_cast<float>(nib);
          y[t] = dq + m;
        } else {
          y[t] = d * (static_cast<float>(nib) - 8.0f);
        }
      }
    }
  }
}

// the file's rows [type, N, row_bytes] (Q8_0, Q4_0, Q4_1; N a multiple of 16) regrouped
Tensor gguf_repack(const Tensor& w) {
  const GgufWeight g = gguf_weight(w);
  TORCH_CHECK(!g.x16 && gguf_x16_type(g.type) && g.N % 16 == 0,
              "gguf_repack takes Q8_0, Q4_0 or Q4_1 rows in the file's layout, N a multiple of ",
              "16; got type ", g.type, ", N ", g.N);
  const int64_t nb = g.K / 32, by = gguf_block(g.type).bytes, rb = g.row_bytes;
  const bool q41 = g.type == GGML_Q4_1, q80 = g.type == GGML_Q8_0;
  const int64_t qo = q41 ? 4 : 2;  // quants' offset in a file block
  Tensor out = at::empty({g.N, rb}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, g.N / 16, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t gi = g0; gi < g1; ++gi) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* p = o + (gi * nb + b) * 16 * by;
        for (int64_t j = 0; j < 16; ++j) {
          const uint8_t* s = g.data + (16 * gi + j) * rb + b * by;
          std::memcpy(p + 2 * j, s, 2);
          if (q41) std::memcpy(p + 32 + 2 * j, s + 2, 2);
          uint8_t* q = p + (q41 ? 64 : 32) + 4 * j;
          const int chunks = q80 ? 8 : 4;
          for (int c = 0; c < chunks; ++c)
            for (int i = 0; i < 4; ++i)
              q[64 * c + i] = q80 ? (s[qo + 4 * c + i] ^ 0x80) : s[qo + 4 * c + i];
        }
      }
    }
  });
  return out.unsqueeze(0).expand({g.type + GGUF_X16, g.N, rb});
}

// x quantized for the 16-row kernels, per row r and block b: qs [M, K] x_q; dx [M, nb] d_x;
// sx [M, nb] d_x * sum x_q; c [M, nb] the int32 dot's start (Q4_0: -8 * sum x_q; Q8_0 on VNNI:
// -128 * sum x_q; else 0)
struct GxX {
  const int8_t* qs;
  const float* dx;
  const float* sx;
  const int32_t* c;
  int64_t K;
};

// The kernels prefetch the weight bytes GX_PF ahead of the block they read (8 KB, int8_gemm.h's
// distance): the hardware prefetcher alone left a decode step's 16-row GEMMs at 5.5x (Q4_1
// body) and 3.0x (Q8_0 lm_head) the weights' streaming time (SmolLM2 at batch 8, Zen 5, #48
// s14: bench/quant_step_profile.py). Prefetching changes no sum.
constexpr int64_t GX_PF = 8192;
// the lines of one block of 16 rows (16 * BY bytes) GX_PF ahead of p
template <int64_t BY>
inline void gx_prefetch(const uint8_t* p) {
  PD_UNROLL for (int64_t l = 0; l < (16 * BY + 63) / 64; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(p + GX_PF + 64 * l), _MM_HINT_T0);
}

// AVX2: lanes 8h .. 8h + 7 of group data gp (nb blocks) against MT rows of x from m0
template <int64_t TYPE, int MT>
GD_F16C void gx_half_avx2(const uint8_t* gp, int64_t nb, int h, const GxX& x, int64_t m0,
                          float* y, int64_t ldy, const float* bias) {
  constexpr int64_t BY = gd_bytes<TYPE>();
  constexpr bool Q41 = TYPE == GGML_Q4_1, Q80 = TYPE == GGML_Q8_0;
  const int64_t K = x.K;
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F),
                flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[MT], mins[MT];
  PD_UNROLL for (int m = 0; m < MT; ++m) acc[m] = mins[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = gp + b * 16 * BY;
    if (h == 0) gx_prefetch<BY>(p);  // once for the two halves
    const __m256 dw = _mm256_cvtph_ps(load16(p + 16 * h));
    const __m256 mw = Q41 ? _mm256_cvtph_ps(load16(p + 32 + 16 * h)) : _mm256_setzero_ps();
    const uint8_t* qp = p + (Q41 ? 64 : 32) + 32 * h;
    __m256i w[8];
    PD_UNROLL for (int c = 0; c < (Q80 ? 8 : 4); ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + 64 * c));
      if (Q80) {
        w[c] = _mm256_xor_si256(v, flip);  // q (s8)
      } else {
        w[c] = _mm256_and_si256(v, mask);
        w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
    }
    __m256i aw[8];
    if (Q80) {
      PD_UNROLL for (int c = 0; c < 8; ++c) aw[c] = _mm256_abs_epi8(w[c]);
    }
    PD_UNROLL for (int m = 0; m < MT; ++m) {
      const int64_t r = m0 + m;
      const int32_t* xw = reinterpret_cast<const int32_t*>(x.qs + r * K + 32 * b);
      __m256i d0 = _mm256_set1_epi32(Q80 ? 0 : x.c[r * nb + b]), d1 = _mm256_setzero_si256();
      PD_UNROLL for (int c = 0; c < 8; ++c) {
        const __m256i xb = _mm256_set1_epi32(xw[c]);
        const __m256i p16 = Q80 ? _mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(xb, w[c]))
                                : _mm256_maddubs_epi16(w[c], xb);
        if (c % 2 == 0)
          d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(p16, ones));
        else
          d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(p16, ones));
      }
      const __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(x.dx[r * nb + b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1)), sc, acc[m]);
      if (Q41) mins[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.sx[r * nb + b]), mins[m]);
    }
  }
  PD_UNROLL for (int m = 0; m < MT; ++m) {
    __m256 v = Q41 ? _mm256_add_ps(acc[m], mins[m]) : acc[m];
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
    _mm256_storeu_ps(y + m * ldy + 8 * h, v);
  }
}

#if defined(PD_ISA_AVX512)
// VNNI: the group's 16 lanes against MT rows of x from m0
template <int64_t TYPE, int MT>
GD_VNNI void gx_group_vnni(const uint8_t* gp, int64_t nb, const GxX& x, int64_t m0, float* y,
                           int64_t ldy, const float* bias) {
  constexpr int64_t BY = gd_bytes<TYPE>();
  constexpr bool Q41 = TYPE == GGML_Q4_1, Q80 = TYPE == GGML_Q8_0;
  const int64_t K = x.K;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[MT], mins[MT];
  PD_UNROLL for (int m = 0; m < MT; ++m) acc[m] = mins[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = gp + b * 16 * BY;
    gx_prefetch<BY>(p);
    const __m512 dw = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 mw = Q41 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(p + 32)))
                          : _mm512_setzero_ps();
    const uint8_t* qp = p + (Q41 ? 64 : 32);
    __m512i w[8];
    PD_UNROLL for (int c = 0; c < (Q80 ? 8 : 4); ++c) {
      const __m512i v = _mm512_loadu_si512(qp + 64 * c);
      if (Q80) {
        w[c] = v;
      } else {
        w[c] = _mm512_and_si512(v, mask);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      }
    }
    PD_UNROLL for (int m = 0; m < MT; ++m) {
      const int64_t r = m0 + m;
      const int32_t* xw = reinterpret_cast<const int32_t*>(x.qs + r * K + 32 * b);
      __m512i d0 = _mm512_set1_epi32(x.c[r * nb + b]), d1 = _mm512_setzero_si512();
      PD_UNROLL for (int c = 0; c < 8; c += 2) {
        d0 = _mm512_dpbusd_epi32(d0, w[c], _mm512_set1_epi32(xw[c]));
        d1 = _mm512_dpbusd_epi32(d1, w[c + 1], _mm512_set1_epi32(xw[c + 1]));
      }
      const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(x.dx[r * nb + b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), sc, acc[m]);
      if (Q41) mins[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sx[r * nb + b]), mins[m]);
    }
  }
  PD_UNROLL for (int m = 0; m < MT; ++m) {
    __m512 v = Q41 ? _mm512_add_ps(acc[m], mins[m]) : acc[m];
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y + m * ldy, v);
  }
}
#endif

// one group (16 outputs from y) against rows m0 .. m0 + mt of x
template <int64_t TYPE>
void gx_group(const uint8_t* gp, int64_t nb, const GxX& x, int64_t m0, int64_t mt, float* y,
              int64_t ldy, const float* bias, bool vnni) {
#if defined(PD_ISA_AVX512)
  if (vnni) {
    using Fn = void (*)(const uint8_t*, int64_t, const GxX&, int64_t, float*, int64_t,
                        const float*);
    static const Fn f[8] = {gx_group_vnni<TYPE, 1>, gx_group_vnni<TYPE, 2>,
                            gx_group_vnni<TYPE, 3>, gx_group_vnni<TYPE, 4>,
                            gx_group_vnni<TYPE, 5>, gx_group_vnni<TYPE, 6>,
                            gx_group_vnni<TYPE, 7>, gx_group_vnni<TYPE, 8>};
    for (int64_t m = m0; m < m0 + mt; m += 8) {
      const int64_t k = std::min<int64_t>(8, m0 + mt - m);
      f[k - 1](gp, nb, x, m, y + (m - m0) * ldy, ldy, bias);
    }
    return;
  }
#endif
  using Fn = void (*)(const uint8_t*, int64_t, int, const GxX&, int64_t, float*, int64_t,
                      const float*);
  static const Fn f[4] = {gx_half_avx2<TYPE, 1>, gx_half_avx2<TYPE, 2>, gx_half_avx2<TYPE, 3>,
                          gx_half_avx2<TYPE, 4>};
  for (int64_t m = m0; m < m0 + mt; m += 4) {
    const int64_t k = std::min<int64_t>(4, m0 + mt - m);
    for (int h = 0; h < 2; ++h) f[k - 1](gp, nb, h, x, m, y + (m - m0) * ldy, ldy, bias);
  }
}

// y [M, N] for a 16-row weight: x quantized once, then each group of 16 weight rows against
// up to GGUF_ROW_BLOCK rows of x at a time (in L1: 8 rows a pass on VNNI, 4 on AVX2), parallel
// over the groups
void gx_linear(const float* xp, int64_t M, const GgufWeight& g, int64_t N, const float* bp,
               float* yp, bool vnni) {
  const int64_t K = g.K, nb = K / 32, gbytes = nb * 16 * gguf_block(g.type).bytes;
  std::vector<int8_t> qs(M * K);
  std::vector<float> dx(M * nb), sx(M * nb);
  std::vector<int32_t> c(M * nb);
  const int32_t start = g.base == GGML_Q4_0 ? -8 : g.base == GGML_Q8_0 && vnni ? -128 : 0;
  at::parallel_for(0, M, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        float d;
        int32_t qsum;
        const __m256i p8 = gq_block(xp + r * K + 32 * b, d, qsum);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs.data() + r * K + 32 * b), p8);
        dx[r * nb + b] = d;
        sx[r * nb + b] = d * static_cast<float>(qsum);
        c[r * nb + b] = start * qsum;
      }
    }
  });
  const GxX xs{qs.data(), dx.data(), sx.data(), c.data(), K};
  for (int64_t m0 = 0; m0 < M; m0 += GGUF_ROW_BLOCK) {
    const int64_t mb = std::min(GGUF_ROW_BLOCK, M - m0);
    at::parallel_for(0, N / 16, 4, [&](int64_t g0, int64_t g1) {
      for (int64_t gi = g0; gi < g1; ++gi) {
        const uint8_t* gp = g.data + gi * gbytes;
        float* y = yp + m0 * N + 16 * gi;
        const float* b = bp ? bp + 16 * gi : nullptr;
        switch (g.base) {
          case GGML_Q4_0: gx_group<GGML_Q4_0>(gp, nb, xs, m0, mb, y, N, b, vnni); break;
          case GGML_Q4_1: gx_group<GGML_Q4_1>(gp, nb, xs, m0, mb, y, N, b, vnni); break;
          default: gx_group<GGML_Q8_0>(gp, nb, xs, m0, mb, y, N, b, vnni); break;
        }
      }
    });
  }
}
