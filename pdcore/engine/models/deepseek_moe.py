"""DeepSeek's MoE block (stand-in until the shared pdcore.engine.models.moe lands): a router
(V2: softmax, greedy or group-limited top-k; V3: sigmoid plus a score-correction bias, top-2
group scores, normalised weights), routed experts and shared experts, all TP-sharded by their
intermediate dimension; one all-reduce per block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcore.engine.models.layers import TPInfo, span


def deepseek_topk(logits: torch.Tensor, cfg, arch: str,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) of each token, routed_scaling_factor applied."""
    k, n_exp = cfg.num_experts_per_tok, logits.shape[-1]
    if arch == "deepseek_v2":
        scores = logits.softmax(-1)
        if getattr(cfg, "topk_method", "greedy") == "group_limited_greedy":
            g = cfg.n_group
            best = scores.view(-1, g, n_exp // g).max(-1).values
            keep = _group_mask(best, cfg.topk_group, g, n_exp)
            scores = scores.masked_fill(~keep, 0.0)
        w, ids = torch.topk(scores, k, dim=-1, sorted=False)
    else:
        scores = logits.sigmoid()
        choice = scores + bias if bias is not None else scores
        g = cfg.n_group
        best = choice.view(-1, g, n_exp // g).topk(2, dim=-1)[0].sum(-1)
        keep = _group_mask(best, cfg.topk_group, g, n_exp)
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * cfg.routed_scaling_factor, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, groups: int,
                n_exp: int) -> torch.Tensor:
    idx = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, idx, True)
    return mask.unsqueeze(-1).expand(-1, groups, n_exp // groups).reshape(-1, n_exp)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg, tp: TPInfo, arch: str) -> None:
        super().__init__()
        self.cfg, self.tp, self.arch = cfg, tp, arch
        E, H, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.i0, self.inter = span(inter, tp.rank, tp.size)
        self.gate = nn.Parameter(torch.empty(E, H), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(E), requires_grad=False)
                     if arch == "deepseek_v3" else None)
        self.w13 = nn.Parameter(torch.empty(E, 2 * self.inter, H), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, self.inter), requires_grad=False)
        shared = inter * (cfg.n_shared_experts or 0)
        self.s0, self.shared = span(shared, tp.rank, tp.size)
        self.s13 = nn.Parameter(torch.empty(2 * self.shared, H), requires_grad=False)
        self.s2 = nn.Parameter(torch.empty(H, self.shared), requires_grad=False)

    def load(self, get, opt, p: str) -> None:
        self.gate.copy_(get(p + "gate.weight"))
        if self.bias is not None:
            self.bias.copy_(get(p + "gate.e_score_correction_bias"))
        full = self.cfg.moe_intermediate_size
        gu, a, n = get(p + "experts.gate_up_proj"), self.i0, self.inter
        self.w13.copy_(torch.cat((gu[:, a : a + n], gu[:, full + a : full + a + n]), 1))
        self.w2.copy_(get(p + "experts.down_proj")[:, :, a : a + n])
        if self.shared:
            a, n = self.s0, self.shared
            self.s13.copy_(torch.cat((get(p + "shared_experts.gate_proj.weight")[a : a + n],
                                      get(p + "shared_experts.up_proj.weight")[a : a + n])))
            self.s2.copy_(get(p + "shared_experts.down_proj.weight")[:, a : a + n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.float())
        bias = self.bias.float() if self.bias is not None else None
        w, ids = deepseek_topk(logits, self.cfg, self.arch, bias)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = torch.where(ids == e)
            gu = F.linear(x[tok], self.w13[e])
            y = F.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], self.w2[e])
            out.index_add_(0, tok, y * w[tok, slot, None].to(y.dtype))
        if self.shared:
            gu = F.linear(x, self.s13)
            out = out + F.linear(F.silu(gu[:, : self.shared]) * gu[:, self.shared :], self.s2)
        return self.tp.all_reduce(out)
