// The engine's native kernels (see native/__init__.py): float32 and bf16 GEMMs over weight
// panels, decode attention over the decode K/V view, and the Llama-family decode layer loop.
// The loop calls the same operators (these kernels included), in the same order and on the
// same tensors, as the Python loop in models/llama.py for a decode-only step through the view,
// so the result is the same to the bit; what it removes is the interpreter between ~25 small
// operators a layer.
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

// ---- float32 GEMM over weight panels: y[M, N] = x[M, K] W[N, K]^T (+ b) ---------------------
// The weight is stored once, as panels of 32 output features: [ceil(N / 32), K, 32] (pack_panels
// in models/layers.py; zero rows pad the last panel). A tile of up to 12 rows of x runs down one
// panel: per k, two vector loads of the panel, one broadcast of x[m, k] per row, two FMAs per
// row into 24 accumulators; the panel streams from memory once per tile group (a decode step:
// one tile, so every weight byte is read once, memory-bound) and stays in L2 across the tiles
// of a prefill (compute-bound). Measured here against oneDNN's reordered weights (SmolLM2's
// matrices): at 8 rows 21 against 16-18 GB/s on one thread; at 1024 rows 110 against 92
// GFLOP/s. Each output sums over k in order with fused multiply-adds: float32 rounding differs
// from oneDNN's and F.linear's (which differ from each other).
constexpr int64_t PANEL = 32;
constexpr int TILE = 12;

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

template <int MB>
__attribute__((target("avx512f"))) void panel_tile(const float* x, int64_t K, const float* w,
                                                   float* y, int64_t N, int64_t n0,
                                                   const float* b) {
  __m512 acc[MB][2];
  PD_UNROLL for (int m = 0; m < MB; ++m) {
    acc[m][0] = _mm512_setzero_ps();
    acc[m][1] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(w + k * PANEL), w1 = _mm512_loadu_ps(w + k * PANEL + 16);
    PD_UNROLL for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(w0, xv, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, xv, acc[m][1]);
    }
  }
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

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t,
                        const float*);
const TileFn TILES[TILE] = {panel_tile<1>, panel_tile<2>, panel_tile<3>, panel_tile<4>,
                            panel_tile<5>, panel_tile<6>, panel_tile<7>, panel_tile<8>,
                            panel_tile<9>, panel_tile<10>, panel_tile<11>, panel_tile<12>};

// Runs tile(m, rows, p) over every (tile of rows, panel) of an M-row GEMM with P panels, in
// parallel. Work items are (block of rows, panel): a decode step has one block, so its panels
// are shared out; a prefill's rows come in blocks of 16 tiles, each block's rows (in L2) run
// down one panel after another. Tiles are balanced: 13 rows run as 7 + 6, not 12 + 1.
template <typename Tile>
void for_tiles(int64_t M, int64_t P, const Tile& tile) {
  if (M <= 0) return;
  const int64_t block = TILE * 16;
  const int64_t blocks = (M + block - 1) / block;
  at::parallel_for(0, P * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t mb = i / P, p = i % P;
      const int64_t m0 = mb * block, m1 = std::min(M, (mb + 1) * block);
      const int64_t tiles = (m1 - m0 + TILE - 1) / TILE;
      for (int64_t t = 0, m = m0; t < tiles; ++t) {
        const int64_t rows = (m1 - m + (tiles - t) - 1) / (tiles - t);
        tile(m, rows, p);
        m += rows;
      }
    }
  });
}

// y viewed with x's leading dimensions
Tensor with_lead(const Tensor& y, const Tensor& x_in) {
  if (x_in.dim() == 2) return y;
  auto shape = x_in.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);
}

// x [..., K] float32, panels [ceil(N / 32), K, 32], b [N] or empty
Tensor panel_linear(const Tensor& x_in, const Tensor& panels, int64_t N,
                    const std::optional<Tensor>& b) {
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(panel_gemm_supported(), "the panel GEMM needs AVX-512");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "the panel GEMM is float32");
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == K && panels.size(2) == PANEL &&
                  panels.size(0) * PANEL >= N && panels.is_contiguous(),
              "panels do not match the input");
  Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), P = panels.size(0);
  Tensor y = at::empty({M, N}, x.options());
  const float* bp = nullptr;
  Tensor bc;
  if (b.has_value() && b->defined() && b->numel() > 0) {
    bc = b->contiguous();
    bp = bc.data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_tiles(M, P, [&](int64_t m, int64_t rows, int64_t p) {
    TILES[rows - 1](xp + m * K, K, wp + p * K * PANEL, yp + m * N, N, p * PANEL, bp);
  });
  return with_lead(y, x_in);
}

// ---- bfloat16 GEMM over weight panels (AVX-512 BF16) ----------------------------------------
// Panels of 32 output features with k in pairs: [ceil(N / 32), K / 2, 32, 2] bf16 (K even), so
// one 64-byte load holds 16 outputs x 2 k; vdpbf16ps multiplies them by the broadcast pair
// (x[m, k], x[m, k + 1]) and accumulates in float32; the output is rounded to bf16 once.
bool bf16_gemm_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void panel_tile_bf16(
    const uint16_t* x, int64_t K, const uint16_t* w, uint16_t* y, int64_t N, int64_t n0,
    const uint16_t* b) {
  __m512 acc[MB][2];
  PD_UNROLL for (int m = 0; m < MB; ++m) {
    acc[m][0] = _mm512_setzero_ps();
    acc[m][1] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 2) {
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
  for_tiles(M, P, [&](int64_t m, int64_t rows, int64_t p) {
    TILES_BF16[rows - 1](xp + m * K, K, wp + p * K * PANEL, yp + m * N, N, p * PANEL, bp);
  });
  return with_lead(y, x_in);
}

// a GEMM of the decode loop: panels (3-D) or oneDNN's reordered weight
Tensor any_linear(const c10::OperatorHandle& lin, const Tensor& x, const Tensor& w, int64_t N,
                  const std::optional<Tensor>& b) {
  if (w.dim() == 3) return panel_linear(x, w, N, b);
  if (w.dim() == 4) return panel_linear_bf16(x, w, N, b);
  return linear(lin, x, w, b);
}

// ---- decode attention: q [B, KVH, G, D] against k, v [B, KVH, W, D] (+ bias [B, 1, 1, W]) ----
// One query token per sequence, the G query heads of a KV head together: per (sequence, KV
// head) the scores of every key against the G queries (one pass over K), a softmax per query,
// then one pass over V. CPU SDPA took 145-200 us a layer for SmolLM2 at batch 8 (~150-token
// contexts); this runs in a fraction of it (the closing notes of #21 have the numbers). exp is a
// degree-6 polynomial on the reduced argument (relative error ~2e-7); -inf scores (masked
// positions) weigh exactly 0.
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

// ---- rotary + K/V store, fused -----------------------------------------------------------------
// What the Python loop does in ~12 small operators per layer (rotary over q and k, the pool's
// index_copy_, for a decode step also the view's index_put_ at each row's new column and q into
// the view's dtype), in one pass over the step's qkv. Equal to the bit: every product and sum
// rounds to the model's dtype as the elementwise aten operators round (float math, then round
// to nearest even; the library is built with -ffp-contract=off, so no multiply-add is fused).
template <typename X>
inline float rnd(float f) {
  return static_cast<float>(X(f));
}

// Vector forms of rnd: float32 (nothing to round) and bf16 (round to nearest even in integer
// ops, as c10::BFloat16 rounds: denormals kept, NaN stays NaN), 16 lanes at a time.
template <typename X>
struct Lanes;

template <>
struct Lanes<float> {
  __attribute__((target("avx512f"))) static __m512 load(const float* p) {
    return _mm512_loadu_ps(p);
  }
  __attribute__((target("avx512f"))) static __m512 round(__m512 v) { return v; }
};

template <>
struct Lanes<c10::BFloat16> {
  __attribute__((target("avx512f"))) static __m512 load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  __attribute__((target("avx512f"))) static __m512 round(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(r);
  }
};

template <typename X>
__attribute__((target("avx512f"))) void rotate_head_avx512(const X* xh, const X* c, const X* s,
                                                           int64_t D2, float* rot) {
  using L = Lanes<X>;
  for (int64_t d = 0; d < D2; d += 16) {
    const __m512 x1 = L::load(xh + d), x2 = L::load(xh + D2 + d);
    const __m512 c1 = L::load(c + d), c2 = L::load(c + D2 + d);
    const __m512 s1 = L::load(s + d), s2 = L::load(s + D2 + d);
    const __m512 nx2 = _mm512_castsi512_ps(_mm512_xor_si512(  // -x2: the sign bit flipped
        _mm512_castps_si512(x2), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
    const __m512 lo = L::round(_mm512_add_ps(L::round(_mm512_mul_ps(x1, c1)),
                                             L::round(_mm512_mul_ps(nx2, s1))));
    const __m512 hi = L::round(_mm512_add_ps(L::round(_mm512_mul_ps(x2, c2)),
                                             L::round(_mm512_mul_ps(x1, s2))));
    _mm512_storeu_ps(rot + d, lo);
    _mm512_storeu_ps(rot + D2 + d, hi);
  }
}

__attribute__((target("avx512f"))) inline void store_upper_halves(uint16_t* dst, const float* src,
                                                                   int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(src + i)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(b));
  }
}

// dst[0:n] = src, values already rounded to V (so bf16 keeps their upper halves: exact)
template <typename V>
inline void store_rounded(V* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<V, float>) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else if constexpr (std::is_same_v<V, c10::BFloat16>) {
    if (n % 16 == 0 && panel_gemm_supported()) {
      store_upper_halves(reinterpret_cast<uint16_t*>(dst), src, n);
      return;
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = V(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = V(src[i]);
  }
}

// one head of rotary into `rot` (float, already rounded to X): 16 lanes at a time (D a
// multiple of 32, AVX-512) or one element at a time
template <typename X>
inline void rotate_head(const X* xh, const X* c, const X* s, int64_t D, float* rot) {
  const int64_t D2 = D / 2;
  if constexpr (std::is_same_v<X, float> || std::is_same_v<X, c10::BFloat16>) {
    if (D2 % 16 == 0 && panel_gemm_supported()) {
      rotate_head_avx512<X>(xh, c, s, D2, rot);
      return;
    }
  }
  for (int64_t d = 0; d < D; ++d) {
    const float r = d < D2 ? -static_cast<float>(xh[d + D2]) : static_cast<float>(xh[d - D2]);
    const float a = rnd<X>(static_cast<float>(xh[d]) * static_cast<float>(c[d]));
    const float b = rnd<X>(r * static_cast<float>(s[d]));
    rot[d] = rnd<X>(a + b);
  }
}

// qkv [T, (H + 2 KVH) D] (unit inner stride), cos/sin [T, 1, D], pools [S, KVH, D] in X.
// out: the rotated heads, [T, OH, D] in V: OH = H (q only: a decode step, whose k goes to the
// view) or H + KVH (q and k). With a view ([B, KVH, cap, D] in V), k and v also go to
// (rows[t], :, cols[t]).
template <typename X, typename V>
void rope_store_impl(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& k_pool,
                     const Tensor& v_pool, const Tensor* view_k, const Tensor* view_v,
                     const Tensor& out_slots, const int64_t* rp, const int64_t* colp,
                     Tensor& out, int64_t H, int64_t KVH, int64_t D) {
  const int64_t T = qkv.size(0), row = qkv.stride(0), OH = out.size(1);
  const X* src = qkv.data_ptr<X>();
  const X* cp = cos.data_ptr<X>();
  const X* sp = sin.data_ptr<X>();
  X* kp = k_pool.data_ptr<X>();
  X* vp = v_pool.data_ptr<X>();
  V* vk = view_k ? view_k->data_ptr<V>() : nullptr;
  V* vv = view_v ? view_v->data_ptr<V>() : nullptr;
  V* op = out.data_ptr<V>();
  const int64_t* slot = out_slots.data_ptr<int64_t>();
  const int64_t vsb = vk ? view_k->stride(0) : 0, vsh = vk ? view_k->stride(1) : 0,
                vsc = vk ? view_k->stride(2) : 0;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> rot(D);
    for (int64_t t = t0; t < t1; ++t) {
      const X* x = src + t * row;
      const X* c = cp + t * D;
      const X* s = sp + t * D;
      X* kd = kp + slot[t] * KVH * D;
      X* vd = vp + slot[t] * KVH * D;
      const int64_t vbase = vk ? rp[t] * vsb + colp[t] * vsc : 0;
      for (int64_t h = 0; h < H + KVH; ++h) {
        rotate_head<X>(x + h * D, c, s, D, rot.data());
        if (h < OH) store_rounded<V>(op + (t * OH + h) * D, rot.data(), D);
        if (h >= H) {
          const int64_t kh = h - H;
          store_rounded<X>(kd + kh * D, rot.data(), D);
          if (vk) store_rounded<V>(vk + vbase + kh * vsh, rot.data(), D);
        }
      }
      const X* xv = x + (H + KVH) * D;
      std::memcpy(vd, xv, sizeof(X) * KVH * D);
      if (vv)
        for (int64_t kh = 0; kh < KVH; ++kh)
          for (int64_t d = 0; d < D; ++d)
            vv[vbase + kh * vsh + d] = V(static_cast<float>(xv[kh * D + d]));
    }
  });
}

bool long_rows(const Tensor& ix, int64_t T) {
  return ix.scalar_type() == at::kLong && ix.is_contiguous() && ix.numel() == T;
}

// Whether the fused kernel applies: qkv [T, (H + 2 KVH) D] with unit inner stride, cos/sin
// [T, 1, D] contiguous in the model's dtype (float32, bf16 or fp16), pools contiguous in that
// dtype, slots long; a view (if any) contiguous in float32 or the model's dtype.
bool rope_store_fits(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                     const Tensor& k_pool, const Tensor& v_pool, const Tensor* view_k,
                     const Tensor* view_v, const Tensor& out_slots, int64_t H, int64_t KVH,
                     int64_t D) {
  const auto x = qkv.scalar_type();
  const int64_t T = qkv.size(0);
  const bool base =
      (x == at::kFloat || x == at::kBFloat16 || x == at::kHalf) && D % 2 == 0 &&
      qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * KVH) * D &&
      long_rows(out_slots, T) && cos.scalar_type() == x && cos.is_contiguous() &&
      cos.numel() == T * D && sin.sizes() == cos.sizes() && sin.strides() == cos.strides() &&
      sin.scalar_type() == x && k_pool.scalar_type() == x && k_pool.is_contiguous() &&
      k_pool.numel() % (KVH * D) == 0 && v_pool.sizes() == k_pool.sizes() &&
      v_pool.is_contiguous() && v_pool.scalar_type() == x;
  if (!base || view_k == nullptr) return base;
  const auto vt = view_k->scalar_type();
  return view_k->is_contiguous() && view_k->dim() == 4 && (vt == at::kFloat || vt == x) &&
         view_v->sizes() == view_k->sizes() && view_v->is_contiguous() &&
         view_v->scalar_type() == vt;
}

template <typename X>
void rope_store_typed(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                      const Tensor& k_pool, const Tensor& v_pool, const Tensor* view_k,
                      const Tensor* view_v, const Tensor& out_slots, const int64_t* rp,
                      const int64_t* colp, Tensor& out, int64_t H, int64_t KVH, int64_t D) {
  if (out.scalar_type() == qkv.scalar_type())
    rope_store_impl<X, X>(qkv, cos, sin, k_pool, v_pool, view_k, view_v, out_slots, rp, colp,
                          out, H, KVH, D);
  else
    rope_store_impl<X, float>(qkv, cos, sin, k_pool, v_pool, view_k, view_v, out_slots, rp,
                              colp, out, H, KVH, D);
}

void rope_store_any(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& k_pool,
                    const Tensor& v_pool, const Tensor* view_k, const Tensor* view_v,
                    const Tensor& out_slots, const int64_t* rp, const int64_t* colp, Tensor& out,
                    int64_t H, int64_t KVH, int64_t D) {
  const auto x = qkv.scalar_type();
  if (x == at::kFloat)
    rope_store_impl<float, float>(qkv, cos, sin, k_pool, v_pool, view_k, view_v, out_slots, rp,
                                  colp, out, H, KVH, D);
  else if (x == at::kBFloat16)
    rope_store_typed<c10::BFloat16>(qkv, cos, sin, k_pool, v_pool, view_k, view_v, out_slots, rp,
                                    colp, out, H, KVH, D);
  else
    rope_store_typed<c10::Half>(qkv, cos, sin, k_pool, v_pool, view_k, view_v, out_slots, rp,
                                colp, out, H, KVH, D);
}

// A decode step (append): q rotated as [T, KVH, G, D] in the view's dtype; k and v written to
// the pool at out_slots and to the view at (rows[t], :, cols[t]).
Tensor rope_store_view(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                       const Tensor& k_pool, const Tensor& v_pool, const Tensor& view_k,
                       const Tensor& view_v, const Tensor& out_slots, const Tensor& rows,
                       const Tensor& cols, int64_t H, int64_t KVH, int64_t D) {
  Tensor q = at::empty({qkv.size(0), H, D}, view_k.options());
  rope_store_any(qkv, cos, sin, k_pool, v_pool, &view_k, &view_v, out_slots,
                 rows.data_ptr<int64_t>(), cols.data_ptr<int64_t>(), q, H, KVH, D);
  return q.view({qkv.size(0), KVH, H / KVH, D});
}

Tensor rotate_half(const Tensor& x);

// pdcore_native::rope_store: any step's rotary + pool store (models/llama.py, Attention):
// returns q and k rotated, [T, H + KVH, D] in the model's dtype, k and v written to the pools
// ([pages, page_size, KVH, D]) at out_slots. Where the fused kernel does not apply, the same
// aten operators as the Python code.
Tensor rope_store(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& k_pool,
                  const Tensor& v_pool, const Tensor& out_slots, int64_t H, int64_t KVH,
                  int64_t D) {
  const int64_t T = qkv.size(0);
  if (!rope_store_fits(qkv, cos, sin, k_pool, v_pool, nullptr, nullptr, out_slots, H, KVH, D)) {
    Tensor qk = qkv.slice(1, 0, (H + KVH) * D).view({T, H + KVH, D});
    qk = qk * cos + rotate_half(qk) * sin;
    Tensor kf = k_pool.view({-1, KVH, D}), vf = v_pool.view({-1, KVH, D});
    kf.index_copy_(0, out_slots, qk.slice(1, H).to(kf.scalar_type()));
    vf.index_copy_(0, out_slots, qkv.slice(1, (H + KVH) * D).view({T, KVH, D})
                                     .to(vf.scalar_type()));
    return qk;
  }
  Tensor out = at::empty({T, H + KVH, D}, qkv.options());
  rope_store_any(qkv, cos, sin, k_pool, v_pool, nullptr, nullptr, out_slots, nullptr, nullptr,
                 out, H, KVH, D);
  return out;
}

// ---- SiLU(gate) * up, bf16 ------------------------------------------------------------------
// gu [M, 2I] bf16 (the gate_up GEMM's output: gate | up) -> [M, I] = silu(gate) * up in one pass
// instead of aten's silu over the strided half, then mul (measured here, 1024 x 1536: 0.6 ms a
// layer for the two). silu(x) = x / (1 + exp(-x)) in float32, this file's exp and a refined
// reciprocal (a few float32 ulps from aten's, far below bf16's last bit), rounded to bf16 before
// the product as aten's two operators round. float32 keeps aten's operators (the float32 model
// stays equal to transformers' to the token).
__attribute__((target("avx512f"))) void silu_mul_rows(const c10::BFloat16* gu, int64_t ld,
                                                      c10::BFloat16* out, int64_t I, int64_t m0,
                                                      int64_t m1) {
  using L = Lanes<c10::BFloat16>;
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t m = m0; m < m1; ++m) {
    const c10::BFloat16* g = gu + m * ld;
    const c10::BFloat16* u = g + I;
    auto* o = reinterpret_cast<uint16_t*>(out + m * I);
    for (int64_t i = 0; i < I; i += 16) {
      const __m512 x = L::load(g + i);
      const __m512 nx = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
      const __m512 den = _mm512_add_ps(one, exp_ps(nx));
      __m512 r = _mm512_rcp14_ps(den);
      r = _mm512_mul_ps(r, _mm512_fnmadd_ps(den, r, two));  // one Newton step: ~1 ulp
      const __m512 sl = L::round(_mm512_mul_ps(x, r));
      const __m512 y = L::round(_mm512_mul_ps(sl, L::load(u + i)));
      const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(y), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm512_cvtepi32_epi16(hi));
    }
  }
}

Tensor silu_mul(const Tensor& gu, int64_t I) {
  const bool ok = panel_gemm_supported() && gu.scalar_type() == at::kBFloat16 &&
                  gu.dim() == 2 && gu.size(1) == 2 * I && gu.stride(1) == 1 && I % 16 == 0;
  if (!ok) return at::silu(gu.slice(1, 0, I)) * gu.slice(1, I);
  const int64_t M = gu.size(0), ld = gu.stride(0);
  Tensor out = at::empty({M, I}, gu.options());
  const auto* src = gu.data_ptr<c10::BFloat16>();
  auto* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    silu_mul_rows(src, ld, dst, I, m0, m1);
  });
  return out;
}

Tensor rotate_half(const Tensor& x) {
  auto parts = x.chunk(2, -1);
  return at::cat({parts[1].neg(), parts[0]}, -1);
}

std::optional<Tensor> opt(const Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<Tensor>(t) : std::nullopt;
}

// residual: the embedding of the step's tokens [B, hidden] (not modified; a new tensor comes
// back: the residual stream after every layer, before the final norm).
// Per layer lists: norm weights, reordered GEMM weights (qkv with its bias or an empty tensor),
// the pool's K/V buffers [pages, page_size, kv_heads, head_dim], the view's K/V buffers.
// mode 0: append (rows, cols: each row's new column), 1: fill (table: [B * width] slots).
Tensor decode_layers(const Tensor& residual_in, const Tensor& cos, const Tensor& sin,
                     at::TensorList ln1, at::TensorList ln2, at::TensorList qkv_w,
                     at::TensorList qkv_b, at::TensorList o_w, at::TensorList gu_w,
                     at::TensorList down_w, at::TensorList k_pool, at::TensorList v_pool,
                     at::TensorList view_k, at::TensorList view_v, const Tensor& out_slots,
                     const Tensor& rows, const Tensor& cols, const Tensor& table,
                     const Tensor& bias, int64_t mode, int64_t width, int64_t num_heads,
                     int64_t kv_heads, int64_t head_dim, int64_t inter, double eps,
                     double scale) {
  static const auto lin = c10::Dispatcher::singleton().findSchemaOrThrow(
      "mkldnn::_linear_pointwise", "");
  const int64_t T = residual_in.size(0), hidden = residual_in.size(1);
  const int64_t qs = num_heads * head_dim, ks = kv_heads * head_dim;
  const int64_t L = static_cast<int64_t>(ln1.size());
  const std::optional<Tensor> attn_bias = opt(bias);
  Tensor residual = residual_in;
  for (int64_t i = 0; i < L; ++i) {
    Tensor x = at::rms_norm(residual, {hidden}, ln1[i], eps);
    // attention
    Tensor qkv = any_linear(lin, x, qkv_w[i], qs + 2 * ks, opt(qkv_b[i]));
    Tensor kb_all = view_k[i];
    Tensor vb_all = view_v[i];
    Tensor qb;
    if (mode == 0 && long_rows(rows, T) && long_rows(cols, T) &&
        rope_store_fits(qkv, cos, sin, k_pool[i], v_pool[i], &kb_all, &vb_all, out_slots,
                        num_heads, kv_heads, head_dim)) {
      qb = rope_store_view(qkv, cos, sin, k_pool[i], v_pool[i], kb_all, vb_all, out_slots, rows,
                           cols, num_heads, kv_heads, head_dim);
    } else {
      Tensor qk = rope_store(qkv, cos, sin, k_pool[i], v_pool[i], out_slots, num_heads, kv_heads,
                             head_dim);
      Tensor q = qk.slice(1, 0, num_heads), k = qk.slice(1, num_heads);
      const auto pool_t = k_pool[i].scalar_type();
      if (mode == 0) {
        Tensor v = qkv.slice(1, qs + ks).view({T, kv_heads, head_dim});
        kb_all.index_put_({rows, Slice(), cols}, k.to(pool_t).to(kb_all.scalar_type()));
        vb_all.index_put_({rows, Slice(), cols}, v.to(pool_t).to(vb_all.scalar_type()));
      } else {
        const int64_t B = kb_all.size(0);
        Tensor kf = k_pool[i].view({-1, kv_heads, head_dim});
        Tensor vf = v_pool[i].view({-1, kv_heads, head_dim});
        kb_all.slice(2, 0, width).copy_(
            kf.index_select(0, table).view({B, width, kv_heads, head_dim}).transpose(1, 2));
        vb_all.slice(2, 0, width).copy_(
            vf.index_select(0, table).view({B, width, kv_heads, head_dim}).transpose(1, 2));
      }
      qb = q.reshape({T, kv_heads, num_heads / kv_heads, head_dim}).to(kb_all.scalar_type());
    }
    Tensor kb = kb_all.slice(2, 0, width), vb = vb_all.slice(2, 0, width);
    Tensor o = decode_attention(qb, kb, vb, attn_bias, scale);
    o = o.view({T, num_heads, head_dim}).to(qkv.scalar_type());
    x = any_linear(lin, o.view({T, -1}), o_w[i], hidden, std::nullopt);
    residual = i == 0 ? residual + x : residual.add_(x);
    // MLP
    x = at::rms_norm(residual, {hidden}, ln2[i], eps);
    Tensor gu = any_linear(lin, x, gu_w[i], 2 * inter, std::nullopt);
    Tensor a = silu_mul(gu, inter);
    residual.add_(any_linear(lin, a, down_w[i], hidden, std::nullopt));
  }
  return residual;
}

}  // namespace

TORCH_LIBRARY(pdcore_native, m) {
  m.def("decode_layers(Tensor residual, Tensor cos, Tensor sin, Tensor[] ln1, Tensor[] ln2, "
        "Tensor[] qkv_w, Tensor[] qkv_b, Tensor[] o_w, Tensor[] gu_w, Tensor[] down_w, "
        "Tensor[] k_pool, Tensor[] v_pool, Tensor[] view_k, Tensor[] view_v, Tensor out_slots, "
        "Tensor rows, Tensor cols, Tensor table, Tensor bias, int mode, int width, "
        "int num_heads, int kv_heads, int head_dim, int inter, float eps, float scale) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CompositeExplicitAutograd, &decode_layers);
  m.def("linear(Tensor x, Tensor panels, int n, Tensor? b) -> Tensor");
  m.impl("linear", c10::DispatchKey::CompositeExplicitAutograd, &panel_linear);
  m.def("panel_gemm_supported() -> bool", &panel_gemm_supported);
  m.def("linear_bf16(Tensor x, Tensor panels, int n, Tensor? b) -> Tensor");
  m.impl("linear_bf16", c10::DispatchKey::CompositeExplicitAutograd, &panel_linear_bf16);
  m.def("bf16_gemm_supported() -> bool", &bf16_gemm_supported);
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CompositeExplicitAutograd, &decode_attention);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor out_slots, int num_heads, int kv_heads, int head_dim) -> Tensor");
  m.impl("rope_store", c10::DispatchKey::CompositeExplicitAutograd, &rope_store);
  m.def("silu_mul(Tensor gate_up, int inter) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CompositeExplicitAutograd, &silu_mul);
}
