"""PD with MLA models (real servers on loopback): a tiny DeepSeek-V3 P TP2 -> D TP1 over tcp and
shm (also over mooncake and nixl), P TP1 -> D TP2 over tcp, and equal TP over shm, which a tiny
DeepSeek-V2 crosses too (its latent cache has the same layout; its model: tests/engine);
greedy output equals transformers, and the KV bytes P sends per token are one latent per layer
(its transfer counters show it, on /get_load and on /metrics)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))  # tp_helpers
from tp_helpers import PLUGIN_BACKENDS, Fleet, pd_generate, plugin_backend_env

from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import load_at_rest
from pdcore.testing.tiny_models import make_tiny_model

NEW, PAGE, LAYERS = 12, 4, 2  # tp_helpers.FLAGS: --page-size 4
LATENT_BYTES = (32 + 8) * 4  # kv_lora_rank + rope dim, float32: one layer of one token
KV_BYTES_METRIC = "pdserve_kv_transfer_bytes_total"  # rank 0's KV bytes: P wrote, D received


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory) -> dict[str, tuple]:
    """arch -> (arch, path, prompts, transformers greedy references), each built on first use."""
    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, arch: str) -> tuple:
            from transformers import AutoModelForCausalLM

            from pdcore.engine.model.tokenizer import default_model_file

            path = make_tiny_model(str(tmp_path_factory.mktemp(arch) / "m"), arch=arch,
                                   layers=LAYERS, seed=13, tokenizer_from=default_model_file(),
                                   max_positions=8192)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            g = torch.Generator().manual_seed(4)
            prompts = [torch.randint(100, 40000, (n,), generator=g).tolist()
                       for n in (7, 45, 130)]
            self[arch] = (arch, path, prompts, [hf_greedy(hf, p, NEW) for p in prompts])
            return self[arch]

    return Lazy()


@pytest.fixture(scope="module")
def mla_model(mla_models) -> tuple:
    """DeepSeek-V3, the model of every TP shape and backend (V2's latent cache is the same
    layout: it crosses once, equal TP over shm)."""
    return mla_models["deepseek_v3"]


def _kv_bytes(fleet: Fleet, name: str) -> int:
    return int(fleet.load(name).get("kv_bytes", 0))


def _metric(url: str, name: str) -> float:
    """The sum of a series' samples (over its labels) in the server's /metrics, parsed as
    Prometheus does."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    samples = [s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name]
    assert samples, f"{name} not in {url}/metrics"
    return sum(samples)


def _run_pair(backend: str, mla_model, p_tp: int, d_tp: int, env: dict | None = None) -> None:
    _, path, prompts, refs = mla_model
    fleet = Fleet(backend, path, {"p": ("prefill", p_tp, {}), "d": ("decode", d_tp, {})},
                  env).start()
    try:
        info = httpx.get(fleet["p"].url + "/server_info", timeout=10).json()
        assert info["is_mla"] and info["kv_bytes_per_token"] == LAYERS * LATENT_BYTES
        before = _kv_bytes(fleet, "p")
        before_metric = {n: _metric(fleet[n].url, KV_BYTES_METRIC) for n in ("p", "d")}
        for i, (ids, ref) in enumerate(zip(prompts, refs)):
            status, out = pd_generate(fleet, "p", "d", ids, NEW)
            assert status == 200, f"P TP{p_tp} -> D TP{d_tp} prompt {i}: {out}"
            check_greedy(out["output_ids"], ref)
        # whole pages of one latent per layer, once per D rank (each holds the whole cache);
        # rank 0's counters: P TP2's rank 1 writes nothing to a D TP1
        pages = sum(-(-len(p) // PAGE) for p in prompts)
        sent = _kv_bytes(fleet, "p") - before
        writes = d_tp // p_tp or 1  # D ranks rank 0 of P writes
        assert sent == pages * PAGE * LAYERS * LATENT_BYTES * writes, sent
        # the transfer metrics on /metrics say the same: P's rank 0 wrote those bytes and D's
        # rank 0 received one latent per token and layer (a per-head layout would be
        # heads x (k + v head dims) per layer)
        moved = {n: _metric(fleet[n].url, KV_BYTES_METRIC) - before_metric[n] for n in ("p", "d")}
        assert moved["p"] == sent, (moved, sent)
        assert moved["d"] / (pages * PAGE) == LAYERS * LATENT_BYTES, moved
        for name in ("p", "d"):
            load = fleet.load(name)
            assert load_at_rest(load), (name, load)
    finally:
        fleet.stop()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_mla_prefill_tp2_to_decode_tp1(backend, mla_model):
    _run_pair(backend, mla_model, 2, 1)


def test_mla_prefill_tp1_to_decode_tp2_tcp(mla_model):
    _run_pair("tcp", mla_model, 1, 2)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_equal_tp_shm(mla_models, arch):
    _run_pair("shm", mla_models[arch], 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(PLUGIN_BACKENDS))
def test_mla_prefill_tp2_to_decode_tp1_plugin_backends(backend, mla_model):
    env = plugin_backend_env(backend)
    _run_pair(backend, mla_model, 2, 1, env)
