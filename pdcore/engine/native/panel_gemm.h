#pragma once
// The float32 GEMM over weight panels (float32 or bf16 widened): decode steps and prefills
#include "common.h"

namespace {

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
// A tile runs k in [k0, k1), one block of K (pair_gemm): the accumulators start from zero at
// k0 = 0, else from the partial sums the block before stored in y (float32, as the registers
// hold them); the last block adds the bias and stores the outputs. So each output still sums
// over k in order with fused multiply-adds from zero, then adds the bias: the same bits as
// unblocked, as the one-panel tiles and as the decode path.
constexpr int PAIR_ROWS = 6;

// MB rows down NP (1: an odd panel count's last panel, or 2) panels from w0p, k in [k0, k1)
template <int MB, int NP, typename WT>
void pair_tile(const float* x, int64_t K, const WT* w0p, float* y, int64_t N, int64_t n0,
               const float* b, int64_t k0, int64_t k1) {
  const WT* w1p = NP == 2 ? w0p + K * PANEL : w0p;
  M16 mask[2 * NP];
  PD_UNROLL for (int j = 0; j < 2 * NP; ++j) mask[j] = lane_mask(N - n0 - 16 * j);
  V16 acc[MB][2 * NP];
  PD_UNROLL for (int m = 0; m < MB; ++m) PD_UNROLL for (int j = 0; j < 2 * NP; ++j)
    acc[m][j] = k0 == 0 ? vzero() : vmaskz_load(mask[j], y + m * N + n0 + 16 * j);
  for (int64_t k = k0; k < k1; ++k) {
    wprefetch(w0p, k);
    if constexpr (NP == 2) wprefetch(w1p, k);
    V16 w[2 * NP];
    w[0] = wload(w0p + k * PANEL);
    w[1] = wload(w0p + k * PANEL + 16);
    if constexpr (NP == 2) {
      w[2] = wload(w1p + k * PANEL);
      w[3] = wload(w1p + k * PANEL + 16);
    }
    PD_UNROLL for (int m = 0; m < MB; ++m) {
      const V16 xv = vset1(x[m * K + k]);
      PD_UNROLL for (int j = 0; j < 2 * NP; ++j) acc[m][j] = vfmadd(w[j], xv, acc[m][j]);
    }
  }
  if (k1 < K) {  // partial sums, unrounded, for the next block
    PD_UNROLL for (int m = 0; m < MB; ++m) PD_UNROLL for (int j = 0; j < 2 * NP; ++j)
      vmask_store(y + m * N + n0 + 16 * j, mask[j], acc[m][j]);
    return;
  }
  PD_UNROLL for (int p = 0; p < NP; ++p) {
    const PanelOut out(N, n0 + p * PANEL, b);
    PD_UNROLL for (int m = 0; m < MB; ++m) out.store(y + m * N, acc[m][2 * p], acc[m][2 * p + 1]);
  }
}

template <typename WT>
struct Pairs {
  using Fn = void (*)(const float*, int64_t, const WT*, float*, int64_t, int64_t, const float*,
                      int64_t, int64_t);
  static constexpr Fn TWO[PAIR_ROWS] = {pair_tile<1, 2, WT>, pair_tile<2, 2, WT>,
                                        pair_tile<3, 2, WT>, pair_tile<4, 2, WT>,
                                        pair_tile<5, 2, WT>, pair_tile<6, 2, WT>};
  static constexpr Fn ONE[PAIR_ROWS] = {pair_tile<1, 1, WT>, pair_tile<2, 1, WT>,
                                        pair_tile<3, 1, WT>, pair_tile<4, 1, WT>,
                                        pair_tile<5, 1, WT>, pair_tile<6, 1, WT>};
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

  explicit Tiling(int64_t M, int tile = TILE, int64_t per_block = 16) {
    const int64_t most = tile * per_block;
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
// tile(m, rows, p) over the work items [i0, i1) of that split: one thread's share (for_tiles's,
// or a team region's: team_step.h)
template <typename Tile>
void tiles_of_share(const Tiling& tiling, int64_t P, int64_t i0, int64_t i1, const Tile& tile) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t mb = i / P, p = i % P;
    for (int64_t t = tiling.first[mb]; t < tiling.first[mb + 1]; ++t)
      tile(tiling.tiles[t].first, tiling.tiles[t].second, p);
  }
}

template <typename Tile>
void for_tiles(const Tiling& tiling, int64_t P, const Tile& tile) {
  if (tiling.tiles.empty()) return;
  at::parallel_for(0, P * tiling.blocks(), 1,
                   [&](int64_t i0, int64_t i1) { tiles_of_share(tiling, P, i0, i1, tile); });
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

#if defined(PD_ISA_AVX512)
// A prefill's blocks: rows in blocks of at most `block_tiles` tiles (Tiling), and K in blocks of
// at most `kblock` k, equal in size (multiples of 16 k). A thread takes (block of rows, pair of
// panels) items as before, and runs its items of one block of rows in groups of `group` pairs,
// each group K block by K block: per K block, every pair of the group, per pair every tile of
// the block. So the pair's K block (KB x 256 bytes) stays in L2 across the block's tiles, the
// rows' K block (rows x KB x 4 bytes) across the group's pairs, and the group's partial sums
// (rows x 64 x 4 bytes a pair) between K blocks, where whole panels (256 KB a pair per 1024 k:
// 2 MB for the 1B's down projection, K = 8192) fell out of a 1-2 MB L2 between tiles (and
// partial sums of a whole row of y went out to L3: 1B gate_up, N = 16384, 0.5-0.8x at
// KB 64-512). panel_tuning sets the three (a bench's knob: bench/panel_kblock.py; a kblock of K
// or more runs K whole, the order before).
#ifndef PD_KBLOCK
#define PD_KBLOCK 2048
#endif
#ifndef PD_KGROUP
#define PD_KGROUP 4
#endif
struct PanelTuning {
  int64_t kblock = PD_KBLOCK, block_tiles = 16, group = PD_KGROUP;
};
inline PanelTuning& panel_tuning_now() {
  static PanelTuning t;
  return t;
}
#endif

// (kblock, block_tiles, group) now, after setting each given above 0 (the AVX2 library: none)
std::vector<int64_t> panel_tuning(int64_t kblock, int64_t block_tiles, int64_t group) {
#if defined(PD_ISA_AVX512)
  PanelTuning& t = panel_tuning_now();
  if (kblock > 0) t.kblock = kblock;
  if (block_tiles > 0) t.block_tiles = block_tiles;
  if (group > 0) t.group = group;
  return {t.kblock, t.block_tiles, t.group};
#else
  return {};
#endif
}

#if defined(PD_ISA_AVX512)
template <typename WT>
void pair_gemm(const float* x, int64_t M, int64_t K, const WT* wp, int64_t P, float* y,
               int64_t N, const float* b) {
  const PanelTuning tune = panel_tuning_now();
  const Tiling tiling(M, PAIR_ROWS, tune.block_tiles);
  const int64_t nk = (K + tune.kblock - 1) / tune.kblock;
  const int64_t kb = ((K + nk - 1) / nk + 15) / 16 * 16;
  const int64_t Q = (P + 1) / 2;  // pairs (the last one panel where P is odd)
  at::parallel_for(0, Q * tiling.blocks(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t mb = i0 / Q; mb * Q < i1; ++mb) {
      const int64_t q0 = std::max(i0, mb * Q) - mb * Q, q1 = std::min(i1, mb * Q + Q) - mb * Q;
      for (int64_t g0 = q0; g0 < q1; g0 += tune.group) {
        const int64_t g1 = std::min(q1, g0 + tune.group);
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
          const int64_t k1 = std::min(K, k0 + kb);
          for (int64_t q = g0; q < g1; ++q) {
            const auto* fn = 2 * q + 1 < P ? Pairs<WT>::TWO : Pairs<WT>::ONE;
            for (int64_t t = tiling.first[mb]; t < tiling.first[mb + 1]; ++t) {
              const auto [m, rows] = tiling.tiles[t];
              fn[rows - 1](x + m * K, K, wp + 2 * q * K * PANEL, y + m * N, N, 2 * q * PANEL,
                           b, k0, k1);
            }
          }
        }
      }
    }
  });
}
#endif

// y [M, N] = x [M, K] float32 down panels of WT (float32 or bf16 widened), + b (null: none)
template <typename WT>
void panel_gemm(Tensor x, const WT* wp, int64_t P, float* yp, int64_t N, const float* bp) {
  const int64_t K = x.size(1), M = x.size(0);
#if defined(PD_ISA_AVX512)
  if (M > TILE) {  // more than one tile: pairs of panels, in blocks of rows and of K
    pair_gemm(x.data_ptr<float>(), M, K, wp, P, yp, N, bp);
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

}  // namespace
