"""The Mixture-of-Experts layer every MoE family shares (Qwen2-MoE, Qwen3-MoE, Mixtral,
DeepSeek-V2/V3): router, routed experts, optional shared experts.

Routing (`RouterSpec`, `select_experts`) covers softmax top-k with optional renormalisation
(Qwen, Mixtral), DeepSeek-V2's group-limited greedy (groups ranked by their best expert) and
DeepSeek-V3's sigmoid scores with a selection bias and groups ranked by their two best experts;
`scaling` is the routed scaling factor.

Two ways to spread experts over the TP ranks:
- TP experts (ep_size 1): every rank holds a floor share of every expert's intermediate
  features. Each rank runs every routed expert on every token and produces a partial sum;
  one all-reduce (together with the shared experts' partial sums) completes it.
- EP (ep_size == tp size): each rank holds whole experts (a floor span of them). The step's
  tokens are split among the ranks; each rank routes its tokens, sends every (token, expert)
  copy to the expert's owner with all_to_all_single, runs the copies it received through its
  experts, sends the results back the same way and weighs them. One all-reduce then assembles
  the full batch (the ranks' token rows are disjoint) and sums the shared experts' TP partials.
Attention stays TP in both, so every rank enters the layer with the whole batch. With
--enable-dp-attention the experts span every DP rank's ranks and the layer first gathers the
DP ranks' rows (pdcore.engine.parallel.dp_attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdcore.engine.model.fp8 import Fp8Experts, fp8_experts
from pdcore.engine.model.layers import ColumnLinear, TPInfo, linear, stand_in
from pdcore.engine.model.modelslim import StaticInt8Weight, static_of
from pdcore.engine.model.quant import Int8Experts, Int8Weight, int8_experts, scale_of
from pdcore.engine.parallel.dp_gather import gathered
from pdcore.errors import ConfigError
from pdcore.interfaces.geometry import span

# one GEMM over every expert's rows (torch >= 2.10 has it on CPU): a third less time than a
# GEMM per expert at decode batch sizes, the same on long prefills
GROUPED_MM = hasattr(F, "grouped_mm")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    top_k: int
    scoring: str = "softmax"  # "softmax" or "sigmoid"
    renormalize: bool = False
    renorm_eps: float = 0.0
    num_groups: int = 1  # > 1: only experts of the topk_groups best groups are eligible
    topk_groups: int = 1
    group_score: str = "max"  # "max" (DeepSeek-V2) or "top2_sum" (DeepSeek-V3)
    correction_bias: bool = False  # V3: a learned bias added to the scores for selection only
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"MoE router scoring {self.scoring!r} is not supported")
        if self.group_score not in ("max", "top2_sum"):
            raise ConfigError(f"MoE group score {self.group_score!r} is not supported")


def select_experts(logits: torch.Tensor, spec: RouterSpec,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids long [T, k]) from router logits [T, E]."""
    logits = logits.float()
    scores = logits.softmax(-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores + bias.float() if bias is not None else scores
    if spec.num_groups > 1:
        T, E = choice.shape
        grouped = choice.view(T, spec.num_groups, E // spec.num_groups)
        if spec.group_score == "max":
            group_scores = grouped.max(-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
        best = group_scores.topk(spec.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(T, E)
        # V2 zeroes the other groups' probabilities, V3 excludes them; either way they lose
        choice = choice.masked_fill(~keep, 0.0 if bias is None and spec.scoring == "softmax"
                                    else float("-inf"))
    ids = choice.topk(spec.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + spec.renorm_eps)
    if spec.scaling != 1.0:
        weights = weights * spec.scaling
    return weights, ids


class SharedExperts(nn.Module):
    """A gated MLP whose down projection stays a TP partial sum: the MoE layer all-reduces it
    together with the routed experts' output (one collective per layer, not two)."""

    def __init__(self, hidden: int, inter: int, tp: TPInfo) -> None:
        super().__init__()
        self.gate_up = ColumnLinear(hidden, [inter, inter], False, tp)
        self.first, self.inter = self.gate_up.shards[0]
        self.down = nn.Parameter(torch.empty(hidden, self.inter), requires_grad=False)
        self.down_int8: Int8Weight | StaticInt8Weight | None = None  # an int8 checkpoint's
        self.tp_rank = tp.rank

    def load(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up.load([gate, up])
        mine = down[:, self.first : self.first + self.inter]
        if static_of(down) is not None:  # static W8A8: quant_bias once, on rank 0
            self.down_int8 = StaticInt8Weight.of([down], [(0, down.shape[0])],
                                                 (self.first, self.inter), self.tp_rank == 0)
            self.down = nn.Parameter(stand_in(self.down), requires_grad=False)
        elif down.dtype == torch.int8:  # this rank's input features, per-token int8 like RowLinear
            self.down_int8 = Int8Weight(mine, scale_of(down))
            self.down = nn.Parameter(stand_in(self.down), requires_grad=False)
        else:
            self.down.copy_(mine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        h = F.silu(gu[:, : self.inter]) * gu[:, self.inter :]
        return self.down_int8(h) if self.down_int8 is not None else linear(h, self.down)


class MoE(nn.Module):
    """Router + routed experts (+ shared experts, optionally sigmoid-gated as in Qwen2-MoE).

    Weights load from transformers' state dict (`load_hf`): fused `experts.gate_up_proj`
    [E, 2I, H] / `experts.down_proj` [E, H, I] (transformers >= 5), or per-expert
    `experts.{e}.gate_proj|up_proj|down_proj` (or Mixtral's w1/w3/w2) of older layouts.
    """

    def __init__(self, hidden: int, num_experts: int, inter: int, router: RouterSpec,
                 tp: TPInfo, ep_size: int = 1, *, shared_inter: int = 0,
                 shared_gate: bool = False, act: str = "silu") -> None:
        super().__init__()
        # --enable-dp-attention: `tp` is the DP rank's attention group; the experts span the
        # whole group behind it, and forward() gathers every DP rank's rows first
        self.dp = tp if getattr(tp, "world", None) is not None else None
        if self.dp is not None:
            tp = self.dp.world
        if act != "silu":
            raise ConfigError(f"MoE activation {act!r} is not supported (silu only)")
        if ep_size not in (1, tp.size):
            raise ConfigError(f"--ep-size {ep_size} must be 1 or equal to --tp-size {tp.size}")
        if router.num_groups > 1 and num_experts % router.num_groups:
            raise ConfigError(f"{num_experts} experts do not split into {router.num_groups} groups")
        self.router, self.tp, self.num_experts = router, tp, num_experts
        self.ep = ep_size > 1
        self.gate = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.correction_bias = (nn.Parameter(torch.zeros(num_experts), requires_grad=False)
                                if router.correction_bias else None)
        if self.ep:
            self.first_expert, self.local_experts = span(num_experts, tp.rank, tp.size)
            self.inter_first, self.inter = 0, inter
            owners = [r for r in range(tp.size) for _ in range(span(num_experts, r, tp.size)[1])]
            self.register_buffer("owner", torch.tensor(owners, dtype=torch.long),
                                 persistent=False)
        else:
            self.first_expert, self.local_experts = 0, num_experts
            self.inter_first, self.inter = span(inter, tp.rank, tp.size)
        n = self.local_experts
        self.w13 = nn.Parameter(torch.empty(n, 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden, self.inter), requires_grad=False)
        self.fp8: Fp8Experts | None = None  # an FP8 checkpoint's experts (fp8.py)
        self.int8: Int8Experts | None = None  # an int8 (msModelSlim) checkpoint's (quant.py)
        self.shared = SharedExperts(hidden, shared_inter, tp) if shared_inter else None
        self.shared_gate = (nn.Parameter(torch.empty(1, hidden), requires_grad=False)
                            if shared_gate else None)

    # -- loading -----------------------------------------------------------------------------
    def load_hf(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        """`prefix` is the block's, e.g. 'model.layers.3.mlp.'."""
        self.gate.copy_(sd[prefix + "gate.weight"])
        if self.correction_bias is not None:
            self.correction_bias.copy_(sd[prefix + "gate.e_score_correction_bias"])
        a, n = self.first_expert, self.local_experts
        i0, ni = self.inter_first, self.inter
        self.fp8 = fp8_experts(sd, prefix, a, n, i0, ni)
        self.int8 = int8_experts(sd, prefix, a, n, i0, ni) if self.fp8 is None else None
        if self.fp8 is not None or self.int8 is not None:  # kept FP8 / int8
            self.w13 = nn.Parameter(stand_in(self.w13), requires_grad=False)
            self.w2 = nn.Parameter(stand_in(self.w2), requires_grad=False)
        else:
            gate_up, down = self._expert_weights(sd, prefix, a, n)
            full = gate_up.shape[1] // 2
            self.w13.copy_(torch.cat([gate_up[:, i0 : i0 + ni],
                                      gate_up[:, full + i0 : full + i0 + ni]], 1))
            self.w2.copy_(down[:, :, i0 : i0 + ni])
        if self.shared is not None:
            sp = next(p for p in (prefix + "shared_expert.", prefix + "shared_experts.")
                      if p + "gate_proj.weight" in sd)
            self.shared.load(sd[sp + "gate_proj.weight"], sd[sp + "up_proj.weight"],
                             sd[sp + "down_proj.weight"])
        if self.shared_gate is not None:
            self.shared_gate.copy_(sd[prefix + "shared_expert_gate.weight"])

    @staticmethod
    def _expert_weights(sd: dict[str, torch.Tensor], prefix: str, a: int,
                        n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts a..a+n as ([n, 2I, H] gate then up, [n, H, I]) from either layout."""
        fused = prefix + "experts.gate_up_proj"
        if fused in sd:
            return sd[fused][a : a + n], sd[prefix + "experts.down_proj"][a : a + n]
        names = (("gate_proj", "up_proj", "down_proj")
                 if prefix + f"experts.{a}.gate_proj.weight" in sd else ("w1", "w3", "w2"))
        gu, dn = [], []
        for e in range(a, a + n):
            p = prefix + f"experts.{e}."
            gu.append(torch.cat([sd[p + names[0] + ".weight"], sd[p + names[1] + ".weight"]], 0))
            dn.append(sd[p + names[2] + ".weight"])
        return torch.stack(gu), torch.stack(dn)

    # -- forward -----------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.float())
        return select_experts(logits, self.router, self.correction_bias)

    def _aligned(self, x: torch.Tensor) -> bool:
        """grouped_mm wants every row stride a multiple of 16 bytes (an uneven TP shard of the
        intermediate features may not be)."""
        size = x.element_size()
        return (x.shape[1] * size) % 16 == 0 and (self.inter * size) % 16 == 0

    def _run_local(self, x: torch.Tensor, local_ids: torch.Tensor,
                   weights: torch.Tensor | None) -> torch.Tensor:
        """Sum over k of weight * expert(x) for rows x [N, H] and local expert ids [N, k]
        (ids outside 0..local_experts-1 are skipped); weights None means 1.

        The (row, k) copies are sorted by expert once (stable: rows stay in order within an
        expert), so every expert's rows are one contiguous slice: one grouped GEMM per
        projection over all experts where torch has it on this device, else one GEMM per
        expert. Results are added back in ascending expert order, as transformers adds them."""
        k = local_ids.shape[1]
        flat = local_ids.reshape(-1)
        valid = (flat >= 0) & (flat < self.local_experts)
        order = torch.argsort(torch.where(valid, flat, self.local_experts), stable=True)
        counts = torch.bincount(flat[valid], minlength=self.local_experts)
        ends = torch.cumsum(counts, 0)
        order = order[: int(ends[-1])] if len(ends) else order[:0]
        rows = order // k
        xs = x.index_select(0, rows)
        if self.int8 is not None:  # int8 GEMMs per expert, each row quantized per token
            ys = torch.empty_like(xs)
            start = 0
            for e, c in enumerate(counts.tolist()):
                if c:
                    ys[start : start + c] = self.int8.run(e, xs[start : start + c])
                    start += c
            return self._combine(x, rows, ys, order, weights)
        w13, w2 = (self.w13, self.w2) if self.fp8 is None else self.fp8.dequantized(x.dtype)
        if GROUPED_MM and x.device.type == "cpu" and len(ends) and self._aligned(x):
            # views of the [E, out, in] weights as [E, in, out]: no copy
            offs = ends.to(torch.int32)
            gu = F.grouped_mm(xs, w13.transpose(1, 2), offs=offs)
            h = F.silu(gu[:, : self.inter]) * gu[:, self.inter :]
            ys = F.grouped_mm(h, w2.transpose(1, 2), offs=offs)
        else:
            ys = torch.empty_like(xs)
            start = 0
            for e, c in enumerate(counts.tolist()):
                if c:
                    gu = F.linear(xs[start : start + c], w13[e])
                    h = F.silu(gu[:, : self.inter]) * gu[:, self.inter :]
                    ys[start : start + c] = F.linear(h, w2[e])
                    start += c
        return self._combine(x, rows, ys, order, weights)

    @staticmethod
    def _combine(x: torch.Tensor, rows: torch.Tensor, ys: torch.Tensor, order: torch.Tensor,
                 weights: torch.Tensor | None) -> torch.Tensor:
        if weights is not None:
            ys = ys * weights.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, rows, ys)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp is not None:
            return gathered(self.dp, x, self._forward)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep:
            out = self._forward_ep(x)
        else:
            weights, ids = self.route(x)
            out = self._run_local(x, ids, weights)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(linear(x, self.shared_gate)) * s
            out = out + s
        return self.tp.all_reduce(out)

    def _forward_ep(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the tokens through all-to-all dispatch and combine; the other
        rows stay zero for the caller's all-reduce."""
        import torch.distributed as dist

        T, H = x.shape
        a, n = span(T, self.tp.rank, self.tp.size)
        xs = x[a : a + n]
        weights, ids = self.route(xs)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        dest = self.owner[flat]
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.tp.size)
        recv_counts = torch.empty_like(send_counts)
        group = self.tp.group
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        send_x = xs.repeat_interleave(k, 0)[order].contiguous()
        send_e = flat[order].contiguous()
        recv_x = x.new_empty(sum(recv), H)
        recv_e = flat.new_empty(sum(recv))
        dist.all_to_all_single(recv_x, send_x, recv, send, group=group)
        dist.all_to_all_single(recv_e, send_e, recv, send, group=group)
        y = self._run_local(recv_x, (recv_e - self.first_expert).unsqueeze(1), None)
        back = x.new_empty(len(flat), H)
        dist.all_to_all_single(back, y, send, recv, group=group)
        per_copy = torch.empty_like(back)
        per_copy[order] = back
        mine = (per_copy.view(n, k, H) * weights.unsqueeze(-1).to(x.dtype)).sum(1)
        out = torch.zeros_like(x)
        out[a : a + n] = mine
        return out
