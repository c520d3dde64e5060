#pragma once
// Token sampling, one request's row per task (engine/sched/sampler.py hands it the batch): the
// grammar's bitmask and the request's penalties, bias and bans on a copy of the row, then
// temperature, top-k, softmax, min-p, top-p and the inverse-CDF draw at the request's uniform,
// in three passes over the row and no allocation (per-thread scratch, grown once). The rule is
// sampler.py's torch path (processed_probs + draw), which is the per-row reference's:
//   - top-k keeps the tokens whose scaled logit is >= the k-th largest (ties kept);
//   - probabilities are the softmax over those; below float32's smallest normal they are 0;
//   - min-p drops p < min_p * p_max; top-p drops a token when the tokens more likely than it
//     (ties: the lower id first) already hold more than top_p (mass after min-p, before any
//     renormalization);
//   - the token is the first, in id order, whose cumulative kept mass exceeds u * total.
// Weights w = exp(s - s_max) (so w_max = 1) stand for p = w / Z throughout. Top-p sorts no row:
// w's float bits give 32 buckets per halving (exactly monotone in w), the buckets' masses say
// which one the nucleus ends in, and only that bucket's tokens are sorted.
#include "common.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace {

constexpr int64_t DRAW_BLOCK_TOKENS = 1024;  // the draw's first level (sampler.DRAW_BLOCK)
constexpr int TOP_P_BUCKETS = 1024;          // 32 per halving of w; the last takes the rest
constexpr int BUCKET_SHIFT = 18;             // 23 mantissa bits - 5 (32 = 2^5 per halving)
constexpr uint32_t ONE_BITS = 0x3F800000u;   // 1.0f
constexpr int KTH_SHIFT = 20;                // top-k: a histogram over 4096 order-key bins
constexpr float LN_TINY = -87.33654475f;     // log(FLT_MIN): below it w is 0

// knobs columns (float64 [R, 7], sampler.py's _KNOBS)
enum { K_TEMP = 0, K_TOPK, K_TOPP, K_MINP, K_U, K_FREQ, K_PRES, K_COLS };
// edit kinds, applied in this order per row (sampler.py's _penalize order)
enum : int32_t { EDIT_REPEAT = 0, EDIT_COUNT = 1, EDIT_BIAS = 2, EDIT_BAN = 3 };

struct SampleScratch {
  std::vector<float> buf;  // the row being sampled: edited logits, scaled, then weights
  std::vector<double> hist, blocks;
  std::vector<uint32_t> bins;
  std::vector<float> cand;
  std::vector<std::pair<float, int64_t>> edge;
};

inline SampleScratch& sample_scratch() {
  thread_local SampleScratch s;
  return s;
}

inline uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// floats in the order of an unsigned key (negatives reversed below the positives)
inline uint32_t order_key(float f) {
  const uint32_t u = fbits(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// w in (0, 1]: 32 buckets per halving below 1, the last holding everything under 2^-32
inline int w_bucket(float w) {
  int32_t d = static_cast<int32_t>(ONE_BITS) - static_cast<int32_t>(fbits(w));
  d = d < 0 ? 0 : d >> BUCKET_SHIFT;
  return d < TOP_P_BUCKETS - 1 ? d : TOP_P_BUCKETS - 1;
}

// exp of x <= 0 down to log(FLT_MIN) (below: exactly 0, never a denormal), a degree-7
// polynomial on the reduced argument: ~1 ulp, no bias in r (vec.h's exp_ps, degree 6, is 1e-7
// low at |r| = 0.35: enough for attention, not for top-p's edge over 49k probabilities, which
// the reference computes with a 1-ulp exp)
inline V16 exp_to_tiny(V16 x) {
  const M16 dead = vlt(x, vset1(LN_TINY));
  x = vmin(vmax(x, vset1(LN_TINY)), vzero());
  const V16 n = vround(vmul(x, vset1(1.44269504088896341f)));
  V16 r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  V16 p = vset1(1.0f / 5040);
  p = vfmadd(p, r, vset1(1.0f / 720));
  p = vfmadd(p, r, vset1(1.0f / 120));
  p = vfmadd(p, r, vset1(1.0f / 24));
  p = vfmadd(p, r, vset1(1.0f / 6));
  p = vfmadd(p, r, vset1(0.5f));
  p = vfmadd(p, r, vset1(1.0f));
  p = vfmadd(p, r, vset1(1.0f));
  return vmaskz(static_cast<M16>(~dead), vscalef(p, n));
}

inline V16 load_tail(const float* p, int64_t left, float fill) {
  return left >= 16 ? vload(p) : vmask_load(vset1(fill), lane_mask(left), p);
}
inline void store_tail(float* p, int64_t left, V16 v) {
  if (left >= 16) vstore(p, v);
  else vmask_store(p, lane_mask(left), v);
}

// the row with the grammar's bitmask (bit set: allowed) and the edits applied, into buf
void edited_row(const float* x, int64_t V, const int32_t* words, const int64_t* tok,
                const int32_t* kind, const float* val, int64_t ne, float freq, float pres,
                float* buf) {
  const float NEG = -std::numeric_limits<float>::infinity();
  if (words != nullptr) {
    for (int64_t i = 0; i < V; i += 16) {
      const uint32_t w = static_cast<uint32_t>(words[i >> 5]) >> (i & 31);
      const M16 m = static_cast<M16>(w & 0xFFFFu) & lane_mask(V - i);
      store_tail(buf + i, V - i, vmask_load(vset1(NEG), m, x + i));
    }
  } else {
    std::memcpy(buf, x, sizeof(float) * V);
  }
  for (int64_t e = 0; e < ne; ++e) {
    float& v = buf[tok[e]];
    switch (kind[e]) {
      case EDIT_REPEAT: v = v > 0 ? v / val[e] : v * val[e]; break;
      case EDIT_COUNT: v = v - (freq * val[e] + pres); break;
      case EDIT_BIAS: v = v + val[e]; break;
      default: v = NEG;
    }
  }
}

// log(sum(exp(x))) of a raw row (the model's distribution, which logprobs report), in float64
double raw_lse(const float* x, int64_t V) {
  const float NEG = -std::numeric_limits<float>::infinity();
  V16 vm = vset1(NEG);
  for (int64_t i = 0; i < V; i += 16) vm = vmax(vm, load_tail(x + i, V - i, NEG));
  const float m = vreduce_max(vm);
  if (!(m > NEG) || !std::isfinite(m)) return m;
  const V16 vmx = vset1(m);
  double z = 0;
  for (int64_t b = 0; b < V; b += DRAW_BLOCK_TOKENS) {
    V16 acc = vzero();
    const int64_t end = std::min(V, b + DRAW_BLOCK_TOKENS);
    for (int64_t i = b; i < end; i += 16)
      acc = vadd(acc, exp_to_tiny(vsub(load_tail(x + i, V - i, NEG), vmx)));
    z += vreduce_add(acc);
  }
  return m + std::log(z);
}

// One row: the token (-1: no finite positive mass); with `probs` the kept probabilities, with
// `lse` the raw row's log-sum-exp (from the sampling pass itself where the row is sampled
// as it is: temperature 1, no top-k, no edits).
int64_t sample_row(const float* x, int64_t V, const double* kn, const int32_t* words,
                   const int64_t* tok, const int32_t* kind, const float* val, int64_t ne,
                   float* probs, double* lse) {
  const float NEG = -std::numeric_limits<float>::infinity();
  const float INF = std::numeric_limits<float>::infinity();
  const float TINY = std::numeric_limits<float>::min();
  SampleScratch& S = sample_scratch();
  if (static_cast<int64_t>(S.buf.size()) < V) S.buf.resize(V);
  float* buf = S.buf.data();
  const float* src = x;
  if (words != nullptr || ne > 0) {
    edited_row(x, V, words, tok, kind, val, ne, static_cast<float>(kn[K_FREQ]),
               static_cast<float>(kn[K_PRES]), buf);
    src = buf;
  }
  const float t = static_cast<float>(kn[K_TEMP]);
  const bool greedy = !(t > 0);
  const bool scale = !greedy && t != 1.0f;
  // pass 1: the scaled row (into buf) and its maximum; +inf or NaN anywhere: no distribution
  V16 vm = vset1(NEG);
  M16 bad = 0;
  const V16 vt = vset1(t), vinf = vset1(INF);
  for (int64_t i = 0; i < V; i += 16) {
    V16 v = load_tail(src + i, V - i, NEG);
    bad |= static_cast<M16>(~vlt(v, vinf));
    if (scale) {
      v = vdiv(v, vt);
      store_tail(buf + i, V - i, v);
    }
    vm = vmax(vm, v);
  }
  const float ms = vreduce_max(vm);
  if (!(ms > NEG) || (bad && !greedy)) return -1;
  const float* s = scale ? buf : src;
  const int64_t k = static_cast<int64_t>(kn[K_TOPK]);
  const bool as_is = !greedy && !scale && src == x && k == 0;
  if (lse != nullptr && !as_is) *lse = raw_lse(x, V);
  if (greedy) {  // the first token at the maximum (torch.argmax's choice)
    for (int64_t i = 0; i < V; ++i)
      if (s[i] == ms) return i;
    return -1;
  }
  // top-k: the k-th largest scaled logit, from a histogram of order keys and one bin's values
  float kth = NEG;
  if (k > 0 && k < V) {
    S.bins.assign(size_t{1} << (32 - KTH_SHIFT), 0u);
    for (int64_t i = 0; i < V; ++i) ++S.bins[order_key(s[i]) >> KTH_SHIFT];
    int64_t above = 0, b = static_cast<int64_t>(S.bins.size()) - 1;
    for (; b > 0 && above + S.bins[b] < k; --b) above += S.bins[b];
    S.cand.clear();
    for (int64_t i = 0; i < V; ++i)
      if ((order_key(s[i]) >> KTH_SHIFT) == static_cast<uint32_t>(b)) S.cand.push_back(s[i]);
    const int64_t need = std::min<int64_t>(k - above, S.cand.size());
    std::nth_element(S.cand.begin(), S.cand.begin() + (need - 1), S.cand.end(),
                     std::greater<float>());
    kth = S.cand[need - 1];
  }
  const double top_p = kn[K_TOPP];
  const bool nucleus = top_p < 1.0;
  const float min_p = static_cast<float>(kn[K_MINP]);
  const int64_t nb = (V + DRAW_BLOCK_TOKENS - 1) / DRAW_BLOCK_TOKENS;
  S.blocks.assign(nb, 0.0);
  if (nucleus) S.hist.assign(TOP_P_BUCKETS, 0.0);
  // pass 2: weights (top-k's cut, min-p's), Z over top-k's survivors, and either the
  // histogram (top-p) or the draw's block sums
  double Z = 0;
  const V16 vms = vset1(ms), vkth = vset1(kth), vminp = vset1(min_p);
  // the last bucket's tokens (most of a peaked row's) are summed in lanes, not one by one
  const V16 vlast = vset1(
      bits_f(ONE_BITS - (static_cast<uint32_t>(TOP_P_BUCKETS - 1) << BUCKET_SHIFT)));
  alignas(64) float lanes[16];
  for (int64_t blk = 0; blk < nb; ++blk) {
    V16 zacc = vzero(), bacc = vzero(), lacc = vzero();
    const int64_t end = std::min(V, (blk + 1) * DRAW_BLOCK_TOKENS);
    for (int64_t i = blk * DRAW_BLOCK_TOKENS; i < end; i += 16) {
      const V16 v = load_tail(s + i, V - i, NEG);
      V16 w = exp_to_tiny(vsub(v, vms));
      if (k > 0) w = vmaskz(static_cast<M16>(~vlt(v, vkth)), w);
      zacc = vadd(zacc, w);
      if (min_p > 0) w = vmaskz(static_cast<M16>(~vlt(w, vminp)), w);
      store_tail(buf + i, V - i, w);
      if (nucleus) {
        M16 nz = vlt(vlast, w);
        lacc = vadd(lacc, vmaskz(static_cast<M16>(~nz), w));
        if (nz) {
          vstore(lanes, w);
          for (; nz; nz &= nz - 1) {
            const float wl = lanes[__builtin_ctz(nz)];
            S.hist[w_bucket(wl)] += wl;
          }
        }
      } else {
        bacc = vadd(bacc, w);
      }
    }
    Z += vreduce_add(zacc);
    S.blocks[blk] = vreduce_add(bacc);
    if (nucleus) S.hist[TOP_P_BUCKETS - 1] += vreduce_add(lacc);
  }
  if (!(Z > 0) || !std::isfinite(Z)) return -1;
  if (lse != nullptr && as_is) *lse = ms + std::log(Z);
  const float inv_z = static_cast<float>(1.0 / Z);
  // the kept tokens: p = w / Z >= FLT_MIN and (w > w_cut or w == w_cut and id <= id_cut)
  float w_cut = 0;
  int64_t id_cut = -1;
  if (nucleus) {
    const double T = top_p * Z;
    double above_mass = 0;
    int e = 0;
    for (; e < TOP_P_BUCKETS && above_mass + S.hist[e] <= T; ++e) above_mass += S.hist[e];
    // bucket e holds lo < w <= hi; the buckets above it are kept whole
    auto top_of = [](int b) {  // the largest w of bucket b
      return bits_f(ONE_BITS - (static_cast<uint32_t>(b) << BUCKET_SHIFT));
    };
    const float hi = e == TOP_P_BUCKETS ? 0.0f : top_of(e);
    const float lo = e >= TOP_P_BUCKETS - 1 ? (e == TOP_P_BUCKETS ? hi : 0.0f) : top_of(e + 1);
    // pass 3: the block sums of the buckets above the edge, and the edge bucket's tokens
    S.edge.clear();
    const V16 vhi = vset1(hi), vlo = vset1(lo), vinvz = vset1(inv_z), vtiny = vset1(TINY);
    for (int64_t blk = 0; blk < nb; ++blk) {
      V16 bacc = vzero();
      const int64_t end = std::min(V, (blk + 1) * DRAW_BLOCK_TOKENS);
      for (int64_t i = blk * DRAW_BLOCK_TOKENS; i < end; i += 16) {
        const V16 w = load_tail(buf + i, V - i, 0.0f);
        const M16 live = static_cast<M16>(~vlt(vmul(w, vinvz), vtiny));
        const M16 up = vlt(vhi, w) & live;
        M16 at = static_cast<M16>(vlt(vlo, w) & ~up & live);
        bacc = vadd(bacc, vmaskz(up, w));
        for (; at; at &= at - 1) {
          const int64_t j = i + __builtin_ctz(at);
          S.edge.emplace_back(buf[j], j);
        }
      }
      S.blocks[blk] = vreduce_add(bacc);
    }
    std::sort(S.edge.begin(), S.edge.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    w_cut = hi;
    double before = above_mass;
    for (const auto& [w, j] : S.edge) {
      if (before > T) break;
      before += w;
      w_cut = w;
      id_cut = j;
      S.blocks[j / DRAW_BLOCK_TOKENS] += w;
    }
  }
  auto kept = [&](int64_t i) {
    const float w = buf[i];
    return !(w * inv_z < TINY) && (w > w_cut || (w == w_cut && i <= id_cut));
  };
  if (probs != nullptr)
    for (int64_t i = 0; i < V; ++i) probs[i] = kept(i) ? buf[i] * inv_z : 0.0f;
  // the draw: a block from the block sums, then the token inside it, in float64
  double total = 0;
  for (int64_t b = 0; b < nb; ++b) total += S.blocks[b];
  if (!(total > 0) || !std::isfinite(total)) return -1;
  const double target = kn[K_U] * total;
  double acc = 0;
  int64_t b = 0;
  for (; b < nb - 1 && acc + S.blocks[b] <= target; ++b) acc += S.blocks[b];
  const double rest = target - acc;
  double c = 0;
  int64_t last = -1;
  const int64_t end = std::min(V, (b + 1) * DRAW_BLOCK_TOKENS);
  for (int64_t i = b * DRAW_BLOCK_TOKENS; i < end; ++i) {
    if (!kept(i)) continue;
    last = i;
    c += buf[i];
    if (c > rest) return i;
  }
  if (last >= 0) return last;  // u * total rounded past the block's mass
  for (int64_t i = V - 1; i >= 0; --i)
    if (kept(i)) return i;
  return -1;
}

// logits [R, V] float32 (rows contiguous); knobs [R, K_COLS] float64; mask_rows [R] int64
// (the row of `bitmask` [M, words] int32 a row reads, -1 none); edits as CSR: edit_ptr [R + 1]
// int64 into edit_tok int64 / edit_kind int32 / edit_val float32. probs [R, V] float32 (tests):
// each row's kept probabilities; lse [R] float64: each raw row's log-sum-exp (logprobs).
// Returns the tokens [R] int64 (-1: nothing to draw).
Tensor sample_rows(const Tensor& logits, const Tensor& knobs, const Tensor& mask_rows,
                   const Tensor& bitmask, const Tensor& edit_ptr, const Tensor& edit_tok,
                   const Tensor& edit_kind, const Tensor& edit_val,
                   const std::optional<Tensor>& probs, const std::optional<Tensor>& lse) {
  TORCH_CHECK(isa_supported(), "sample_rows: this CPU lacks the library's ISA");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "sample_rows: logits must be float32 [R, V] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(knobs.scalar_type() == at::kDouble && knobs.is_contiguous() &&
                  knobs.size(0) == R && knobs.size(1) == K_COLS,
              "sample_rows: knobs must be float64 [R, 7]");
  TORCH_CHECK(mask_rows.scalar_type() == at::kLong && mask_rows.numel() == R,
              "sample_rows: mask_rows must be int64 [R]");
  TORCH_CHECK(edit_ptr.scalar_type() == at::kLong && edit_ptr.numel() == R + 1 &&
                  edit_tok.scalar_type() == at::kLong && edit_kind.scalar_type() == at::kInt &&
                  edit_val.scalar_type() == at::kFloat && edit_tok.numel() == edit_kind.numel() &&
                  edit_tok.numel() == edit_val.numel(),
              "sample_rows: bad edit arrays");
  const Tensor mr = mask_rows.contiguous(), ep = edit_ptr.contiguous();
  const Tensor et = edit_tok.contiguous(), ek = edit_kind.contiguous(), ev = edit_val.contiguous();
  const int64_t* mrp = mr.data_ptr<int64_t>();
  const int64_t* epp = ep.data_ptr<int64_t>();
  const int64_t* etp = et.data_ptr<int64_t>();
  const int64_t ne = et.numel();
  TORCH_CHECK(epp[0] == 0 && epp[R] == ne, "sample_rows: edit_ptr does not span the edits");
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(epp[r] <= epp[r + 1], "sample_rows: edit_ptr is not ascending");
  for (int64_t e = 0; e < ne; ++e)
    TORCH_CHECK(etp[e] >= 0 && etp[e] < V, "sample_rows: edit token ", etp[e], " outside [0, ",
                V, ")");
  Tensor bm;
  int64_t words = 0;
  for (int64_t r = 0; r < R; ++r) {
    if (mrp[r] < 0) continue;
    if (!bm.defined()) {
      TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                      bitmask.size(1) * 32 >= V,
                  "sample_rows: bitmask must be int32 [M, >= V / 32]");
      bm = bitmask.contiguous();
      words = bm.size(1);
    }
    TORCH_CHECK(mrp[r] < bm.size(0), "sample_rows: mask row ", mrp[r], " outside the bitmask");
  }
  float* pp = nullptr;
  if (probs.has_value() && probs->defined()) {
    TORCH_CHECK(probs->scalar_type() == at::kFloat && probs->is_contiguous() &&
                    probs->size(0) == R && probs->size(1) == V,
                "sample_rows: probs must be float32 [R, V], contiguous");
    pp = probs->data_ptr<float>();
  }
  double* lsp = nullptr;
  if (lse.has_value() && lse->defined()) {
    TORCH_CHECK(lse->scalar_type() == at::kDouble && lse->is_contiguous() && lse->numel() == R,
                "sample_rows: lse must be float64 [R]");
    lsp = lse->data_ptr<double>();
  }
  Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* lp = logits.data_ptr<float>();
  const int64_t ls = logits.stride(0);
  const double* kp = knobs.data_ptr<double>();
  const int32_t* ekp = ek.data_ptr<int32_t>();
  const float* evp = ev.data_ptr<float>();
  const int32_t* bmp = bm.defined() ? bm.data_ptr<int32_t>() : nullptr;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t e0 = epp[r];
      op[r] = sample_row(lp + r * ls, V, kp + r * K_COLS,
                         mrp[r] >= 0 ? bmp + mrp[r] * words : nullptr, etp + e0, ekp + e0,
                         evp + e0, epp[r + 1] - e0, pp == nullptr ? nullptr : pp + r * V,
                         lsp == nullptr ? nullptr : lsp + r);
    }
  });
  return out;
}

}  // namespace
