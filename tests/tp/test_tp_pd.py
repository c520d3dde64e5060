"""PD with different TP sizes on prefill and decode (real servers on loopback):
P TP=2 -> D TP=1 and P TP=1 -> D TP=2, through the per-head slice path and through pd-staging,
token-identical to the unified engine; staging bypassed when the TP sizes are equal; a chunk
larger than the staging buffer fails only its request."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
import torch
from tp_helpers import NEW, STAGING, Fleet, pd_generate

from pdcore.testing.pages import load_at_rest

pytestmark = pytest.mark.heavy  # TP process trees

HAS_STAGING = importlib.util.find_spec("pd_staging") is not None
needs_staging = pytest.mark.skipif(not HAS_STAGING,
                                   reason="pd-staging not installed (pip install -e plugins/pd-staging)")
SMALL_BUFFER = {"SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": "1"}

# n: no staging; s: staging. Pn -> Ds and Ps -> Dn take the slice path (one side without it).
SPECS = {
    "p1n": ("prefill", 1, {}), "p2n": ("prefill", 2, {}),
    "p1s": ("prefill", 1, STAGING), "p2s": ("prefill", 2, {**STAGING, **SMALL_BUFFER}),
    "d1s": ("decode", 1, STAGING), "d2s": ("decode", 2, STAGING),
}


def _fleet(backend: str, model, env: dict | None = None):
    fleet = Fleet(backend, str(model), SPECS, env).start()
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def tcp_fleet(tiny_tp_model):
    yield from _fleet("tcp", tiny_tp_model)


def _same_as_unified(fleet: Fleet, p: str, d: str, prompts, unified) -> None:
    for i, (ids, want) in enumerate(zip(prompts, unified)):
        status, out = pd_generate(fleet, p, d, ids, NEW)
        assert status == 200, f"{p}->{d} prompt {i}: {out}"
        assert out["output_ids"] == want, f"{p}->{d} prompt {i} differs from unified"


def _staged(fleet: Fleet, p: str, d: str) -> tuple[int, int]:
    return fleet.load(p).get("kv_staged_bytes", 0), fleet.load(d).get("kv_staged_rooms", 0)


def check_fleet(fleet: Fleet, prompts, unified) -> None:
    # equal TP first: staging configured on both sides, yet no staging traffic at all
    _same_as_unified(fleet, "p1s", "d1s", prompts[:3], unified[:3])
    assert _staged(fleet, "p1s", "d1s") == (0, 0)
    assert fleet.load("d1s").get("kv_staging_grants", 0) == 0
    assert fleet.load("p1s").get("kv_direct_bytes", 0) > 0
    # slice path: one side without staging
    _same_as_unified(fleet, "p2n", "d1s", prompts, unified)
    _same_as_unified(fleet, "p1n", "d2s", prompts, unified)
    assert fleet.load("p2n").get("kv_staged_bytes", 0) == 0
    assert fleet.load("p1n").get("kv_staged_bytes", 0) == 0
    rooms_d1 = fleet.load("d1s").get("kv_staged_rooms", 0)
    # staging: both sides on
    _same_as_unified(fleet, "p2s", "d1s", prompts, unified)
    _same_as_unified(fleet, "p1s", "d2s", prompts, unified)
    assert fleet.load("p2s").get("kv_staged_bytes", 0) > 0
    assert fleet.load("p1s").get("kv_staged_bytes", 0) > 0
    assert fleet.load("d1s").get("kv_staged_rooms", 0) == rooms_d1 + len(prompts)
    assert fleet.load("d2s").get("kv_staged_rooms", 0) == len(prompts)
    for name in fleet.servers:
        load = fleet.load(name)
        assert load_at_rest(load), (name, load)


@needs_staging
def test_hetero_tp_slice_and_staging_token_identical_tcp(tcp_fleet, prompts_and_unified):
    check_fleet(tcp_fleet, *prompts_and_unified)


@needs_staging
def test_oversize_chunk_fails_only_its_request(tcp_fleet, prompts_and_unified):
    prompts, unified = prompts_and_unified
    # p2s has 1 MiB buffers; its rank 1 holds 2 of the 3 KV heads: 2 layers * 2 (K, V) *
    # 2 heads * 16 dims * 4 B = 512 B per token, so one 2400-token chunk needs 1.2 MiB
    big = torch.randint(100, 40000, (2400,), generator=torch.Generator().manual_seed(1)).tolist()
    status, out = pd_generate(tcp_fleet, "p2s", "d1s", big, 4)
    assert status >= 500 and "staging buffer" in str(out), (status, out)
    _same_as_unified(tcp_fleet, "p2s", "d1s", prompts[:2], unified[:2])  # the server is fine
    for name in ("p2s", "d1s"):
        load = tcp_fleet.load(name)
        assert load_at_rest(load), (name, load)


@pytest.mark.slow
@needs_staging
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                    reason="mooncake-transfer-engine not installed")
def test_hetero_tp_slice_and_staging_token_identical_mooncake(tiny_tp_model,
                                                               prompts_and_unified):
    gen = _fleet("mooncake", tiny_tp_model, {"MC_LOG_LEVEL": "WARNING",
                                             "MOONCAKE_PROTOCOL": "tcp"})
    fleet = next(gen)
    try:
        check_fleet(fleet, *prompts_and_unified)
    finally:
        gen.close()


@needs_staging
def test_hetero_tp_over_shm_cma(tiny_tp_model, prompts_and_unified):
    """shm in its default mode: every rank of P TP 2 writes into D's private (thp) memory with
    process_vm_writev, per-head slices and staged bulk writes alike; and into each rank of a
    D TP 2."""
    from pdcore.builtin.shm_copy import cma_permitted

    if not cma_permitted()[0]:
        pytest.skip(f"cma not permitted here: {cma_permitted()[1]}")
    prompts, unified = prompts_and_unified
    specs = {k: SPECS[k] for k in ("p2n", "p1n", "p2s", "d1s", "d2s")}
    fleet = Fleet("shm", str(tiny_tp_model), specs).start()
    try:
        assert {httpx.get(s.url + "/server_info", timeout=10).json()["memory_pool"]
                for s in fleet.servers.values()} == {"thp"}
        _same_as_unified(fleet, "p2n", "d1s", prompts, unified)  # slice path
        _same_as_unified(fleet, "p1n", "d2s", prompts[:3], unified[:3])
        _same_as_unified(fleet, "p2s", "d1s", prompts, unified)  # staging
        assert fleet.load("p2s").get("kv_staged_bytes", 0) > 0
        for name in fleet.servers:
            load = fleet.load(name)
            assert load_at_rest(load), (name, load)
    finally:
        fleet.stop()
