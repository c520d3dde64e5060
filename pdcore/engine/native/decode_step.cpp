// The engine's native kernels (see native/__init__.py), one translation unit: float32 and bf16
// GEMMs over weight panels (gemm.h; bf16_head.h: a float32 model's lm_head over bf16 weights
// with bf16 dot products), decode attention over the decode K/V view (attention.h),
// the fused rotary + K/V stores and bf16 silu * up (elementwise.h), token sampling
// (sampler.h), and here the Llama-family
// decode layer loop and the operators' registration. The loop calls the same operators (these
// kernels included), in the same order and on the same tensors, as the Python loop in
// models/llama.py for a decode-only step through the view, so the result is the same to the
// bit; what it removes is the interpreter between ~25 small operators a layer.
#include "attention.h"
#include "bf16_head.h"
#include "common.h"
#include "elementwise.h"
#include "gemm.h"
#include "int8_act.h"
#include "int8_gemm.h"
#include "prefill_attention.h"
#include "sampler.h"
#include "team_f32.h"
#include "team_step.h"

namespace {

std::optional<Tensor> opt(const Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<Tensor>(t) : std::nullopt;
}

// residual: the embedding of the step's tokens [B, hidden] (not modified; a new tensor comes
// back: the residual stream after every layer, before the final norm).
// Per layer lists: norm weights, reordered GEMM weights (qkv with its bias or an empty tensor),
// the pool's K/V buffers [pages, page_size, kv_heads, head_dim], the view's K/V buffers.
// mode 0: append (rows, cols: each row's new column), 1: fill (table: [B * width] slots),
// 2: no view (view lists empty): attention reads the pool through table (paged).
// int8_fused (W8A8, int8 panels): qkv's and gate_up's inputs quantized in the add_rms_norm pass
// that makes them, down's in the silu_mul pass (int8_act.h: the same bits); 0: the separate
// operators (the bench's "before"); 2: as 1, the whole step in one parallel region where
// team_fits holds (team_step.h: the same bits), else as 1; 3: as 2, and a float32 model's step
// (float32 panels; the view appended to, or the pool read in place) in one region with its
// work handed out by phase (team_f32.h: the same bits).
Tensor decode_layers(const Tensor& residual_in, const Tensor& cos, const Tensor& sin,
                     at::TensorList ln1, at::TensorList ln2, at::TensorList qkv_w,
                     at::TensorList qkv_b, at::TensorList o_w, at::TensorList gu_w,
                     at::TensorList down_w, at::TensorList k_pool, at::TensorList v_pool,
                     at::TensorList view_k, at::TensorList view_v, const Tensor& out_slots,
                     const Tensor& rows, const Tensor& cols, const Tensor& table,
                     const Tensor& bias, int64_t mode, int64_t width, int64_t num_heads,
                     int64_t kv_heads, int64_t head_dim, int64_t inter, double eps,
                     double scale, int64_t int8_fused) {
  if (int8_fused == 3 &&
      team_fits(residual_in, cos, sin, ln1, ln2, qkv_w, qkv_b, o_w, gu_w, down_w, k_pool, v_pool,
                view_k, view_v, out_slots, rows, cols, bias, mode, width, num_heads, kv_heads,
                head_dim, inter, true, &table))
    return team_f32_layers(residual_in, cos, sin, ln1, ln2, qkv_w, qkv_b, o_w, gu_w, down_w,
                           k_pool, v_pool, view_k, view_v, out_slots, rows, cols, table, bias,
                           mode, width, num_heads, kv_heads, head_dim, inter, eps, scale);
  if (int8_fused >= 2 &&
      team_fits(residual_in, cos, sin, ln1, ln2, qkv_w, qkv_b, o_w, gu_w, down_w, k_pool, v_pool,
                view_k, view_v, out_slots, rows, cols, bias, mode, width, num_heads, kv_heads,
                head_dim, inter))
    return team_decode_layers(residual_in, cos, sin, ln1, ln2, qkv_w, qkv_b, o_w, gu_w, down_w,
                              k_pool, v_pool, view_k, view_v, out_slots, rows, cols, bias, width,
                              num_heads, kv_heads, head_dim, inter, eps, scale);
  static const auto lin = c10::Dispatcher::singleton().findSchemaOrThrow(
      "mkldnn::_linear_pointwise", "");
  const int64_t T = residual_in.size(0), hidden = residual_in.size(1);
  const int64_t qs = num_heads * head_dim, ks = kv_heads * head_dim;
  const int64_t L = static_cast<int64_t>(ln1.size());
  const std::optional<Tensor> attn_bias = opt(bias);
  Tensor residual = residual_in;
  const auto fused = [&](const Tensor& w) {
    return int8_fused != 0 && w.scalar_type() == at::kChar;
  };
  // each layer's input norm: the first's here, the others' fused with the residual add before
  // them (add_rms_norm, equal to the bit to add_ then at::rms_norm); quantized in that pass for
  // an int8 qkv (nq)
  Tensor normed;
  I8Rows nq;
  if (L > 0 && fused(qkv_w[0]))
    nq = add_rms_norm_i8(residual, at::empty({0}, residual.options()), ln1[0], eps, 0);
  if (L > 0 && !nq.defined()) normed = at::rms_norm(residual, {hidden}, ln1[0], eps);
  for (int64_t i = 0; i < L; ++i) {
    Tensor x;
    // attention
    Tensor qkv = nq.defined() ? int8_linear_rows(nq, qkv_w[i], qs + 2 * ks, opt(qkv_b[i]))
                              : any_linear(lin, normed, qkv_w[i], qs + 2 * ks, opt(qkv_b[i]));
    nq = I8Rows();
    Tensor o;
    if (mode == 2) {  // no view: attention reads the pool in place
      Tensor qk = rope_store(qkv, cos, sin, k_pool[i], v_pool[i], out_slots, num_heads, kv_heads,
                             head_dim);
      // bf16 queries stay bf16 (over a bf16 pool: bf16_attn.h's order; else widened there)
      Tensor qb = qk.slice(1, 0, num_heads).reshape({T, kv_heads, num_heads / kv_heads, head_dim});
      if (qb.scalar_type() != at::kBFloat16) qb = qb.to(at::kFloat);
      o = decode_attention_paged(qb, k_pool[i], v_pool[i], table, attn_bias, scale);
    } else {
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
      o = decode_attention(qb, kb, vb, attn_bias, scale);
    }
    o = o.view({T, num_heads, head_dim}).to(qkv.scalar_type());
    x = any_linear(lin, o.view({T, -1}), o_w[i], hidden, std::nullopt);
    if (i == 0) residual = residual.clone();  // the caller's embedding is not written
    // MLP
    I8Rows mq = fused(gu_w[i]) ? add_rms_norm_i8(residual, x, ln2[i], eps, 0) : I8Rows();
    Tensor gu = mq.defined() ? int8_linear_rows(mq, gu_w[i], 2 * inter, std::nullopt)
                             : any_linear(lin, add_rms_norm(residual, x, ln2[i], eps), gu_w[i],
                                          2 * inter, std::nullopt);
    I8Rows aq = fused(down_w[i]) ? silu_mul_i8(gu, inter, 0) : I8Rows();
    Tensor down = aq.defined() ? int8_linear_rows(aq, down_w[i], hidden, std::nullopt)
                               : any_linear(lin, silu_mul(gu, inter), down_w[i], hidden,
                                            std::nullopt);
    if (i + 1 < L && fused(qkv_w[i + 1]))
      nq = add_rms_norm_i8(residual, down, ln1[i + 1], eps, 0);
    if (i + 1 < L && !nq.defined())
      normed = add_rms_norm(residual, down, ln1[i + 1], eps);
    else if (i + 1 == L)
      residual.add_(down);
  }
  return residual;
}

}  // namespace

TORCH_LIBRARY(pdcore_native, m) {
  m.def("decode_layers(Tensor residual, Tensor cos, Tensor sin, Tensor[] ln1, Tensor[] ln2, "
        "Tensor[] qkv_w, Tensor[] qkv_b, Tensor[] o_w, Tensor[] gu_w, Tensor[] down_w, "
        "Tensor[] k_pool, Tensor[] v_pool, Tensor[] view_k, Tensor[] view_v, Tensor out_slots, "
        "Tensor rows, Tensor cols, Tensor table, Tensor bias, int mode, int width, "
        "int num_heads, int kv_heads, int head_dim, int inter, float eps, float scale, "
        "int int8_fused=1) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CompositeExplicitAutograd, &decode_layers);
  m.def("team_steps() -> int", &team_steps);
  m.def("linear(Tensor x, Tensor panels, int n, Tensor? b) -> Tensor");
  m.impl("linear", c10::DispatchKey::CompositeExplicitAutograd, &panel_linear);
  m.def("panel_gemm_supported() -> bool", &panel_gemm_supported);
  m.def("panel_tuning(int kblock, int block_tiles, int group) -> int[]", &panel_tuning);
  m.def("linear_bf16(Tensor x, Tensor panels, int n, Tensor? b) -> Tensor");
  m.impl("linear_bf16", c10::DispatchKey::CompositeExplicitAutograd, &panel_linear_bf16);
  m.def("bf16_gemm_supported() -> bool", &bf16_gemm_supported);
  m.def("linear_bf16_f32(Tensor x, Tensor panels, int n, Tensor? b) -> Tensor");
  m.impl("linear_bf16_f32", c10::DispatchKey::CompositeExplicitAutograd, &panel_linear_bf16_f32);
  m.def("isa() -> str", &native_isa);
  m.def("gguf_linear(Tensor x, Tensor w, int n, Tensor? b) -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CompositeExplicitAutograd, &gguf_linear);
  m.def("gguf_linear_path(Tensor x, Tensor w, int n, Tensor? b, int path) -> Tensor");
  m.impl("gguf_linear_path", c10::DispatchKey::CompositeExplicitAutograd, &gguf_linear_path);
  m.def("gguf_set_path(int path) -> int", &gguf_set_path);
  m.def("gguf_rows(Tensor w, Tensor ids) -> Tensor");
  m.impl("gguf_rows", c10::DispatchKey::CompositeExplicitAutograd, &gguf_rows);
  m.def("gguf_repack(Tensor w) -> Tensor");
  m.impl("gguf_repack", c10::DispatchKey::CompositeExplicitAutograd, &gguf_repack);
  m.def("int8_pack(Tensor q, Tensor scale) -> Tensor");
  m.impl("int8_pack", c10::DispatchKey::CompositeExplicitAutograd, &int8_pack);
  m.def("int8_linear(Tensor x, Tensor packed, int n, Tensor? b, int path) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CompositeExplicitAutograd, &int8_linear);
  m.def("int8_gemm(Tensor xq, Tensor packed, int n, int path) -> Tensor");
  m.impl("int8_gemm", c10::DispatchKey::CompositeExplicitAutograd, &int8_gemm);
  m.def("int8_best_path() -> int", &int8_best_path);
  m.def("int8_set_path(int path) -> int", &int8_set_path);
  m.def("int8_amx_why() -> str", &int8_amx_why);
  m.def("int8_amx_min_rows(int m) -> int", &int8_amx_min_rows);
  m.def("add_rms_norm_quant(Tensor(a!) residual, Tensor x, Tensor weight, float eps, int path) "
        "-> (Tensor, Tensor)");
  m.impl("add_rms_norm_quant", c10::DispatchKey::CompositeExplicitAutograd, &add_rms_norm_quant);
  m.def("silu_mul_quant(Tensor gate_up, int inter, int path) -> (Tensor, Tensor)");
  m.impl("silu_mul_quant", c10::DispatchKey::CompositeExplicitAutograd, &silu_mul_quant);
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CompositeExplicitAutograd, &decode_attention);
  m.def("decode_attention_paged(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, "
        "Tensor? bias, float scale, float k_scale=1.0, float v_scale=1.0) -> Tensor");
  m.impl("decode_attention_paged", c10::DispatchKey::CompositeExplicitAutograd,
         &decode_attention_paged);
  m.def("prefill_attention_paged(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, "
        "float scale, float k_scale, float v_scale, int kv_heads, Tensor(a!)? out=None) -> Tensor");
  m.impl("prefill_attention_paged", c10::DispatchKey::CompositeExplicitAutograd,
         &prefill_attention_paged);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor out_slots, int num_heads, int kv_heads, int head_dim) -> Tensor");
  m.impl("rope_store", c10::DispatchKey::CompositeExplicitAutograd, &rope_store);
  m.def("silu_mul(Tensor gate_up, int inter) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CompositeExplicitAutograd, &silu_mul);
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("add_rms_norm", c10::DispatchKey::CompositeExplicitAutograd, &add_rms_norm);
  m.def("sample_rows(Tensor logits, Tensor knobs, Tensor mask_rows, Tensor bitmask, "
        "Tensor edit_ptr, Tensor edit_tok, Tensor edit_kind, Tensor edit_val, "
        "Tensor(a!)? probs, Tensor(b!)? lse) -> Tensor");
  m.impl("sample_rows", c10::DispatchKey::CompositeExplicitAutograd, &sample_rows);
}
