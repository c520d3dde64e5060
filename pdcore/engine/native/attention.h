#pragma once
#include "attn_block.h"
#include "bf16_attn.h"
#include "common.h"
#include "fp8_load.h"

namespace {

// ---- decode attention: q [B, KVH, G, D] against k, v [B, KVH, W, D] (+ bias [B, 1, 1, W]) ----
// One query token per sequence, the G query heads of a KV head together: per (sequence, KV
// head) and block of AB_KB keys, the scores of every key against the G queries (one pass over
// the block's K), a softmax per query within the block, then one pass over its V; the blocks
// joined in order (attn_block.h: the order every attention path shares, so a row has the same
// bits in prefill, alone, in a group or in parts). CPU SDPA took 145-200 us a layer for
// SmolLM2 at batch 8 (~150-token contexts); this runs in a fraction of it (the closing notes
// of #21 have the numbers). -inf scores (masked positions) weigh exactly 0 (exp_ps, vec.h).

// kernels for head_dim 32 / 64 / 128 / 256 and 1-8 query heads per KV head; SDPA otherwise.
// blocks == nullptr: out [G, D] gets the rows' outputs; else each block's (mb, lb, ob) goes to
// blocks [nblocks, G, D + 2] (a block with no visible key: mb = -inf), joined later (da_split).

constexpr int64_t AT_PFK = 8;  // attend_one's K prefetch distance in keys

template <int DV, int G>
void attend_one(
    const float* q, const float* k, int64_t ksw, const float* v, int64_t vsw,
    const float* bias, int64_t W, float scale, float* out, float* scores, float* blocks) {
  constexpr int64_t D = DV * 16;
  alignas(64) float qs[G * D];  // the queries times the scale (as the prefill kernel's)
  const V16 sv = vset1(scale);
  PD_UNROLL for (int i = 0; i < G * DV; ++i) vstore(qs + i * 16, vmul(vload(q + i * 16), sv));
  float M[G], L[G];
  if (blocks == nullptr) {
    std::fill(out, out + G * D, 0.0f);
    std::fill(M, M + G, -INFINITY);
    std::fill(L, L + G, 0.0f);
  }
  alignas(64) float ob[D];
  // scores[g * AB_KB + j]: KB keys at a time against the G queries (KB x G independent sums)
  constexpr int KB = G <= 4 ? 4 : 2;
  for (int64_t b0 = 0; b0 < W; b0 += AB_KB) {
    const int kn = static_cast<int>(std::min<int64_t>(AB_KB, W - b0));
    int j = 0;
    for (; j + KB <= kn; j += KB) {
      const int64_t w = b0 + j;
      // the V rows this block's V pass reads, and K rows AT_PFK keys ahead: the view's K/V
      // of a batch-8 step (~40 MB at SmolLM2's 100-token contexts) come from memory, and the
      // K pass stalled on its loads without (#48, s11: a W8A8 step 7.75 -> 7.13 ms)
      PD_UNROLL for (int i = 0; i < KB; ++i) {
        const char* vr = reinterpret_cast<const char*>(v + (w + i) * vsw);
        const char* kr = reinterpret_cast<const char*>(k + (w + i + AT_PFK) * ksw);
        PD_UNROLL for (int l = 0; l < DV; ++l) {
          _mm_prefetch(vr + 64 * l, _MM_HINT_T0);
          _mm_prefetch(kr + 64 * l, _MM_HINT_T0);
        }
      }
      V16 acc[KB][G];
      PD_UNROLL for (int i = 0; i < KB; ++i)
        PD_UNROLL for (int g = 0; g < G; ++g) acc[i][g] = vzero();
      PD_UNROLL for (int d = 0; d < DV; ++d) {
        PD_UNROLL for (int i = 0; i < KB; ++i) {
          const V16 kv = vload(k + (w + i) * ksw + d * 16);
          PD_UNROLL for (int g = 0; g < G; ++g)
            acc[i][g] = vfmadd(kv, vload(qs + (g * DV + d) * 16), acc[i][g]);
        }
      }
      PD_UNROLL for (int i = 0; i < KB; ++i) {
        const float add = bias ? bias[w + i] : 0.0f;
        PD_UNROLL for (int g = 0; g < G; ++g)
          scores[g * AB_KB + j + i] = vreduce_add(acc[i][g]) + add;
      }
    }
    for (; j < kn; ++j) {
      const int64_t w = b0 + j;
      V16 acc[G];
      PD_UNROLL for (int g = 0; g < G; ++g) acc[g] = vzero();
      PD_UNROLL for (int d = 0; d < DV; ++d) {
        const V16 kv = vload(k + w * ksw + d * 16);
        PD_UNROLL for (int g = 0; g < G; ++g)
          acc[g] = vfmadd(kv, vload(qs + (g * DV + d) * 16), acc[g]);
      }
      const float add = bias ? bias[w] : 0.0f;
      PD_UNROLL for (int g = 0; g < G; ++g) scores[g * AB_KB + j] = vreduce_add(acc[g]) + add;
    }
    float mb[G], lb[G];
    bool vis[G], any = false;
    PD_UNROLL for (int g = 0; g < G; ++g) {
      vis[g] = ab_softmax(scores + g * AB_KB, kn, kn, mb[g], lb[g]);
      any = any || vis[g];
    }
    float* bp = blocks ? blocks + (b0 / AB_KB) * G * (D + 2) : nullptr;
    if (!any) {  // padding only: nothing to add
      if (bp) PD_UNROLL for (int g = 0; g < G; ++g) bp[g * (D + 2)] = -INFINITY;
      continue;
    }
    V16 acc[G][DV];
    PD_UNROLL for (int g = 0; g < G; ++g)
      PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = vzero();
    for (int i = 0; i < kn; ++i) {
      V16 vr[DV];
      const float* vi = v + (b0 + i) * vsw;
      PD_UNROLL for (int d = 0; d < DV; ++d) vr[d] = vload(vi + d * 16);
      PD_UNROLL for (int g = 0; g < G; ++g) {
        const V16 p = vset1(scores[g * AB_KB + i]);
        PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = vfmadd(vr[d], p, acc[g][d]);
      }
    }
    PD_UNROLL for (int g = 0; g < G; ++g) {
      if (bp) {
        float* dst = bp + g * (D + 2);
        dst[0] = vis[g] ? mb[g] : -INFINITY;
        dst[1] = lb[g];
        PD_UNROLL for (int d = 0; d < DV; ++d) vstore(dst + 2 + d * 16, acc[g][d]);
      } else if (vis[g]) {
        PD_UNROLL for (int d = 0; d < DV; ++d) vstore(ob + d * 16, acc[g][d]);
        ab_join(M[g], L[g], out + g * D, D, mb[g], lb[g], ob);
      }
    }
  }
  if (blocks == nullptr)
    PD_UNROLL for (int g = 0; g < G; ++g) ab_finish(out + g * D, D, L[g], out + g * D);
}

// ---- paged: every KV head of a sequence at once, a slot row read in address order ----
// A pool slot row holds every KV head's D floats side by side. Read head by head (attend_one
// over the slots, KVH x D floats apart, with software prefetch), the 1B shape's lone 16k-token
// decode read its pool at 16-18 GB/s where a plain sum of the same bytes reads 41-56 (#47).
// Here a block's K pass goes key by key through whole slot rows (all H heads' scores of the
// key: the sums of attend_one) and asks for the key's V row meanwhile; the V pass then runs
// head by head over rows in cache. The same blocks, sums and join as attend_one: the same bits.
// out [H, G, D] (joined here) or blocks (head h's at blocks + h * hstride, joined by da_split);
// work: H * G * (D + AB_KB + 2) floats. T: the pool's element, float, bf16 (uint16_t) or FP8
// (ks, vs: K's and V's scales), each lane widened exactly as it is loaded (fp8_load.h: float(x)
// * scale, prefill's pf_widen): the sums of float32 copies of it, the same bits.

template <typename T, int DV, int G>
void attend_heads(const float* q, const T* kp, const T* vp, int64_t H,
                  const int64_t* tab, const float* bias, int64_t W, float scale, float* out,
                  float* blocks, int64_t hstride, float* work, float ks, float vs) {
  constexpr int64_t D = DV * 16;
  const int64_t rs = H * D, HG = H * G;
  float* qs = work;                // [H, G, D] the queries times the scale
  float* sc = qs + HG * D;         // [H, G, AB_KB] a block's scores, then weights
  float* M = sc + HG * AB_KB;      // [H, G] running max and sum (out != nullptr)
  float* L = M + HG;
  const V16 sv = vset1(scale);
  for (int64_t i = 0; i < HG * DV; ++i) vstore(qs + i * 16, vmul(vload(q + i * 16), sv));
  if (out != nullptr) {
    std::fill(out, out + HG * D, 0.0f);
    std::fill(M, M + HG, -INFINITY);
    std::fill(L, L + HG, 0.0f);
  }
  alignas(64) float ob[D];
  for (int64_t b0 = 0; b0 < W; b0 += AB_KB) {
    const int kn = static_cast<int>(std::min<int64_t>(AB_KB, W - b0));
    for (int j = 0; j < kn; ++j) {
      const T* kr = kp + tab[b0 + j] * rs;
      // the V row the V pass reads next (K rows: the hardware follows; asking for K rows
      // ahead too measured slower)
      const char* vr = reinterpret_cast<const char*>(vp + tab[b0 + j] * rs);
      for (int64_t l = 0; l < rs * int64_t(sizeof(T)); l += 64) _mm_prefetch(vr + l, _MM_HINT_T0);
      const float add = bias ? bias[b0 + j] : 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        const T* kh = kr + h * D;
        const float* qh = qs + h * G * D;
        V16 acc[G];
        PD_UNROLL for (int g = 0; g < G; ++g) acc[g] = vzero();
        PD_UNROLL for (int d = 0; d < DV; ++d) {
          const V16 kv = kv_load(kh + d * 16, ks);
          PD_UNROLL for (int g = 0; g < G; ++g)
            acc[g] = vfmadd(kv, vload(qh + (g * DV + d) * 16), acc[g]);
        }
        PD_UNROLL for (int g = 0; g < G; ++g)
          sc[(h * G + g) * AB_KB + j] = vreduce_add(acc[g]) + add;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      float* sh = sc + h * G * AB_KB;
      float mb[G], lb[G];
      bool vis[G], any = false;
      PD_UNROLL for (int g = 0; g < G; ++g) {
        vis[g] = ab_softmax(sh + g * AB_KB, kn, kn, mb[g], lb[g]);
        any = any || vis[g];
      }
      float* bp = blocks ? blocks + h * hstride + (b0 / AB_KB) * G * (D + 2) : nullptr;
      if (!any) {  // padding only: nothing to add
        if (bp) PD_UNROLL for (int g = 0; g < G; ++g) bp[g * (D + 2)] = -INFINITY;
        continue;
      }
      V16 acc[G][DV];
      PD_UNROLL for (int g = 0; g < G; ++g)
        PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = vzero();
      for (int i = 0; i < kn; ++i) {
        V16 vr[DV];
        const T* vi = vp + tab[b0 + i] * rs + h * D;
        PD_UNROLL for (int d = 0; d < DV; ++d) vr[d] = kv_load(vi + d * 16, vs);
        PD_UNROLL for (int g = 0; g < G; ++g) {
          const V16 p = vset1(sh[g * AB_KB + i]);
          PD_UNROLL for (int d = 0; d < DV; ++d) acc[g][d] = vfmadd(vr[d], p, acc[g][d]);
        }
      }
      PD_UNROLL for (int g = 0; g < G; ++g) {
        if (bp) {
          float* dst = bp + g * (D + 2);
          dst[0] = vis[g] ? mb[g] : -INFINITY;
          dst[1] = lb[g];
          PD_UNROLL for (int d = 0; d < DV; ++d) vstore(dst + 2 + d * 16, acc[g][d]);
        } else if (vis[g]) {
          const int64_t r = h * G + g;
          PD_UNROLL for (int d = 0; d < DV; ++d) vstore(ob + d * 16, acc[g][d]);
          ab_join(M[r], L[r], out + r * D, D, mb[g], lb[g], ob);
        }
      }
    }
  }
  if (out != nullptr)
    for (int64_t r = 0; r < HG; ++r) ab_finish(out + r * D, D, L[r], out + r * D);
}

template <typename T>
using HeadsFn = void (*)(const float*, const T*, const T*, int64_t, const int64_t*,
                         const float*, int64_t, float, float*, float*, int64_t, float*);
template <typename T>  // attend_heads: K's and V's scales last
using ScaledFn = void (*)(const float*, const T*, const T*, int64_t, const int64_t*, const float*,
                          int64_t, float, float*, float*, int64_t, float*, float, float);

using AttendFn = void (*)(const float*, const float*, int64_t, const float*, int64_t,
                          const float*, int64_t, float, float*, float*, float*);

// ---- long contexts: the keys in parts (flash-decoding) ----
// Past two parts' worth of keys, a task is (sequence, part of DA_PART_BYTES of K and V): every
// KV head of the part in turn (the part's slots stay in L2 from one head to the next, so a slot
// row of all heads is read from memory once), each block's (mb, lb, ob) kept; a second pass
// joins the blocks of each (sequence, head, query) in order, as the kernel does in one pass
// (attn_block.h): the same bits in parts or whole. At batch x KV heads below the thread count
// (one long sequence) every thread still works. The view's kernel takes da_use_parts, the
// paged one dp_use_parts (its tasks are whole sequences).
constexpr int64_t DA_PART_BYTES = 256 * 1024;

// a whole number of blocks
inline int64_t da_part_len(int64_t H, int64_t D) {
  const int64_t keys = DA_PART_BYTES / (2 * H * D * int64_t(sizeof(float)));
  return std::max<int64_t>(AB_KB, keys / AB_KB * AB_KB);
}

// parts only where the (sequence, KV head) tasks leave threads idle or unevenly loaded (fewer
// than two a thread) and the context is two parts or more: measured on the 2-core Zen 4 (#47),
// SmolLM2's lone 4k-token decode (3 tasks) took 11.2 ms a step in parts vs 14.6 whole, while
// 4 x 4k (12 tasks) and the 1B shape's one 16k sequence (8 tasks) were 12-14% slower in parts
inline bool da_use_parts(int64_t B, int64_t H, int64_t W, int64_t part) {
  return W >= 2 * part && B * H < 2 * static_cast<int64_t>(at::get_num_threads());
}

// the paged kernel's (attend_heads: a task is a sequence, every head): parts where sequences
// are fewer than two a thread, of about a quarter of a thread's share of the keys (whole
// blocks, 256 keys or more; 1024 and 4096 keys measured alike at the 1B shape's 16k)
inline int64_t dp_part_len(int64_t W) {
  const int64_t T = at::get_num_threads(), keys = (W + 4 * T - 1) / (4 * T);
  return std::max<int64_t>(4 * AB_KB, (keys + AB_KB - 1) / AB_KB * AB_KB);
}

inline bool dp_use_parts(int64_t B, int64_t W, int64_t part) {
  return W >= 2 * part && B < 2 * static_cast<int64_t>(at::get_num_threads());
}

// per (b, p) task: run(b, w0, wn, blk, hstride): head h's blocks of the part go to
// blk + h * hstride ([blocks, G, D + 2]); then each (b, h, g) row's blocks joined into out
template <typename Run>
void da_split(int64_t B, int64_t H, int64_t G, int64_t D, int64_t W, int64_t part, float* out,
              const Run& run) {
  const int64_t P = (W + part - 1) / part, NB = (W + AB_KB - 1) / AB_KB, bs = G * (D + 2);
  std::vector<float> pb(B * H * NB * bs);
  at::parallel_for(0, B * P, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / P, w0 = (i % P) * part;
      run(b, w0, std::min(part, W - w0), pb.data() + (b * H * NB + w0 / AB_KB) * bs, NB * bs);
    }
  });
  at::parallel_for(0, B * H * G, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bh = r / G, g = r % G;
      float* o = out + r * D;
      std::fill(o, o + D, 0.0f);
      float M = -INFINITY, L = 0.0f;
      for (int64_t n = 0; n < NB; ++n) {
        const float* blk = pb.data() + (bh * NB + n) * bs + g * (D + 2);
        if (blk[0] != -INFINITY) ab_join(M, L, o, D, blk[0], blk[1], blk + 2);
      }
      ab_finish(o, D, L, o);
    }
  });
}

// the kernel Family::at<DV, G>() for head_dim D (DV vectors of 16) and G query heads per KV
// head (1-8), or nullptr (SDPA serves the rest): one table for both decode kernels
template <typename Family, int DV>
typename Family::Fn by_group(int64_t G) {
  switch (G) {
    case 1: return Family::template at<DV, 1>();
    case 2: return Family::template at<DV, 2>();
    case 3: return Family::template at<DV, 3>();
    case 4: return Family::template at<DV, 4>();
    case 5: return Family::template at<DV, 5>();
    case 6: return Family::template at<DV, 6>();
    case 7: return Family::template at<DV, 7>();
    case 8: return Family::template at<DV, 8>();
    default: return nullptr;
  }
}

template <typename Family>
typename Family::Fn kernel_for(int64_t D, int64_t G) {
  switch (D) {
    case 32: return by_group<Family, 2>(G);
    case 64: return by_group<Family, 4>(G);
    case 128: return by_group<Family, 8>(G);
    case 256: return by_group<Family, 16>(G);
    default: return nullptr;
  }
}

#if defined(PD_ISA_AVX512)
struct AllHeadsBf16 {  // the paged kernel in the bf16 order (bf16_attn.h)
  using Fn = HeadsFn<uint16_t>;
  template <int DV, int G> static Fn at() { return attend_heads_bf16<DV, G>; }
};
#endif

struct OneHead {  // the view's kernel: a (sequence, KV head) a call
  using Fn = AttendFn;
  template <int DV, int G> static Fn at() { return attend_one<DV, G>; }
};

template <typename T>
struct AllHeads {  // the paged kernel: every KV head of a sequence a call, a T pool
  using Fn = ScaledFn<T>;
  template <int DV, int G> static Fn at() { return attend_heads<T, DV, G>; }
};

Tensor decode_attention(const Tensor& q_in, const Tensor& k, const Tensor& v,
                        const std::optional<Tensor>& bias_in, double scale) {
  const int64_t B = q_in.size(0), H = q_in.size(1), G = q_in.size(2), D = q_in.size(3);
  const int64_t W = k.size(2);
  const AttendFn fn = kernel_for<OneHead>(D, G);
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
  const int64_t part = da_part_len(H, D);
  if (da_use_parts(B, H, W, part)) {
    da_split(B, H, G, D, W, part, op,
             [&](int64_t b, int64_t w0, int64_t wn, float* blk, int64_t hstride) {
      std::vector<float> scores(G * AB_KB);
      for (int64_t h = 0; h < H; ++h)
        fn(qp + (b * H + h) * G * D, kp + b * ksb + h * ksh + w0 * ksw, ksw,
           vp + b * vsb + h * vsh + w0 * vsw, vsw, bp ? bp + b * W + w0 : nullptr, wn,
           static_cast<float>(scale), nullptr, scores.data(), blk + h * hstride);
    });
    return out;
  }
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(G * AB_KB);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      fn(qp + i * G * D, kp + b * ksb + h * ksh, ksw, vp + b * vsb + h * vsh, vsw,
         bp ? bp + b * W : nullptr, W, static_cast<float>(scale), op + i * G * D,
         scores.data(), nullptr);
    }
  });
  return out;
}

// the paged kernel's tasks (whole sequences, or parts joined by da_split) over a T pool (fn:
// HeadsFn<T>, or ScaledFn<T> with ks_vs: K's and V's scales)
template <typename T, typename Fn, typename... S>
void paged_run(Fn fn, const float* qp, const T* kp, const T* vp, const int64_t* tp,
               const float* bp, float* op, int64_t B, int64_t H, int64_t G, int64_t D,
               int64_t W, double scale, S... ks_vs) {
  const int64_t part = dp_part_len(W), wsz = H * G * (D + AB_KB + 2);
  const float sc = static_cast<float>(scale);
  if (dp_use_parts(B, W, part)) {
    da_split(B, H, G, D, W, part, op,
             [&](int64_t b, int64_t w0, int64_t wn, float* blk, int64_t hstride) {
      std::vector<float> work(wsz);
      fn(qp + b * H * G * D, kp, vp, H, tp + b * W + w0, bp ? bp + b * W + w0 : nullptr, wn,
         sc, nullptr, blk, hstride, work.data(), ks_vs...);
    });
    return;
  }
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> work(wsz);
    for (int64_t b = b0; b < b1; ++b)
      fn(qp + b * H * G * D, kp, vp, H, tp + b * W, bp ? bp + b * W : nullptr, W, sc,
         op + b * H * G * D, nullptr, 0, work.data(), ks_vs...);
  });
}

// ---- paged decode attention: the same sums reading the K/V pool in place (attend_heads) ----
// q [B, KVH, G, D] float32 or bf16; k_pool, v_pool: the layer's pool (float32, or bf16 or FP8
// widened as it is read, FP8 times k_scale / v_scale as pf_widen; bf16 queries: as float32 but
// over a bf16 pool where bf16_attn.h's order applies), contiguous, viewed as slots
// [S, KVH, D] ([pages, page_size, KVH, D] is that); table [B * W] long: the slots of each
// sequence's
// context, padded to W (padding masked by bias [B, W], or no padding). No gather, no copy
// per step: what the decode K/V view saves, without its second copy of the contexts (it
// stops at its memory budget; this has none). Equal to the bit to decode_attention over
// the gathered rows (the same sums in the same order). Where it does not apply (dtype,
// head_dim, group size, a non-contiguous pool) the rows are gathered and decode_attention
// (or SDPA) runs on them. A slot outside the pool is refused (an error, not a read).
Tensor decode_attention_paged(const Tensor& q_in, const Tensor& k_pool, const Tensor& v_pool,
                              const Tensor& table, const std::optional<Tensor>& bias_in,
                              double scale, double k_scale = 1.0, double v_scale = 1.0) {
  TORCH_CHECK(q_in.dim() == 4 && table.dim() == 1, "decode_attention_paged: q [B, KVH, G, D], "
              "table [B * W]");
  const int64_t B = q_in.size(0), H = q_in.size(1), G = q_in.size(2), D = q_in.size(3);
  TORCH_CHECK(B > 0 && table.numel() % B == 0 && table.numel() > 0,
              "decode_attention_paged: table is not B x W slots");
  const int64_t W = table.numel() / B;
  TORCH_CHECK(k_pool.numel() == v_pool.numel() && k_pool.numel() % (H * D) == 0,
              "decode_attention_paged: the pools are not [slots, kv_heads, head_dim]");
  const int64_t S = k_pool.numel() / (H * D);
  const auto pt = k_pool.scalar_type();
  const bool bf16 = pt == at::kBFloat16;
  const bool fp8 = pt == at::kFloat8_e4m3fn || pt == at::kFloat8_e5m2;
  const bool ok = kernel_for<AllHeads<float>>(D, G) != nullptr && panel_gemm_supported() &&
                  (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16) &&
                  (pt == at::kFloat || bf16 || fp8) &&
                  v_pool.scalar_type() == pt &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  table.scalar_type() == at::kLong && table.is_contiguous() &&
                  (!bias_in.has_value() ||
                   (bias_in->scalar_type() == at::kFloat && bias_in->numel() == B * W));
  if (!ok) {
    const auto shape = std::vector<int64_t>{B, W, H, D};
    Tensor kb = k_pool.reshape({S, H, D}).index_select(0, table).view(shape).transpose(1, 2);
    Tensor vb = v_pool.reshape({S, H, D}).index_select(0, table).view(shape).transpose(1, 2);
    const auto wide = [&](const Tensor& x, double sc) {  // pf_widen's values
      return fp8 && sc != 1.0 ? x.to(at::kFloat) * sc : x.to(at::kFloat); };
    return decode_attention(q_in.to(at::kFloat), wide(kb, k_scale), wide(vb, v_scale), bias_in,
                            scale);
  }
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * W; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < S, "decode_attention_paged: slot ", tp[i],
                " outside the pool (", S, " slots)");
  // bf16 queries over a bf16 pool: the bf16 order (bf16_attn.h) where it applies, else widened
  const bool dot = bf16_attn_applies(q_in.scalar_type(), pt, D);
  Tensor q = q_in.to(at::kFloat).contiguous();
  Tensor bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  Tensor out = at::empty({B, H, G, D}, q.options());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
#if defined(PD_ISA_AVX512)
  if (dot) {
    paged_run(kernel_for<AllHeadsBf16>(D, G), q.data_ptr<float>(),
              reinterpret_cast<const uint16_t*>(k_pool.data_ptr<at::BFloat16>()),
              reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>()), tp, bp,
              out.data_ptr<float>(), B, H, G, D, W, scale);
    return out;
  }
#endif
  (void)dot;
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  if (pt == at::kFloat8_e4m3fn)
    paged_run(kernel_for<AllHeads<c10::Float8_e4m3fn>>(D, G), q.data_ptr<float>(),
              k_pool.data_ptr<c10::Float8_e4m3fn>(), v_pool.data_ptr<c10::Float8_e4m3fn>(), tp,
              bp, out.data_ptr<float>(), B, H, G, D, W, scale, ks, vs);
  else if (pt == at::kFloat8_e5m2)
    paged_run(kernel_for<AllHeads<c10::Float8_e5m2>>(D, G), q.data_ptr<float>(),
              k_pool.data_ptr<c10::Float8_e5m2>(), v_pool.data_ptr<c10::Float8_e5m2>(), tp, bp,
              out.data_ptr<float>(), B, H, G, D, W, scale, ks, vs);
  else if (bf16)
    paged_run(kernel_for<AllHeads<uint16_t>>(D, G), q.data_ptr<float>(),
              reinterpret_cast<const uint16_t*>(k_pool.data_ptr<at::BFloat16>()),
              reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>()), tp, bp,
              out.data_ptr<float>(), B, H, G, D, W, scale, ks, vs);
  else
    paged_run(kernel_for<AllHeads<float>>(D, G), q.data_ptr<float>(), k_pool.data_ptr<float>(),
              v_pool.data_ptr<float>(), tp, bp, out.data_ptr<float>(), B, H, G, D, W, scale, ks,
              vs);
  return out;
}

}  // namespace
