#pragma once
// The W8A8 decode loop's GEMM inputs quantized where they are made (#48). int8_linear
// (int8_gemm.h) takes a float32 input and quantizes each row before its GEMM; in the decode loop
// two of a layer's four inputs come out of add_rms_norm (qkv's and gate_up's) and one out of
// silu_mul (down's), each a [T, K] tensor written, read back by the quantization and dropped.
// Here the row is made in scratch (L1) and quantized at once: one pass, one parallel region and
// no float tensor instead of two passes, two regions and three tensors. The row is computed by
// the same functions (add_rms_norm_row, silu_mul_rows_f32) and quantized by the same one
// (i8_quantize_row), so x_q, s_x and the GEMM's output equal the separate operators' to the bit.
#include "elementwise.h"
#include "int8_gemm.h"

namespace {

// A GEMM input quantized for the int8 GEMM: xq [M, Kp] as int8_linear lays it out (x_q + 128 as
// bytes on the VNNI and AMX paths, 2 and 3), xs [M]; undefined where the fused pass does not apply
struct I8Rows {
  Tensor xq, xs;
  int64_t K = 0, path = 0;
  bool defined() const { return xq.defined(); }
};

I8Rows i8_rows(int64_t M, int64_t K, int64_t path, const Tensor& like) {
  I8Rows q;
  q.K = K;
  q.path = path;
  q.xq = at::empty({M, i8_kp(K)}, like.options().dtype(at::kChar));
  q.xs = at::empty({M}, like.options().dtype(at::kFloat));
  return q;
}

// residual [T, H] += x (x empty: no add), then rms_norm(residual) * weight quantized per row:
// add_rms_norm then int8_linear's quantization. Where add_rms_norm's pass does not apply (not
// float32 contiguous, H not a multiple of 16): undefined, residual untouched.
I8Rows add_rms_norm_i8(const Tensor& residual, const Tensor& x, const Tensor& weight, double eps,
                       int64_t path) {
  if (!add_rms_norm_fits(residual, x, weight)) return {};
  path = int8_resolve_path(path);
  const int64_t T = residual.size(0), H = residual.size(1), Kp = i8_kp(H);
  I8Rows q = i8_rows(T, H, path, residual);
  float* rp = residual.data_ptr<float>();
  const float* xp = x.numel() > 0 ? x.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  int8_t* qp = q.xq.data_ptr<int8_t>();
  float* sp = q.xs.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> sq(H), row(H);
    for (int64_t t = t0; t < t1; ++t) {
      add_rms_norm_row(rp + t * H, xp ? xp + t * H : nullptr, wp, H, e, sq.data(), row.data());
      sp[t] = i8_quantize_row(row.data(), H, Kp, i8_u8(path), qp + t * Kp);
    }
  });
  return q;
}

// silu(gate) * up of gu [M, 2I] (silu_mul's float32 pass) quantized per row; undefined where
// that pass does not apply (silu_mul's conditions for float32)
I8Rows silu_mul_i8(const Tensor& gu, int64_t I, int64_t path) {
  if (!(panel_gemm_supported() && gu.scalar_type() == at::kFloat && gu.dim() == 2 &&
        gu.size(1) == 2 * I && gu.stride(1) == 1 && I % 32 == 0))
    return {};
  path = int8_resolve_path(path);
  const int64_t M = gu.size(0), ld = gu.stride(0), Kp = i8_kp(I);
  I8Rows q = i8_rows(M, I, path, gu);
  const float* src = gu.data_ptr<float>();
  int8_t* qp = q.xq.data_ptr<int8_t>();
  float* sp = q.xs.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(I);
    for (int64_t m = m0; m < m1; ++m) {
      silu_mul_rows_f32(src + m * ld, ld, row.data(), I, 0, 1);
      sp[m] = i8_quantize_row(row.data(), I, Kp, i8_u8(path), qp + m * Kp);
    }
  });
  return q;
}

// The int8 GEMM of quantized rows: y [M, N] float32 (+ b), what int8_linear gives for the float
// rows they were made from
Tensor int8_linear_rows(const I8Rows& q, const Tensor& packed, int64_t N,
                        const std::optional<Tensor>& b) {
  i8_check(packed, q.K, N);
  const int64_t M = q.xq.size(0), Kp = q.xq.size(1);
  Tensor y = at::empty({M, N}, q.xs.options());
  Tensor bc;
  if (b.has_value() && b->defined() && b->numel() > 0) bc = b->to(at::kFloat).contiguous();
  const I8Out o{y.data_ptr<float>(), N, q.xs.data_ptr<float>(),
                bc.defined() ? bc.data_ptr<float>() : nullptr};
  i8_gemm(q.xq.data_ptr<int8_t>(), M, Kp, packed.data_ptr<int8_t>(), packed.size(0), q.path, o);
  return y;
}

// A fused pass's x_q as int8 [M, K] (the VNNI offset taken back off) and s_x [M, 1]: what
// quant.quantize_rows gives for the float rows (the tests compare the two)
std::tuple<Tensor, Tensor> i8_rows_out(const I8Rows& q, const char* what) {
  TORCH_CHECK(q.defined(), what, ": the fused pass does not apply to these tensors");
  Tensor xq = q.xq.slice(1, 0, q.K);
  xq = i8_u8(q.path) ? (xq.view(at::kByte).to(at::kInt) - 128).to(at::kChar) : xq.contiguous();
  return {xq, q.xs.view({-1, 1})};
}

// pdcore_native::add_rms_norm_quant (residual in place, as add_rms_norm) and silu_mul_quant
std::tuple<Tensor, Tensor> add_rms_norm_quant(const Tensor& residual, const Tensor& x,
                                              const Tensor& weight, double eps, int64_t path) {
  return i8_rows_out(add_rms_norm_i8(residual, x, weight, eps, path), "add_rms_norm_quant");
}

std::tuple<Tensor, Tensor> silu_mul_quant(const Tensor& gu, int64_t I, int64_t path) {
  return i8_rows_out(silu_mul_i8(gu, I, path), "silu_mul_quant");
}

}  // namespace
