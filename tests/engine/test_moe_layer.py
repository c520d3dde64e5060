"""pdcore's MoE layer against transformers' own MoE blocks on random weights: TP=1, the sum of
TP shards, and EP=2 over a real gloo group (all-to-all dispatch and combine)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from pdcore.engine.model.layers import TPInfo
from pdcore.engine.model.moe import MoE, RouterSpec
from pdcore.testing.processes import free_port

H, E, INTER, SHARED = 64, 8, 32, 48


def _qwen2():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2,
                         moe_intermediate_size=INTER, shared_expert_intermediate_size=SHARED,
                         norm_topk_prob=False)
    spec = RouterSpec(top_k=2, renormalize=False)
    return Qwen2MoeSparseMoeBlock(cfg), {"router": spec, "shared_inter": SHARED,
                                         "shared_gate": True}


def _qwen3():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=3,
                         moe_intermediate_size=INTER, norm_topk_prob=True)
    return Qwen3MoeSparseMoeBlock(cfg), {"router": RouterSpec(top_k=3, renormalize=True)}


def _mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2,
                        intermediate_size=INTER)
    return MixtralSparseMoeBlock(cfg), {"router": RouterSpec(top_k=2, renormalize=True)}


def _deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3,
                           moe_intermediate_size=INTER, n_shared_experts=2, n_group=4,
                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    spec = RouterSpec(top_k=3, scoring="sigmoid", renormalize=True, renorm_eps=1e-20,
                      num_groups=4, topk_groups=2, group_score="top2_sum",
                      correction_bias=True, scaling=2.5)
    return DeepseekV3MoE(cfg), {"router": spec, "shared_inter": 2 * INTER}


def _deepseek_v2():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=2,
                           moe_intermediate_size=INTER, n_shared_experts=1, n_group=4,
                           topk_group=2, topk_method="group_limited_greedy",
                           routed_scaling_factor=1.5)
    spec = RouterSpec(top_k=2, num_groups=4, topk_groups=2, group_score="max", scaling=1.5)
    return DeepseekV2Moe(cfg), {"router": spec, "shared_inter": INTER}


FAMILIES = {"qwen2_moe": _qwen2, "qwen3_moe": _qwen3, "mixtral": _mixtral,
            "deepseek_v3": _deepseek_v3, "deepseek_v2": _deepseek_v2}


def _random_block(name: str, seed: int = 0) -> tuple[nn.Module, dict, dict]:
    torch.manual_seed(seed)
    block, kwargs = FAMILIES[name]()
    block = block.float().eval()
    with torch.no_grad():
        for t in list(block.parameters()) + list(block.buffers()):
            t.normal_(0.0, 0.3)  # routers start at zero in transformers: every weight random
    sd = {"mlp." + k: v for k, v in block.state_dict().items()}
    return block, kwargs, sd


def _ours(kwargs: dict, sd: dict, tp: TPInfo, ep_size: int = 1) -> MoE:
    m = MoE(H, E, INTER, tp=tp, ep_size=ep_size, **kwargs)
    with torch.no_grad():
        m.load_hf(sd, "mlp.")
    return m.eval()


def _inputs(T: int = 23, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


def _reference(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x.unsqueeze(0))[0]


class _PartialSums(TPInfo):
    """A TP rank whose all-reduce is left to the test (it sums the ranks' partials itself)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("grouped", [True, False])
def test_moe_matches_transformers_tp1(grouped, monkeypatch):
    """Both expert paths: one grouped GEMM over all experts, and one GEMM per expert."""
    from pdcore.engine.model import moe

    if grouped and not moe.GROUPED_MM:
        pytest.skip("this torch has no grouped_mm")
    monkeypatch.setattr(moe, "GROUPED_MM", grouped)
    for name in FAMILIES:
        block, kwargs, sd = _random_block(name)
        x = _inputs()
        with torch.no_grad():
            ours = _ours(kwargs, sd, TPInfo())(x)
        torch.testing.assert_close(ours, _reference(block, x), rtol=1e-5, atol=1e-5, msg=name)


def test_moe_tp_shards_sum_to_transformers():
    """Two (and three: uneven intermediate split) TP ranks' partial sums add up to the block."""
    for name in FAMILIES:
        block, kwargs, sd = _random_block(name, seed=3)
        x = _inputs(seed=4)
        for size in (2, 3):
            with torch.no_grad():
                parts = [_ours(kwargs, sd, _PartialSums(r, size))(x) for r in range(size)]
            torch.testing.assert_close(sum(parts), _reference(block, x), rtol=1e-5, atol=1e-5,
                                       msg=f"{name} tp={size}")


def test_router_grouped_topk_only_picks_allowed_groups():
    from pdcore.engine.model.moe import select_experts

    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    spec = RouterSpec(top_k=2, num_groups=4, topk_groups=1)
    _, ids = select_experts(logits, spec)
    assert (ids[:, 0] // 2 == ids[:, 1] // 2).all()  # both from the single allowed group


EP_CASES = [(name, T) for name in ("qwen2_moe", "mixtral", "deepseek_v3") for T in (23, 1)]


def _ep_rank(rank: int, port: int, q: object) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        torch.set_num_threads(1)
        tp = TPInfo(rank, 2, dist.group.WORLD, dist.group.WORLD)
        for name, T in EP_CASES:
            block, kwargs, sd = _random_block(name, seed=5)
            x = _inputs(T, seed=6)
            with torch.no_grad():
                out = _ours(kwargs, sd, tp, ep_size=2)(x)
            ref = _reference(block, x)
            err = ((out - ref).abs().max() / (1.0 + ref.abs().max())).item()
            q.put((rank, name, T, err, out.shape[0]))
    finally:
        dist.destroy_process_group()


def test_moe_ep2_all_to_all_matches_transformers():
    """EP=2 over gloo: each rank holds 4 whole experts; batches of 23 and of 1 token (one rank
    then dispatches nothing but still serves its experts)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ep_rank, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=180) for _ in range(2 * len(EP_CASES))]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for rank, name, T, err, rows in results:
        assert rows == T and err < 1e-6, (rank, name, T, err)
