#pragma once
// rotary + K/V stores and bf16 silu(gate) * up, fused
#include "common.h"

namespace {

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

// Vector forms of rnd (vec.h): float32 (nothing to round) and bf16 (round to nearest even in
// integer ops, as c10::BFloat16 rounds: denormals kept, NaN stays NaN), 16 lanes at a time.
template <typename X>
struct Lanes;

template <>
struct Lanes<float> {
  static V16 load(const float* p) { return vload(p); }
  static V16 round(V16 v) { return v; }
};

template <>
struct Lanes<c10::BFloat16> {
  static V16 load(const c10::BFloat16* p) {
    return vload_bf16(reinterpret_cast<const uint16_t*>(p));
  }
  static V16 round(V16 v) { return vround_bf16(v); }
};

template <typename X>
void rotate_head_vec(const X* xh, const X* c, const X* s, int64_t D2, float* rot) {
  using L = Lanes<X>;
  for (int64_t d = 0; d < D2; d += 16) {
    const V16 x1 = L::load(xh + d), x2 = L::load(xh + D2 + d);
    const V16 c1 = L::load(c + d), c2 = L::load(c + D2 + d);
    const V16 s1 = L::load(s + d), s2 = L::load(s + D2 + d);
    const V16 nx2 = vneg(x2);  // -x2: the sign bit flipped
    const V16 lo = L::round(vadd(L::round(vmul(x1, c1)), L::round(vmul(nx2, s1))));
    const V16 hi = L::round(vadd(L::round(vmul(x2, c2)), L::round(vmul(x1, s2))));
    vstore(rot + d, lo);
    vstore(rot + D2 + d, hi);
  }
}

inline void store_upper_halves(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) vstore_upper_halves(dst + i, vload(src + i));
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
// multiple of 32) or one element at a time
template <typename X>
inline void rotate_head(const X* xh, const X* c, const X* s, int64_t D, float* rot) {
  const int64_t D2 = D / 2;
  if constexpr (std::is_same_v<X, float> || std::is_same_v<X, c10::BFloat16>) {
    if (D2 % 16 == 0 && panel_gemm_supported()) {
      rotate_head_vec<X>(xh, c, s, D2, rot);
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
// what rope_store_impl reads and writes, as pointers: row t's work is rope_store_row (the
// decode step's team region, team_step.h, runs its rows through it too)
template <typename X, typename V>
struct RopeRows {
  const X *src, *cp, *sp;
  X *kp, *vp;
  V *vk, *vv, *op;
  const int64_t *slot, *rp, *colp;
  int64_t row, OH, vsb, vsh, vsc, H, KVH, D;
};

template <typename X, typename V>
void rope_store_row(const RopeRows<X, V>& a, int64_t t, float* rot) {
  const int64_t H = a.H, KVH = a.KVH, D = a.D, OH = a.OH;
  const X* x = a.src + t * a.row;
  const X* c = a.cp + t * D;
  const X* s = a.sp + t * D;
  X* kd = a.kp + a.slot[t] * KVH * D;
  X* vd = a.vp + a.slot[t] * KVH * D;
  V* vk = a.vk;
  V* vv = a.vv;
  const int64_t vbase = vk ? a.rp[t] * a.vsb + a.colp[t] * a.vsc : 0, vsh = a.vsh;
  for (int64_t h = 0; h < H + KVH; ++h) {
    rotate_head<X>(x + h * D, c, s, D, rot);
    if (h < OH) store_rounded<V>(a.op + (t * OH + h) * D, rot, D);
    if (h >= H) {
      const int64_t kh = h - H;
      store_rounded<X>(kd + kh * D, rot, D);
      if (vk) store_rounded<V>(vk + vbase + kh * vsh, rot, D);
    }
  }
  const X* xv = x + (H + KVH) * D;
  std::memcpy(vd, xv, sizeof(X) * KVH * D);
  if (vv)
    for (int64_t kh = 0; kh < KVH; ++kh)
      for (int64_t d = 0; d < D; ++d)
        vv[vbase + kh * vsh + d] = V(static_cast<float>(xv[kh * D + d]));
}

template <typename X, typename V>
RopeRows<X, V> rope_rows(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                         const Tensor& k_pool, const Tensor& v_pool, const Tensor* view_k,
                         const Tensor* view_v, const Tensor& out_slots, const int64_t* rp,
                         const int64_t* colp, Tensor& out, int64_t H, int64_t KVH, int64_t D) {
  RopeRows<X, V> a;
  a.src = qkv.data_ptr<X>();
  a.cp = cos.data_ptr<X>();
  a.sp = sin.data_ptr<X>();
  a.kp = k_pool.data_ptr<X>();
  a.vp = v_pool.data_ptr<X>();
  a.vk = view_k ? view_k->data_ptr<V>() : nullptr;
  a.vv = view_v ? view_v->data_ptr<V>() : nullptr;
  a.op = out.data_ptr<V>();
  a.slot = out_slots.data_ptr<int64_t>();
  a.rp = rp;
  a.colp = colp;
  a.row = qkv.stride(0);
  a.OH = out.size(1);
  a.vsb = a.vk ? view_k->stride(0) : 0;
  a.vsh = a.vk ? view_k->stride(1) : 0;
  a.vsc = a.vk ? view_k->stride(2) : 0;
  a.H = H;
  a.KVH = KVH;
  a.D = D;
  return a;
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
  const RopeRows<X, V> a = rope_rows<X, V>(qkv, cos, sin, k_pool, v_pool, view_k, view_v,
                                           out_slots, rp, colp, out, H, KVH, D);
  at::parallel_for(0, qkv.size(0), 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> rot(D);
    for (int64_t t = t0; t < t1; ++t) rope_store_row<X, V>(a, t, rot.data());
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

// the Python code's _rotate_half: [x1, x2] -> [-x2, x1] over the last dimension
Tensor rotate_half(const Tensor& x) {
  auto parts = x.chunk(2, -1);
  return at::cat({parts[1].neg(), parts[0]}, -1);
}

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
    Tensor kn = qk.slice(1, H).to(kf.scalar_type());
    Tensor vn = qkv.slice(1, (H + KVH) * D).view({T, KVH, D}).to(vf.scalar_type());
    if (kf.element_size() == 1) {  // an FP8 pool (scale 1): CPU index_copy_ has no FP8 kernel
      kf.view(at::kByte).index_copy_(0, out_slots, kn.view(at::kByte));
      vf.view(at::kByte).index_copy_(0, out_slots, vn.view(at::kByte));
    } else {
      kf.index_copy_(0, out_slots, kn);
      vf.index_copy_(0, out_slots, vn);
    }
    return qk;
  }
  Tensor out = at::empty({T, H + KVH, D}, qkv.options());
  rope_store_any(qkv, cos, sin, k_pool, v_pool, nullptr, nullptr, out_slots, nullptr, nullptr,
                 out, H, KVH, D);
  return out;
}

// ---- SiLU(gate) * up -------------------------------------------------------------------------
// gu [M, 2I] (the gate_up GEMM's output: gate | up) -> [M, I] = silu(gate) * up in one pass
// instead of aten's silu over the strided half, then mul (two passes, two [M, I] tensors).
// bf16: silu(x) = x / (1 + exp(-x)) in float32, this file's exp and a refined reciprocal (a few
// float32 ulps from aten's, far below bf16's last bit), rounded to bf16 before the product as
// aten's two operators round (measured here, 1024 x 1536: 0.6 ms a layer for the two).
// float32: equal to the bit to aten's silu then mul (the float32 model stays equal to
// transformers' to the token): aten's vector form of silu, x / (1 + exp(-x)) with the same
// Sleef exp its Vectorized<float> calls (libtorch_cpu exports it), a true division, then the
// product, each rounded once. aten runs its scalar form (std::exp) on the last < 32 elements of
// a row, so rows whose I is not a multiple of 32 keep aten's operators.
void silu_mul_rows(const c10::BFloat16* gu, int64_t ld, c10::BFloat16* out, int64_t I,
                   int64_t m0, int64_t m1) {
  using L = Lanes<c10::BFloat16>;
  const V16 one = vset1(1.0f);
  for (int64_t m = m0; m < m1; ++m) {
    const c10::BFloat16* g = gu + m * ld;
    const c10::BFloat16* u = g + I;
    auto* o = reinterpret_cast<uint16_t*>(out + m * I);
    for (int64_t i = 0; i < I; i += 16) {
      const V16 x = L::load(g + i);
      const V16 r = rcp_refined(vadd(one, exp_ps(vneg(x))));
      const V16 sl = L::round(vmul(x, r));
      vstore_upper_halves(o + i, L::round(vmul(sl, L::load(u + i))));
    }
  }
}

void silu_mul_rows_f32(const float* gu, int64_t ld, float* out, int64_t I, int64_t m0,
                       int64_t m1) {
  const V16 one = vset1(1.0f);
  for (int64_t m = m0; m < m1; ++m) {
    const float* g = gu + m * ld;
    const float* u = g + I;
    float* o = out + m * I;
    for (int64_t i = 0; i < I; i += 16) {
      const V16 x = vload(g + i);
      const V16 sl = vdiv(x, vadd(one, aten_exp(vneg(x))));
      vstore(o + i, vmul(sl, vload(u + i)));
    }
  }
}

Tensor silu_mul(const Tensor& gu, int64_t I) {
  const auto t = gu.scalar_type();
  const bool ok = panel_gemm_supported() && (t == at::kBFloat16 || t == at::kFloat) &&
                  gu.dim() == 2 && gu.size(1) == 2 * I && gu.stride(1) == 1 &&
                  I % (t == at::kFloat ? 32 : 16) == 0;
  if (!ok) return at::silu(gu.slice(1, 0, I)) * gu.slice(1, I);
  const int64_t M = gu.size(0), ld = gu.stride(0);
  Tensor out = at::empty({M, I}, gu.options());
  if (t == at::kFloat) {
    const float* src = gu.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
      silu_mul_rows_f32(src, ld, dst, I, m0, m1);
    });
    return out;
  }
  const auto* src = gu.data_ptr<c10::BFloat16>();
  auto* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    silu_mul_rows(src, ld, dst, I, m0, m1);
  });
  return out;
}

// ---- residual add + RMSNorm, float32 --------------------------------------------------------
// residual += x (in place), then rms_norm(residual) * weight, in one pass over each row (the
// row stays in L1) instead of aten's add_ and the six operators of its CPU rms_norm (pow, sum,
// div_, add_, rsqrt, mul, mul: six passes and five [T, hidden] tensors). Equal to the bit to
// them: the squares summed in aten's order for a contiguous row (its sum kernel's cascade: W-lane
// vectors interleaved four ways in levels of 16, then the scalar tail, then the lanes in order;
// W = 8: on x86 aten runs that kernel's AVX2 build under every capability, AVX-512 included, as
// measured here and checked by tests/engine/test_native.py), the mean a true division,
// 1 / sqrt(mean + eps), then (r * inv) * weight.
template <int W>
float aten_row_sum(const float* x, int64_t n) {
  float acc[4][4][W] = {};  // [level][partial][lane]
  const int64_t nvec = n / W, size = nvec / 4;
  int64_t lp = 1;  // aten's CeilLog2(size) / 4, at least 4
  while ((int64_t{1} << lp) < size) ++lp;
  lp = std::max<int64_t>(4, (size <= 2 ? 1 : lp) / 4);
  const int64_t step = int64_t{1} << lp, mask = step - 1;
  const auto add_row = [&](int64_t i) {
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += x[(i * 4 + k) * W + l];
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l) acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0.0f;
      if ((i & (mask << (j * lp))) != 0) break;
    }
  }
  for (; i < size; ++i) add_row(i);
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = size * 4; v < nvec; ++v)
    for (int l = 0; l < W; ++l) acc[0][0][l] += x[v * W + l];
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
  float f = 0.0f;
  for (int64_t t = nvec * W; t < n; ++t) f += x[t];
  for (int l = 0; l < W; ++l) f += acc[0][0][l];
  return f;
}

constexpr int ATEN_SUM_LANES = 8;

// One row of add_rms_norm: r += x (x null: no add; r in place), out = rms_norm(r) * w; sq: H
// floats of scratch. The int8 GEMM's fused input (int8_gemm.h: add_rms_norm_i8) runs it too.
inline void add_rms_norm_row(float* r, const float* x, const float* w, int64_t H, float eps,
                             float* sq, float* out) {
  for (int64_t i = 0; i < H; i += 16) {
    V16 v = vload(r + i);
    if (x != nullptr) {
      v = vadd(v, vload(x + i));
      vstore(r + i, v);
    }
    vstore(sq + i, vmul(v, v));
  }
  const float sum = aten_row_sum<ATEN_SUM_LANES>(sq, H);
  const V16 inv = vset1(1.0f / std::sqrt(sum / static_cast<float>(H) + eps));
  for (int64_t i = 0; i < H; i += 16) vstore(out + i, vmul(vmul(vload(r + i), inv), vload(w + i)));
}

// Whether add_rms_norm's pass applies: float32, contiguous, H a multiple of 16 (x empty: no add)
bool add_rms_norm_fits(const Tensor& residual, const Tensor& x, const Tensor& weight) {
  const int64_t H = residual.size(-1);
  return isa_supported() && residual.scalar_type() == at::kFloat && residual.dim() == 2 &&
         residual.is_contiguous() && weight.scalar_type() == at::kFloat &&
         weight.is_contiguous() && weight.numel() == H && H % 16 == 0 &&
         (x.numel() == 0 || (x.scalar_type() == at::kFloat && x.is_contiguous() &&
                             x.sizes() == residual.sizes()));
}

// pdcore_native::add_rms_norm: residual [T, H] += x [T, H] (x may be empty: no add), returns
// rms_norm(residual) * weight [T, H]; float32, contiguous (else aten's operators)
Tensor add_rms_norm(const Tensor& residual, const Tensor& x, const Tensor& weight, double eps) {
  const bool add = x.numel() > 0;
  const int64_t H = residual.size(-1);
  if (!add_rms_norm_fits(residual, x, weight)) {
    if (add) residual.add_(x);
    return at::rms_norm(residual, {H}, weight, eps);
  }
  const int64_t T = residual.size(0);
  Tensor out = at::empty_like(residual);
  float* rp = residual.data_ptr<float>();
  const float* xp = add ? x.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> sq(H);
    for (int64_t t = t0; t < t1; ++t)
      add_rms_norm_row(rp + t * H, xp ? xp + t * H : nullptr, wp, H, e, sq.data(), op + t * H);
  });
  return out;
}

}  // namespace
