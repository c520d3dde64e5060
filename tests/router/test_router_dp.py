"""Router DP options without servers: --dp-aware's per-rank workers in the registry, per-rank
load from /get_load, the rank fields a request carries (--dp-aware, --prefill-round-robin-balance),
and the CLI flags."""

from __future__ import annotations

import pytest

from pdcore.errors import ConfigError
from pdcore.router.config import RouterConfig
from pdcore.router.health import parse_load
from pdcore.router.policies import DPRanks
from pdcore.router.workers import WorkerRegistry

P, D = "http://127.0.0.1:30000", "http://127.0.0.1:30001"


def _registry() -> tuple[WorkerRegistry, list[str]]:
    forgotten: list[str] = []
    reg = WorkerRegistry(RouterConfig(), on_remove=lambda w: forgotten.append(w.key))
    reg.add(P, "prefill", 8998)
    reg.add(D, "decode")
    return reg, forgotten


def test_expand_turns_a_server_into_one_healthy_worker_per_rank() -> None:
    reg, forgotten = _registry()
    p = reg.get(P)
    assert p is not None and p.key == P and not p.healthy
    ranks = reg.expand(p, 2)
    assert [w.key for w in ranks] == [f"{P}@0", f"{P}@1"]
    assert all(w.url == P and w.healthy and w.bootstrap_port == 8998 for w in ranks)
    assert ranks[0].circuit is not ranks[1].circuit  # one rank's failures open only its own
    assert forgotten == [P] and p not in reg
    assert [w.snapshot()["url"] for w in reg.available("prefill")] == [f"{P}@0", f"{P}@1"]
    assert reg.expand(p, 2) == []  # a stale entry expands once
    with pytest.raises(ConfigError):
        reg.add(P, "prefill", 8998)  # the server is registered through its ranks
    assert reg.get(f"{P}@1") is ranks[1] and reg.get(P) is ranks[0]


def test_removing_a_server_url_removes_all_its_ranks() -> None:
    reg, forgotten = _registry()
    reg.expand(reg.get(D), 3)  # type: ignore[arg-type]
    reg.remove(f"{D}@1")
    assert [w.key for w in reg.of_type("decode")] == [f"{D}@0", f"{D}@2"]
    reg.remove(D)
    assert reg.of_type("decode") == [] and forgotten[-2:] == [f"{D}@0", f"{D}@2"]
    with pytest.raises(KeyError):
        reg.remove(D)


def test_load_of_one_dp_rank() -> None:
    loads = [{"dp_rank": 0, "num_tokens": 5}, {"dp_rank": 1, "num_tokens": 7}]
    assert parse_load(loads) == 12
    assert parse_load(loads, 1) == 7 and parse_load(loads, 0) == 5
    assert parse_load(loads, 2) == -1 and parse_load({"load": 3}, 0) == -1


def test_rank_fields_of_a_request() -> None:
    reg, _ = _registry()
    p, d = reg.get(P), reg.get(D)
    assert p is not None and d is not None
    assert DPRanks(round_robin=False).fields(p, d) == {}  # P's rank follows the room
    p.dp_size = 2
    rr = DPRanks(round_robin=True)
    assert [rr.fields(p, d) for _ in range(3)] == [
        {"disagg_prefill_dp_rank": r} for r in (0, 1, 0)]
    p_ranks, d_ranks = reg.expand(p, 2), reg.expand(d, 2)
    assert rr.fields(p_ranks[1], d_ranks[0]) == {"disagg_prefill_dp_rank": 1,
                                                 "data_parallel_rank": 0}


def test_cli_flags() -> None:
    from pdcore.router.cli import parse_router_args, router_help

    cfg = parse_router_args(["--pd-disaggregation", "--prefill", P, "8998", "--decode", D,
                             "--dp-aware", "--prefill-round-robin-balance"])
    assert cfg.dp_aware and cfg.prefill_round_robin_balance
    text = router_help()
    assert "--dp-aware" in text and "--prefill-round-robin-balance" in text


def test_discovery_keeps_and_removes_an_expanded_server() -> None:
    """--dp-aware with --service-discovery: a pod whose server became URL@rank entries stays
    registered while its pod is Ready, and leaves with all its ranks when the pod goes."""
    from pdcore.router.discovery import ServiceDiscovery

    reg, forgotten = _registry()
    sd = ServiceDiscovery(RouterConfig(), reg, None)
    url = "http://127.0.0.1:9001"
    sd._reconcile("decode", {url: None})
    ranks = reg.expand(reg.get(url), 2)
    assert all(w in reg for w in ranks)
    forgotten.clear()  # expand() forgot the unexpanded entry
    sd._reconcile("decode", {url: None})  # a resync: nothing changes
    mine = [w.key for w in reg if w.url == url]
    assert mine == [f"{url}@0", f"{url}@1"] and forgotten == []
    sd._reconcile("decode", {})  # the pod is gone
    assert reg.get(url) is None and sorted(forgotten) == mine
