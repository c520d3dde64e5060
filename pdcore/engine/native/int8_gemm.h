#pragma once
// W8A8 int8 GEMM (engine/model/quant.py): y[m, n] = s_x[m] * s_w[n] * sum_k x_q[m, k] w_q[n, k]
// (+ b[n]), the sum in int32 (exact), x_q each row of x quantized on its own (symmetric,
// max|x| / 127, round half to even, [-127, 127]: quant.quantize_rows, bit for bit), the scales
// applied after in float32 in torch's order (acc.float() * s_x * s_w + b), so the result equals
// quant.Int8Weight's torch path (torch._int_mm) to the bit.
//
// The weight is packed once at load (`int8_pack`): panels of 32 output channels, int8
// [ceil(N / 32), Kp * 32 + 256] with Kp = K rounded up to 4. A panel holds, for each group of 4
// k, the 32 channels' 4 consecutive weights (128 bytes: one 64-byte line per 16 channels), then
// 32 int32 (128 * sum_k w[n, k], the u8 paths' correction) and 32 float32 (s_w). Three paths,
// one layout:
// - AMX (AMX-INT8, in the avx512 library where the CPU has amx_int8 and Linux grants the tile
//   state; path 3): the panel's 64 k (16 groups of 4) of 16 channels are tdpbusd's B tile as
//   they lie (16 lines of 64 bytes, 128 apart), so 32 rows x one panel is 4 int32 tiles, 2 A
//   tiles of u8 x (as VNNI's) and the 2 B tiles; the same correction and epilogue as VNNI
//   (i8_tile_amx below). Measured (bench/amx_int8.py, Xeon with AMX, 2 threads, the whole layer
//   with the quantization, load 3.5-4): 2.2-3.5 TOPS from 64 rows up against VNNI's 0.9-1.3
//   and oneDNN's torch._int_mm 1.0-4.1 (int32 GEMM alone). Decode sizes stream the weight:
//   at 1-2 rows AMX is not faster (within -8%..+15% of VNNI over the 8 shapes, load 6-7,
//   bench/results/amx_int8_smallm.json), from 4 rows up it is as fast or faster (SmolLM2
//   gate_up 873 against 673 GOPS at 4 rows, 1560 against 874 at 8; the 1B shapes -7%..+11%),
//   so below 4 rows (int8_amx_min_rows) the AMX path runs VNNI (the same u8 rows: the same sums);
// - VNNI (AVX-512 VNNI, in the avx512 library where the CPU has avx512_vnni; 2): vpdpbusd adds the
//   4 products of unsigned x bytes and signed w bytes of each 32-bit lane to an int32
//   accumulator, no intermediate saturation; x goes in as x_q + 128 (0..255) and the correction
//   takes 128 * sum_k w back off. A tile of up to 12 rows runs down one panel: per 4 k, two
//   64-byte loads of the panel, one broadcast of the row's 4 bytes, two vpdpbusd per row;
// - AVX2 (both libraries; the only one without AVX-512 VNNI; 1): vpmaddubsw multiplies |w| (0..128
//   as unsigned) by x_q with w's sign (sign_epi8), adding pairs into int16 (at most 2 * 128 * 127
//   = 32512: no saturation, which is why x_q stops at -127), and vpmaddwd by 1 adds those pairs
//   into int32. Passes of up to 3 rows (16 ymm registers) down each 8-channel quarter.
// The raw integer product (`int8_gemm`, int32 out) is what the tests compare with torch._int_mm.
// Work is shared out as the float panel GEMM's (gemm.h: Tiling, for_tiles): a decode step's
// panels between the threads, a prefill's blocks of rows down one panel after another (AMX:
// tiles of 32 rows, blocks of 16 tiles).
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cerrno>

#include "common.h"
#include "gemm.h"

namespace {

constexpr int64_t I8_PANEL = 32;               // output channels per panel
constexpr int64_t I8_TAIL = I8_PANEL * 4 * 2;  // per panel after the weights: int32 x 32, float x 32
constexpr int I8_ROWS2 = 3;                    // rows per AVX2 pass
// prefetch distance in groups of 4 k: 8 KB ahead, into the thread's next panel near a panel's
// end. At 1 KB (8 groups) a decode step's GEMMs stalled on their weight loads (perf: two thirds
// of i8_tile_vnni<8>'s samples on the panel's two loads); SmolLM2 W8A8 batch 8 on a loaded Zen 5
// (#48, s11), the 120 body GEMMs of a step: 4.66 ms at 1 KB, 3.92 at 4 KB, 3.63-3.77 at 8 KB,
// 3.97 at 16 KB (medians of 14, alternating in one process). Prefetching changes no sum.
constexpr int64_t I8_PF = 64;

inline int64_t i8_kp(int64_t K) { return (K + 3) / 4 * 4; }
inline int64_t i8_panel_bytes(int64_t K) { return i8_kp(K) * I8_PANEL + I8_TAIL; }

bool int8_vnni_supported() {
#if defined(PD_ISA_AVX512)
  static const bool ok = isa_supported() && __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

// Whether this process runs the AMX path: the avx512 library, a CPU with amx_tile and amx_int8
// (CPUID 7.0 EDX bits 24, 25) and avx512_vnni (small M and the epilogue), and Linux's permission
// for the tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once per
// process: without it the first tile instruction faults); `why` says what is missing
struct I8AmxState {
  bool ok;
  std::string why;
};

const I8AmxState& i8_amx_state() {
  static const I8AmxState s = []() -> I8AmxState {
#if defined(PD_ISA_AVX512) && defined(__linux__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1))
      return {false, "the CPU lacks amx_tile / amx_int8"};
    if (!int8_vnni_supported()) return {false, "the CPU lacks avx512_vnni"};
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
      return {false, std::string("Linux refused the AMX tile permission (arch_prctl "
                                 "ARCH_REQ_XCOMP_PERM: ") + std::strerror(errno) + ")"};
    return {true, ""};
#else
    return {false, "only the avx512 library on Linux has the AMX path"};
#endif
  }();
  return s;
}

bool int8_amx_supported() { return i8_amx_state().ok; }
std::string int8_amx_why() { return i8_amx_state().why; }

// 3 (AMX) or 2 (VNNI) where this library and CPU run it, else 1 (AVX2)
int64_t int8_best_path() { return int8_amx_supported() ? 3 : int8_vnni_supported() ? 2 : 1; }

// the path that `path` 0 means: at first the best, then what int8_set_path set (native/
// __init__.py's int8_path(): the decode loop's GEMMs and fused quantization take it too)
int64_t& int8_default_path() {
  static int64_t path = int8_best_path();
  return path;
}

int64_t int8_resolve_path(int64_t path) {
  TORCH_CHECK(isa_supported(), "the int8 GEMM needs AVX2 and FMA");
  if (path == 0) return int8_default_path();
  TORCH_CHECK(path >= 1 && path <= 3, "int8 GEMM path: 0 (the process's), 1 (avx2), 2 (vnni) ",
              "or 3 (amx), got ", path);
  TORCH_CHECK(path != 2 || int8_vnni_supported(),
              "the VNNI int8 path needs the avx512 library on a CPU with avx512_vnni");
  TORCH_CHECK(path != 3 || int8_amx_supported(), "the AMX int8 path: ", int8_amx_why());
  return path;
}

// sets the path int8_linear(path 0) and the decode loop take; returns the one in force
int64_t int8_set_path(int64_t path) {
  if (path != 0) int8_default_path() = int8_resolve_path(path);
  return int8_default_path();
}

// whether `path` quantizes x as u8 bytes (x_q + 128: VNNI's vpdpbusd, AMX's tdpbusd)
inline bool i8_u8(int64_t path) { return path >= 2; }

// Below this many rows (4) a GEMM on the AMX path runs VNNI (the same u8 rows and correction:
// the same int32 sums): AMX is not faster there (the numbers above). int8_amx_min_rows(m) sets
// it (m > 0; tests: 1 runs the tiles at every M) and returns the one in force
int64_t& i8_amx_min_m() {
  static int64_t m = 4;
  return m;
}

int64_t int8_amx_min_rows(int64_t m) {
  if (m > 0) i8_amx_min_m() = m;
  return i8_amx_min_m();
}

inline int64_t i8_gemm_path(int64_t path, int64_t M) {
  return path == 3 && M < i8_amx_min_m() ? 2 : path;
}

// q int8 [N, K], scale float [N] (or [N, 1]) -> the panels described above
Tensor int8_pack(const Tensor& q_in, const Tensor& scale_in) {
  TORCH_CHECK(q_in.scalar_type() == at::kChar && q_in.dim() == 2, "int8_pack takes an int8 matrix");
  const Tensor q = q_in.contiguous();
  const Tensor scale = scale_in.reshape({-1}).to(at::kFloat).contiguous();
  const int64_t N = q.size(0), K = q.size(1), Kp = i8_kp(K);
  TORCH_CHECK(scale.numel() == N, "int8_pack: ", scale.numel(), " scales for ", N, " channels");
  const int64_t P = (N + I8_PANEL - 1) / I8_PANEL, bytes = i8_panel_bytes(K);
  Tensor out = at::zeros({P, bytes}, q.options());
  const int8_t* src = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int8_t* panel = dst + p * bytes;
      int32_t comp[I8_PANEL] = {};
      float sc[I8_PANEL] = {};
      for (int64_t c = 0; c < I8_PANEL && p * I8_PANEL + c < N; ++c) {
        const int8_t* row = src + (p * I8_PANEL + c) * K;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          panel[(k / 4) * I8_PANEL * 4 + c * 4 + k % 4] = row[k];
          sum += row[k];
        }
        comp[c] = 128 * sum;
        sc[c] = sp[p * I8_PANEL + c];
      }
      std::memcpy(panel + Kp * I8_PANEL, comp, sizeof(comp));
      std::memcpy(panel + Kp * I8_PANEL + sizeof(comp), sc, sizeof(sc));
    }
  });
  return out;
}

// the first `valid` of 8 int32 lanes as an all-ones mask (AVX2 masked stores)
inline __m256i i8_mask8(int64_t valid) {
  const int v = static_cast<int>(valid < 0 ? 0 : valid > 8 ? 8 : valid);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Where a tile's results go: int32 sums (RAW) or the scaled float32 outputs (+ bias)
struct I8Out {
  void* y;          // [M, N]: int32 (raw) or float32
  int64_t N;
  const float* xs;  // per row s_x (null: raw)
  const float* b;   // bias or null
};

#if defined(PD_ISA_AVX512)
// acc + the 4-byte dot products of u (unsigned) and s (signed) per 32-bit lane (vpdpbusd), in
// inline assembly: with the intrinsic, GCC 12 copied each of a 12-row tile's 24 accumulators
// through another register and stored it to the stack on every step of the k loop (spilling
// from 8 rows up; measured 180 GOPS a core at M = 512 against oneDNN's 290), while the
// instruction itself updates its accumulator in place
__attribute__((target("avx512f,avx512vnni"))) inline __m512i i8_dpbusd(__m512i acc, __m512i u,
                                                                          __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// The u8 paths' epilogue (VNNI, AMX), one panel's 32 channels: a row's two int32 sums less the
// correction (128 * sum_k w), as they are (raw) or times s_x times s_w (+ b) in float32
struct I8Epi {
  __mmask16 k0, k1;
  __m512i c0, c1;
  __m512 s0, s1, b0, b1;
  int64_t n0;
  I8Epi(const int8_t* panel, int64_t Kp, const I8Out& o, int64_t n) : n0(n) {
    const int32_t* comp = reinterpret_cast<const int32_t*>(panel + Kp * I8_PANEL);
    const float* sw = reinterpret_cast<const float*>(comp + I8_PANEL);
    k0 = lane_mask(o.N - n0);
    k1 = lane_mask(o.N - n0 - 16);
    c0 = _mm512_loadu_si512(comp);
    c1 = _mm512_loadu_si512(comp + 16);
    s0 = _mm512_loadu_ps(sw);
    s1 = _mm512_loadu_ps(sw + 16);
    b0 = o.b ? _mm512_maskz_loadu_ps(k0, o.b + n0) : _mm512_setzero_ps();
    b1 = o.b ? _mm512_maskz_loadu_ps(k1, o.b + n0 + 16) : _mm512_setzero_ps();
  }
  inline void row(const I8Out& o, int64_t m, __m512i acc0, __m512i acc1) const {
    const __m512i a0 = _mm512_sub_epi32(acc0, c0), a1 = _mm512_sub_epi32(acc1, c1);
    const int64_t at = m * o.N + n0;
    if (o.xs == nullptr) {
      int32_t* y = static_cast<int32_t*>(o.y) + at;
      _mm512_mask_storeu_epi32(y, k0, a0);
      _mm512_mask_storeu_epi32(y + 16, k1, a1);
      return;
    }
    const __m512 xs = _mm512_set1_ps(o.xs[m]);
    __m512 f0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a0), xs), s0);
    __m512 f1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a1), xs), s1);
    if (o.b) {
      f0 = _mm512_add_ps(f0, b0);
      f1 = _mm512_add_ps(f1, b1);
    }
    float* y = static_cast<float*>(o.y) + at;
    _mm512_mask_storeu_ps(y, k0, f0);
    _mm512_mask_storeu_ps(y + 16, k1, f1);
  }
};

// MB rows (u8: x_q + 128, rows Kp bytes apart) down one panel
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))) void i8_tile_vnni(
    const uint8_t* x, int64_t Kp, const int8_t* panel, const I8Out& o, int64_t m0, int64_t n0) {
  __m512i acc[MB][2];
  PD_UNROLL for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  const int64_t G = Kp / 4;
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* w = panel + g * I8_PANEL * 4;
    _mm_prefetch(reinterpret_cast<const char*>(w + I8_PF * I8_PANEL * 4), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + I8_PF * I8_PANEL * 4 + 64), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
    PD_UNROLL for (int m = 0; m < MB; ++m) {
      int32_t four;
      std::memcpy(&four, x + m * Kp + 4 * g, sizeof(four));
      const __m512i xv = _mm512_set1_epi32(four);
      acc[m][0] = i8_dpbusd(acc[m][0], xv, w0);
      acc[m][1] = i8_dpbusd(acc[m][1], xv, w1);
    }
  }
  const I8Epi e(panel, Kp, o, n0);
  PD_UNROLL for (int m = 0; m < MB; ++m) e.row(o, m0 + m, acc[m][0], acc[m][1]);
}

using I8VnniFn = void (*)(const uint8_t*, int64_t, const int8_t*, const I8Out&, int64_t, int64_t);
const I8VnniFn I8_VNNI[TILE] = {i8_tile_vnni<1>, i8_tile_vnni<2>,  i8_tile_vnni<3>,
                                i8_tile_vnni<4>, i8_tile_vnni<5>,  i8_tile_vnni<6>,
                                i8_tile_vnni<7>, i8_tile_vnni<8>,  i8_tile_vnni<9>,
                                i8_tile_vnni<10>, i8_tile_vnni<11>, i8_tile_vnni<12>};

// AMX (path 3): the panel already is tdpbusd's B layout: 16 groups of 4 k (64 k) of one half of
// the panel (16 channels x 4 bytes a line) are a B tile, 16 lines 128 bytes apart. Tiles 0-3
// hold the int32 sums (row block r of 16 rows, half h: tile 2r + h), 4 and 5 the row blocks'
// 64 k of u8 x (rows Kp apart), 6 and 7 the halves' B tiles. A K that is not a multiple of 64
// ends with its last Kp % 64 bytes copied into zero-padded scratch (zero weights: whatever x
// holds past Kp adds 0), so one tile configuration serves every K; rows < 16 configure fewer
// tile rows (the configuration is a thread's: loaded at the start of each thread's share of a
// GEMM (I8AmxCfg), again only where the rows change, and released after).
struct alignas(64) I8TileCfg {  // ldtilecfg's 64 bytes, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct I8AmxCfg {  // a thread's tile configuration for one share of work
  int key = -1;
  __attribute__((target("amx-tile"))) void set(int r0, int r1) {
    if (key == r0 * 32 + r1) return;
    I8TileCfg c;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = static_cast<uint8_t>(rows[t]);
      c.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&c);
    key = r0 * 32 + r1;
  }
  __attribute__((target("amx-tile"))) ~I8AmxCfg() {
    if (key >= 0) _tile_release();
  }
};

constexpr int I8_AMX_ROWS = 32;  // rows per AMX work item (two A tiles)

// GCC 12's tile loads and stores are asm statements that name no memory: without this fence
// it dropped the stores into the scratch the loads read (as dead) and could read the sums
// before the tile stores wrote them
inline void i8_tile_fence(const void* a, const void* b) {
  asm volatile("" : : "r"(a), "r"(b) : "memory");
}

// rows (1..32) of u8 x down one panel
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq"))) void i8_tile_amx(
    const uint8_t* x, int64_t Kp, const int8_t* panel, const I8Out& o, int64_t m0, int rows,
    int64_t n0, I8AmxCfg& cfg) {
  const int r0 = std::min(rows, 16), r1 = rows - r0;
  i8_tile_fence(x, panel);
  cfg.set(r0, r1);
  _tile_zero(0);
  _tile_zero(1);
  if (r1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t KB = Kp / 64, tail = Kp % 64;
  const uint8_t* x1 = x + 16 * Kp;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int8_t* w = panel + kb * 16 * I8_PANEL * 4;
    _tile_loadd(6, w, 128);
    _tile_loadd(7, w + 64, 128);
    _tile_loadd(4, x + kb * 64, Kp);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if (r1) {
      _tile_loadd(5, x1 + kb * 64, Kp);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  }
  if (tail) {
    alignas(64) uint8_t xt[I8_AMX_ROWS * 64];
    alignas(64) int8_t wt[16 * I8_PANEL * 4];
    std::memset(xt, 0, sizeof(xt));
    std::memset(wt, 0, sizeof(wt));
    for (int r = 0; r < rows; ++r) std::memcpy(xt + r * 64, x + r * Kp + KB * 64, tail);
    std::memcpy(wt, panel + KB * 16 * I8_PANEL * 4, tail / 4 * I8_PANEL * 4);
    i8_tile_fence(xt, wt);
    _tile_loadd(6, wt, 128);
    _tile_loadd(7, wt + 64, 128);
    _tile_loadd(4, xt, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if (r1) {
      _tile_loadd(5, xt + 16 * 64, 64);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  }
  alignas(64) int32_t acc[I8_AMX_ROWS * I8_PANEL];
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  if (r1) {
    _tile_stored(2, acc + 16 * I8_PANEL, 128);
    _tile_stored(3, acc + 16 * I8_PANEL + 16, 128);
  }
  i8_tile_fence(acc, acc);
  const I8Epi e(panel, Kp, o, n0);
  for (int m = 0; m < rows; ++m)
    e.row(o, m0 + m, _mm512_load_si512(acc + m * I8_PANEL),
          _mm512_load_si512(acc + m * I8_PANEL + 16));
}
#else
struct I8AmxCfg {};
constexpr int I8_AMX_ROWS = TILE;
#endif

// MB (<= 3) rows (int8 x_q, rows Kp bytes apart) down one panel, 8 channels (a quarter) at a time
template <int MB>
void i8_rows_avx2(const int8_t* x, int64_t Kp, const int8_t* panel, const I8Out& o, int64_t m0,
                  int64_t n0, bool prefetch) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t G = Kp / 4;
  __m256i acc[MB][4];
  PD_UNROLL for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] =
      _mm256_setzero_si256();
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* w = panel + g * I8_PANEL * 4;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + I8_PF * I8_PANEL * 4), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + I8_PF * I8_PANEL * 4 + 64), _MM_HINT_T0);
    }
    PD_UNROLL for (int q = 0; q < 4; ++q) {
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * q));
      const __m256i aw = _mm256_abs_epi8(wq);
      PD_UNROLL for (int m = 0; m < MB; ++m) {
        int32_t four;
        std::memcpy(&four, x + m * Kp + 4 * g, sizeof(four));
        const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(four), wq);
        const __m256i pairs = _mm256_maddubs_epi16(aw, xv);
        acc[m][q] = _mm256_add_epi32(acc[m][q], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  const int32_t* comp = reinterpret_cast<const int32_t*>(panel + (Kp * I8_PANEL));
  const float* sw = reinterpret_cast<const float*>(comp + I8_PANEL);
  (void)comp;  // the AVX2 path multiplies x_q itself: no correction
  PD_UNROLL for (int q = 0; q < 4; ++q) {
    const int64_t n = n0 + 8 * q;
    const __m256i mask = i8_mask8(o.N - n);
    const __m256 s = _mm256_loadu_ps(sw + 8 * q);
    const __m256 b = o.b ? _mm256_maskload_ps(o.b + n, mask) : _mm256_setzero_ps();
    PD_UNROLL for (int m = 0; m < MB; ++m) {
      const int64_t row = (m0 + m) * o.N + n;
      if (o.xs == nullptr) {
        _mm256_maskstore_epi32(static_cast<int32_t*>(o.y) + row, mask, acc[m][q]);
        continue;
      }
      __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][q]),
                                             _mm256_set1_ps(o.xs[m0 + m])), s);
      if (o.b) f = _mm256_add_ps(f, b);
      _mm256_maskstore_ps(static_cast<float*>(o.y) + row, mask, f);
    }
  }
}

using I8Avx2Fn = void (*)(const int8_t*, int64_t, const int8_t*, const I8Out&, int64_t, int64_t,
                          bool);
const I8Avx2Fn I8_AVX2[I8_ROWS2] = {i8_rows_avx2<1>, i8_rows_avx2<2>, i8_rows_avx2<3>};

// One row x [K] float32 quantized into out [Kp] (x_q, or x_q + 128 as bytes for VNNI; the
// padding k hold 0 / 128, against zero weights), returning s_x; as quant.quantize_rows:
// amax = max|x|, s = amax > 0 ? amax / 127 : 1, x_q = clamp(round_half_even(x / s), -127, 127)
inline float i8_quantize_row(const float* row, int64_t K, int64_t Kp, bool u8, int8_t* out) {
  alignas(64) int32_t tmp[16];
  V16 vmaxabs = vzero();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const V16 v = vload(row + k);
    vmaxabs = vmax(vmaxabs, vmax(v, vneg(v)));
  }
  float amax = vreduce_max(vmaxabs);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
  const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
  const int32_t off = u8 ? 128 : 0;
  const V16 vs = vset1(s), lo = vset1(-127.0f), hi = vset1(127.0f);
  for (k = 0; k + 16 <= K; k += 16) {
    const V16 v = vload(row + k);
#if defined(PD_ISA_AVX512)
    const V16 q = vmin(vmax(vround({_mm512_div_ps(v.v, vs.v)}), lo), hi);
    const __m512i qi = _mm512_add_epi32(_mm512_cvtps_epi32(q.v), _mm512_set1_epi32(off));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(qi));
#else
    const V16 q = vmin(vmax(vround({_mm256_div_ps(v.lo, vs.lo), _mm256_div_ps(v.hi, vs.hi)}),
                            lo), hi);
    const __m256i o8 = _mm256_set1_epi32(off);
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp),
                       _mm256_add_epi32(_mm256_cvtps_epi32(q.lo), o8));
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8),
                       _mm256_add_epi32(_mm256_cvtps_epi32(q.hi), o8));
    for (int i = 0; i < 16; ++i) out[k + i] = static_cast<int8_t>(tmp[i]);
#endif
  }
  (void)tmp;
  for (; k < K; ++k) {
    const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(row[k] / s)));
    out[k] = static_cast<int8_t>(static_cast<int32_t>(q) + off);
  }
  for (k = K; k < Kp; ++k) out[k] = static_cast<int8_t>(off);
  return s;
}

// Each row of x [M, K] float32 quantized into xq [M, Kp] and xs [M] (i8_quantize_row)
void i8_quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, bool u8, int8_t* xq,
                      float* xs) {
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) xs[r] = i8_quantize_row(x + r * K, K, Kp, u8, xq + r * Kp);
  });
}

// the rows [m, m + rows) of xq [M, Kp] down panel p into o: one work item of i8_gemm (and of
// the decode step's team region, team_step.h); rows <= 32 on the AMX path (path 3, which takes
// the thread's tile configuration `cfg`), <= 12 on the others
inline void i8_gemm_item(const int8_t* xq, int64_t Kp, const int8_t* wp, int64_t path,
                         const I8Out& o, int64_t m, int64_t rows, int64_t p, I8AmxCfg& cfg) {
  const int64_t bytes = Kp * I8_PANEL + I8_TAIL;
#if defined(PD_ISA_AVX512)
  if (path == 3) {
    i8_tile_amx(reinterpret_cast<const uint8_t*>(xq) + m * Kp, Kp, wp + p * bytes, o, m,
                static_cast<int>(rows), p * I8_PANEL, cfg);
    return;
  }
  if (path == 2) {
    I8_VNNI[rows - 1](reinterpret_cast<const uint8_t*>(xq) + m * Kp, Kp, wp + p * bytes, o, m,
                      p * I8_PANEL);
    return;
  }
#endif
  for (int64_t r = 0; r < rows; r += I8_ROWS2) {
    const int64_t n = std::min<int64_t>(I8_ROWS2, rows - r);
    I8_AVX2[n - 1](xq + (m + r) * Kp, Kp, wp + p * bytes, o, m + r, p * I8_PANEL, r == 0);
  }
}

// the GEMM of quantized rows xq [M, Kp] down the panels into o: for_tiles's work split, each
// thread's share under one tile configuration on the AMX path (32-row tiles there)
void i8_gemm(const int8_t* xq, int64_t M, int64_t Kp, const int8_t* wp, int64_t P, int64_t path,
             const I8Out& o) {
  path = i8_gemm_path(path, M);
  const Tiling tiling = path == 3 ? Tiling(M, I8_AMX_ROWS) : Tiling(M);
  if (tiling.tiles.empty()) return;
  at::parallel_for(0, P * tiling.blocks(), 1, [&](int64_t i0, int64_t i1) {
    I8AmxCfg cfg;
    tiles_of_share(tiling, P, i0, i1, [&](int64_t m, int64_t rows, int64_t p) {
      i8_gemm_item(xq, Kp, wp, path, o, m, rows, p, cfg);
    });
  });
}

void i8_check(const Tensor& packed, int64_t K, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) == i8_panel_bytes(K) && packed.size(0) * I8_PANEL >= N &&
                  (packed.size(0) - 1) * I8_PANEL < N,
              "the int8 panels do not match the input (K ", K, ", N ", N, ")");
}

// x [..., K] float32 or bfloat16 -> y [..., N] in x's dtype: the W8A8 linear layer
Tensor int8_linear(const Tensor& x_in, const Tensor& packed, int64_t N,
                   const std::optional<Tensor>& b, int64_t path) {
  path = int8_resolve_path(path);
  const int64_t K = x_in.size(-1), Kp = i8_kp(K);
  i8_check(packed, K, N);
  const Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  Tensor y = at::empty({M, N}, x.options());
  Tensor xq = at::empty({M, Kp}, x.options().dtype(at::kChar));
  Tensor xs = at::empty({M}, x.options());
  Tensor bc;
  if (b.has_value() && b->defined() && b->numel() > 0) bc = b->to(at::kFloat).contiguous();
  i8_quantize_rows(x.data_ptr<float>(), M, K, Kp, i8_u8(path), xq.data_ptr<int8_t>(),
                   xs.data_ptr<float>());
  const I8Out o{y.data_ptr<float>(), N, xs.data_ptr<float>(),
                bc.defined() ? bc.data_ptr<float>() : nullptr};
  i8_gemm(xq.data_ptr<int8_t>(), M, Kp, packed.data_ptr<int8_t>(), packed.size(0), path, o);
  y = with_lead(y, x_in);
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// xq int8 [M, K] (each in [-127, 127]) -> int32 [M, N]: sum_k xq[m, k] w[n, k], exact
Tensor int8_gemm(const Tensor& xq_in, const Tensor& packed, int64_t N, int64_t path) {
  path = int8_resolve_path(path);
  TORCH_CHECK(xq_in.scalar_type() == at::kChar && xq_in.dim() == 2, "int8_gemm takes int8 rows");
  const int64_t M = xq_in.size(0), K = xq_in.size(1), Kp = i8_kp(K);
  i8_check(packed, K, N);
  TORCH_CHECK(M == 0 || xq_in.min().item<int8_t>() >= -127,
              "int8_gemm: activations must lie in [-127, 127] (the AVX2 path negates them)");
  Tensor xq = at::full({M, Kp}, i8_u8(path) ? -128 : 0, xq_in.options());  // 128 as a byte
  if (i8_u8(path)) {
    xq.slice(1, 0, K).copy_(xq_in.to(at::kInt).add(128).to(at::kByte).view(at::kChar));
  } else {
    xq.slice(1, 0, K).copy_(xq_in);
  }
  Tensor y = at::empty({M, N}, xq_in.options().dtype(at::kInt));
  const I8Out o{y.data_ptr<int32_t>(), N, nullptr, nullptr};
  i8_gemm(xq.data_ptr<int8_t>(), M, Kp, packed.data_ptr<int8_t>(), packed.size(0), path, o);
  return y;
}

}  // namespace
