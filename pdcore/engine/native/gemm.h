#pragma once
// float32 and bf16 GEMMs over weight panels, and oneDNN's for the weights it holds
#include "common.h"
#include "gguf_gemm.h"

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

// ---- float32 GEMM over weight panels: y[M, N] = x[M, K] W[N, K]^T (+ b) ---------------------
// The weight is stored once, as panels of 32 output features: [ceil(N / 32), K, 32] (pack_panels
// in models/layers.py; zero rows pad the last panel). A tile of up to 12 rows of x runs down one
// panel: per k, two vector loads of the panel, one broadcast of x[m, k] per row, two FMAs per
// row into 24 accumulators; the panel streams from memory once per tile group (a decode step:
// one tile, so every weight byte is read once, memory-bound) and stays in L2 across the tiles
// of a prefill (compute-bound). A GEMM of more than one tile first copies x tile by tile into
// k-major order ([K][rows] per tile, `pack_tiles`): the tile's broadcasts then read one stream
// in order, where x's rows lie K floats apart, which for K a multiple of 1024 puts every row of
// the tile in the same L1 set (measured on a Zen 4 at 1024 rows, 2 threads: 155 GFLOP/s with
// K = 2048 against 203 with K = 2064 before the copy). Each output sums over k in order with
// fused multiply-adds whichever way x is laid out: float32 rounding differs from oneDNN's and
// F.linear's (which differ from each other), not between decode and prefill.
// Each k also prefetches the panel PD_PF k ahead (2 KB): with a few rows of work per 128 bytes
// the hardware prefetcher alone left the reads short of the memory's bandwidth (an Intel Xeon
// with AMX, 2 threads, SmolLM2's matrices at 8 rows: 28.6-29.8 ms a pass over them without,
// 22.7-23.5 with, AVX2 library 31-32 against 27-28; 512 rows 233 against 255 GFLOP/s; bf16 at
// 8 rows 20-25 against 15 ms). Prefetching changes no sum.
constexpr int64_t PANEL = 32;
constexpr int TILE = 12;
#ifndef PD_PF
#define PD_PF 16
#endif
#ifndef PD_AVX2_ROWS
#define PD_AVX2_ROWS 3
#endif

// Panels hold float32 or bf16 weights (WT: float or uint16_t, the same [ceil(N / 32), K, 32]
// layout; a W8A8 model's bf16 lm_head, loader.bf16_lm_head). A bf16 weight is widened to float32
// as it is loaded (a shift: exact) and multiplied by float32 x, so its outputs are the float
// kernel's on the widened matrix, to the bit. Prefetching stays 2 KB ahead either way.
inline V16 wload(const float* p) { return vload(p); }
inline V16 wload(const uint16_t* p) { return vload_bf16(p); }
template <typename WT>
inline void wprefetch(const WT* w, int64_t k) {
  const char* p = reinterpret_cast<const char*>(w + (k + PD_PF * 4 / sizeof(WT)) * PANEL);
  _mm_prefetch(p, _MM_HINT_T0);
  if constexpr (sizeof(WT) == 4) _mm_prefetch(p + 64, _MM_HINT_T0);
}


// MB rows down k in [k0, k1) of one panel: per k, the panel's two 16-lane halves (one 128-byte
// stretch, read in order) and one broadcast of x[m, k] per row, two FMAs per row into the 2 x MB
// accumulators `acc`. x is row-major (x[m * K + k]) or, PK, k-major with `ld` rows per k
// (x[k * ld + m]). PF: prefetch the panel PD_PF k ahead.
template <int MB, bool PK, bool PF, typename WT>
inline void rows_fma(V16 (&acc)[MB][2], const float* x, int64_t K, int64_t ld, const WT* w,
                     int64_t k0, int64_t k1) {
  for (int64_t k = k0; k < k1; ++k) {
    if (PF) wprefetch(w, k);
    const V16 w0 = wload(w + k * PANEL), w1 = wload(w + k * PANEL + 16);
    const float* xk = PK ? x + k * ld : x + k;
    PD_UNROLL for (int m = 0; m < MB; ++m) {
      const V16 xv = vset1(PK ? xk[m] : xk[m * K]);
      acc[m][0] = vfmadd(w0, xv, acc[m][0]);
      acc[m][1] = vfmadd(w1, xv, acc[m][1]);
    }
  }
}

// One panel's 32 outputs of a row written to y[n0 : n0 + 32] (the lanes past N masked off), the
// bias added to each (b null: none)
struct PanelOut {
  int64_t n0;
  M16 m0, m1;
  V16 b0 = vzero(), b1 = vzero();
  PanelOut(int64_t N, int64_t n0, const float* b)
      : n0(n0), m0(lane_mask(N - n0)), m1(lane_mask(N - n0 - 16)) {
    if (b) {
      b0 = vmaskz_load(m0, b + n0);
      b1 = vmaskz_load(m1, b + n0 + 16);
    }
  }
  void store(float* y_row, const V16& a0, const V16& a1) const {
    vmask_store(y_row + n0, m0, vadd(a0, b0));
    vmask_store(y_row + n0 + 16, m1, vadd(a1, b1));
  }
};

// MB rows down a whole panel into y (+ b)
template <int MB, bool PK, typename WT>
void panel_rows(const float* x, int64_t K, int64_t ld, const WT* w, float* y, int64_t N,
                int64_t n0, const float* b) {
  V16 acc[MB][2];
  PD_UNROLL for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = vzero();
  rows_fma<MB, PK, true>(acc, x, K, ld, w, 0, K);
  const PanelOut out(N, n0, b);
  PD_UNROLL for (int m = 0; m < MB; ++m) out.store(y + m * N, acc[m][0], acc[m][1]);
}

#if defined(PD_ISA_AVX512)
// AVX-512: the whole tile at once, 2 x MB accumulators (24 at 12 rows) of the 32 registers
template <int MB, bool PK, typename WT>
void panel_tile(const float* x, int64_t K, const WT* w, float* y, int64_t N, int64_t n0,
                const float* b) {
  panel_rows<MB, PK>(x, K, MB, w, y, N, n0, b);
}

// A GEMM of more than one tile (a prefill) runs tiles of up to PAIR_ROWS rows of x, read as it
// lies (row-major), down two neighbouring panels at once: per k, the two panels' four 16-lane
// vectors and one broadcast of x[m, k] per row, four FMAs per row into 4 x MB accumulators (24
// at 6 rows). Against 12-row tiles down one panel over x first copied into k-major order
// (pack_tiles), this loads 10 vectors per 24 FMAs instead of 14 and copies nothing: on a Zen 4,
// 2 threads, 2016 rows of SmolLM2's matrices, 200-224 GFLOP/s against 186-200 with the copy
// (bench/prefill_gemm.py measures the op). Six rows at K floats apart stay clear of the L1
// aliasing that made the copy worth it at 12 rows (K = 2048: 212-222 against 186-195).
// Each output still sums over k in order with fused multiply-adds from zero, then adds the
// bias: the same bits as the one-panel tiles and the decode path.
constexpr int PAIR_ROWS = 6;

template <int MB, typename WT>
void pair_tile(const float* x, int64_t K, const WT* w0p, const WT* w1p, float* y, int64_t N,
               int64_t n0, const float* b) {
  if (w1p == nullptr) {  // an odd panel count's last panel
    panel_rows<MB, false>(x, K, MB, w0p, y, N, n0, b);
    return;
  }
  V16 acc[MB][4];
  PD_UNROLL for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    wprefetch(w0p, k);
    wprefetch(w1p, k);
    const V16 a0 = wload(w0p + k * PANEL), a1 = wload(w0p + k * PANEL + 16);
    const V16 c0 = wload(w1p + k * PANEL), c1 = wload(w1p + k * PANEL + 16);
    PD_UNROLL for (int m = 0; m < MB; ++m) {
      const V16 xv = vset1(x[m * K + k]);
      acc[m][0] = vfmadd(a0, xv, acc[m][0]);
      acc[m][1] = vfmadd(a1, xv, acc[m][1]);
      acc[m][2] = vfmadd(c0, xv, acc[m][2]);
      acc[m][3] = vfmadd(c1, xv, acc[m][3]);
    }
  }
  const PanelOut out0(N, n0, b), out1(N, n0 + PANEL, b);
  PD_UNROLL for (int m = 0; m < MB; ++m) {
    out0.store(y + m * N, acc[m][0], acc[m][1]);
    out1.store(y + m * N, acc[m][2], acc[m][3]);
  }
}

template <typename WT>
struct Pairs {
  using Fn = void (*)(const float*, int64_t, const WT*, const WT*, float*, int64_t, int64_t,
                      const float*);
  static constexpr Fn FN[PAIR_ROWS] = {pair_tile<1, WT>, pair_tile<2, WT>, pair_tile<3, WT>,
                                       pair_tile<4, WT>, pair_tile<5, WT>, pair_tile<6, WT>};
};
#else
// AVX2 has 16 registers, and a V16 is two of them: the tile runs as passes of up to ROWS2 rows
// (4 x ROWS2 accumulators, the panel's 4 registers, one broadcast), each reading the panel's
// 128-byte stretches in order; the first pass streams the panel from memory, the others find it
// in L2. (Passes over one 64-byte half at a time, as before, read memory at a 128-byte stride
// and measured 2.4x slower than AVX-512 on a Zen 4, whose FMA units are 256 bits wide either
// way.) Every output sums as the AVX-512 tile sums it.
constexpr int ROWS2 = PD_AVX2_ROWS;
constexpr int64_t KBLOCK = 64;  // k per block of a many-pass tile: 8 KB of the panel, in L1

// MB rows down k in [k0, k1) of one panel, the 2 x MB accumulators carried in acc (MB x 32
// floats) from one block to the next; PF: this pass prefetches the panel (the first pass of a
// block reads it from memory, the others find it in L1)
template <int MB, bool PK, bool PF, typename WT>
void panel_rows_block(const float* x, int64_t K, int64_t ld, const WT* w, int64_t k0,
                      int64_t k1, float* acc) {
  V16 a[MB][2];
  PD_UNROLL for (int m = 0; m < MB; ++m) {
    a[m][0] = vload(acc + m * PANEL);
    a[m][1] = vload(acc + m * PANEL + 16);
  }
  rows_fma<MB, PK, PF>(a, x, K, ld, w, k0, k1);
  PD_UNROLL for (int m = 0; m < MB; ++m) {
    vstore(acc + m * PANEL, a[m][0]);
    vstore(acc + m * PANEL + 16, a[m][1]);
  }
}
template <bool PK, bool PF, typename WT>
struct Passes {
  using Fn = void (*)(const float*, int64_t, int64_t, const WT*, int64_t, int64_t, float*);
  static constexpr Fn ROWS[3] = {panel_rows_block<1, PK, PF, WT>,
                                 panel_rows_block<2, PK, PF, WT>,
                                 panel_rows_block<3, PK, PF, WT>};
};

// A tile of more than ROWS2 rows runs its passes block by block of KBLOCK k: each block of the
// panel is read from memory by the first pass and from L1 by the others, so the later passes'
// FMAs overlap the stream instead of following it (whole-K passes: a decode step's 8 rows read
// memory in one pass, then computed two more from L2 with no read in flight). The accumulators
// go through memory between blocks unrounded: every output sums as the AVX-512 tile sums it.
template <int MB, bool PK, typename WT>
void panel_tile(const float* x, int64_t K, const WT* w, float* y, int64_t N, int64_t n0,
                const float* b) {
  if constexpr (MB <= ROWS2) {
    panel_rows<MB, PK>(x, K, MB, w, y, N, n0, b);
  } else {
    alignas(64) float acc[MB * PANEL] = {};
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
      const int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
      for (int m = 0; m < MB; m += ROWS2) {
        const int rows = MB - m < ROWS2 ? MB - m : ROWS2;
        const float* xm = PK ? x + m : x + m * K;
        (m == 0 ? Passes<PK, true, WT>::ROWS : Passes<PK, false, WT>::ROWS)[rows - 1](
            xm, K, MB, w, k0, k1, acc + m * PANEL);
      }
    }
    const PanelOut out(N, n0, b);
    for (int m = 0; m < MB; ++m)
      out.store(y + m * N, vload(acc + m * PANEL), vload(acc + m * PANEL + 16));
  }
}
#endif

template <bool PK, typename WT>
struct Tiles {
  using Fn = void (*)(const float*, int64_t, const WT*, float*, int64_t, int64_t, const float*);
  static constexpr Fn FN[TILE] = {
      panel_tile<1, PK, WT>, panel_tile<2, PK, WT>,  panel_tile<3, PK, WT>,
      panel_tile<4, PK, WT>, panel_tile<5, PK, WT>,  panel_tile<6, PK, WT>,
      panel_tile<7, PK, WT>, panel_tile<8, PK, WT>,  panel_tile<9, PK, WT>,
      panel_tile<10, PK, WT>, panel_tile<11, PK, WT>, panel_tile<12, PK, WT>};
};

// How an M-row GEMM's rows split: blocks of at most 16 tiles, equal in size (256 rows run as
// 128 + 128, not 192 + 64, so two threads sharing out (block, panel) items get equal work: the
// unequal split measured 136 against 204 GFLOP/s), and within a block balanced tiles (13 rows
// run as 7 + 6, not 12 + 1). tiles[i] = (first row, rows); block b holds tiles
// [first[b], first[b + 1]).
struct Tiling {
  std::vector<std::pair<int64_t, int>> tiles;
  std::vector<int64_t> first;

  explicit Tiling(int64_t M, int tile = TILE) {
    const int64_t most = tile * 16;
    const int64_t blocks = (M + most - 1) / most;
    first.push_back(0);
    for (int64_t bi = 0; bi < blocks; ++bi) {
      const int64_t m0 = M * bi / blocks, m1 = M * (bi + 1) / blocks;
      const int64_t n = (m1 - m0 + tile - 1) / tile;
      for (int64_t t = 0, m = m0; t < n; ++t) {
        const int64_t rows = (m1 - m + (n - t) - 1) / (n - t);
        tiles.emplace_back(m, static_cast<int>(rows));
        m += rows;
      }
      first.push_back(static_cast<int64_t>(tiles.size()));
    }
  }
  int64_t blocks() const { return static_cast<int64_t>(first.size()) - 1; }
};

// Runs tile(m, rows, p) over every (tile of rows, panel) of an M-row GEMM with P panels, in
// parallel. Work items are (block of rows, panel): a decode step has one block, so its panels
// are shared out; a prefill's rows come in blocks (Tiling), each block's rows (in L2) run down
// one panel after another.
template <typename Tile>
void for_tiles(const Tiling& tiling, int64_t P, const Tile& tile) {
  if (tiling.tiles.empty()) return;
  at::parallel_for(0, P * tiling.blocks(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t mb = i / P, p = i % P;
      for (int64_t t = tiling.first[mb]; t < tiling.first[mb + 1]; ++t)
        tile(tiling.tiles[t].first, tiling.tiles[t].second, p);
    }
  });
}

// x [M, K] copied tile by tile into k-major order: tile (m, rows) at offset m * K holds
// x[m + r, k] at k * rows + r
Tensor pack_tiles(const Tensor& x, const Tiling& tiling) {
  const int64_t K = x.size(1);
  Tensor out = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(tiling.tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto [m, rows] = tiling.tiles[t];
      const float* s = src + m * K;
      float* d = dst + m * K;
      for (int64_t k0 = 0; k0 < K; k0 += 64) {  // 64 k at a time: rows x 256 bytes in L1
        const int64_t k1 = std::min(K, k0 + 64);
        for (int r = 0; r < rows; ++r)
          for (int64_t k = k0; k < k1; ++k) d[k * rows + r] = s[r * K + k];
      }
    }
  });
  return out;
}

// y viewed with x's leading dimensions
Tensor with_lead(const Tensor& y, const Tensor& x_in) {
  if (x_in.dim() == 2) return y;
  auto shape = x_in.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);
}

// y [M, N] = x [M, K] float32 down panels of WT (float32 or bf16 widened), + b (null: none)
template <typename WT>
void panel_gemm(Tensor x, const WT* wp, int64_t P, float* yp, int64_t N, const float* bp) {
  const int64_t K = x.size(1), M = x.size(0);
#if defined(PD_ISA_AVX512)
  if (M > TILE) {  // more than one tile: pairs of panels (pair_tile)
    const float* xr = x.data_ptr<float>();
    const int64_t pairs = (P + 1) / 2;
    for_tiles(Tiling(M, PAIR_ROWS), pairs, [&](int64_t m, int64_t rows, int64_t q) {
      const WT* w0p = wp + 2 * q * K * PANEL;
      Pairs<WT>::FN[rows - 1](xr + m * K, K, w0p, 2 * q + 1 < P ? w0p + K * PANEL : nullptr,
                              yp + m * N, N, 2 * q * PANEL, bp);
    });
    return;
  }
#endif
  const Tiling tiling(M);
  const bool pk = tiling.tiles.size() > 1;  // one tile (a decode step) reads x as it is
  if (pk) x = pack_tiles(x, tiling);
  const float* xp = x.data_ptr<float>();
  const auto* fn = pk ? Tiles<true, WT>::FN : Tiles<false, WT>::FN;
  for_tiles(tiling, P, [&](int64_t m, int64_t rows, int64_t p) {
    fn[rows - 1](xp + m * K, K, wp + p * K * PANEL, yp + m * N, N, p * PANEL, bp);
  });
}

// x [..., K] float32, panels [ceil(N / 32), K, 32] float32 or bf16, b [N] or empty
Tensor panel_linear(const Tensor& x_in, const Tensor& panels, int64_t N,
                    const std::optional<Tensor>& b) {
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(panel_gemm_supported(), "the panel GEMM needs AVX2 and FMA");
  const auto wt = panels.scalar_type();
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && (wt == at::kFloat || wt == at::kBFloat16),
              "the panel GEMM takes float32 x and float32 or bf16 panels");
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == K && panels.size(2) == PANEL &&
                  panels.size(0) * PANEL >= N && panels.is_contiguous(),
              "panels do not match the input");
  Tensor x = x_in.reshape({-1, K}).contiguous();
  Tensor y = at::empty({x.size(0), N}, x.options());
  const float* bp = nullptr;
  Tensor bc;
  if (b.has_value() && b->defined() && b->numel() > 0) {
    bc = b->to(at::kFloat).contiguous();
    bp = bc.data_ptr<float>();
  }
  if (wt == at::kFloat)
    panel_gemm(x, panels.data_ptr<float>(), panels.size(0), y.data_ptr<float>(), N, bp);
  else
    panel_gemm(x, reinterpret_cast<const uint16_t*>(panels.data_ptr()), panels.size(0),
               y.data_ptr<float>(), N, bp);
  return with_lead(y, x_in);
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
