"""Smoke test of the benchmark scripts: `bench/engine_throughput.py --quick` on a tiny random
Llama writes its JSON (with every key the report relies on) and its plot. No timing is asserted:
numbers on a shared machine say nothing in a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_throughput_quick_writes_results(tiny_llama_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "engine_throughput.py"), "--quick",
         "--model-path", str(tiny_llama_dir), "--out-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "engine_throughput.json").read_text())
    assert (tmp_path / "engine_throughput.png").stat().st_size > 0
    for key in ("config", "machine", "raw_tokens_per_s", "median_tokens_per_s",
                "ratio_pdserve_over_transformers", "output_agreement_with_transformers",
                "raw_tokens_per_cpu_s", "ratio_per_cpu_s_over_transformers"):
        assert key in data, key
    assert data["config"]["quick"] is True
    for key in ("nproc", "loadavg_start", "loadavg_end"):
        assert key in data["machine"], key
    for system in ("pdserve", "transformers"):
        for batch in ("1", "16"):
            values = data["raw_tokens_per_s"][system][batch]
            assert values and all(v > 0 for v in values)
    for batch in ("1", "16"):
        r = data["ratio_pdserve_over_transformers"][batch]
        want = data["median_tokens_per_s"]["pdserve"][batch] / \
            data["median_tokens_per_s"]["transformers"][batch]
        assert abs(r - want) < 1e-9
        agree = data["output_agreement_with_transformers"]["pdserve"][batch]
        assert agree["of"] == int(batch) and 0 <= agree["identical"] <= agree["of"]
    assert "RATIO" in proc.stdout


def test_transfer_bench_small_run_verifies_bytes_and_writes_results(tmp_path: Path) -> None:
    """bench/transfer.py on a small pool: every case's warm-up transfer is checked byte for byte
    (a wrong page exits non-zero), each side's pool is the one named in the JSON, and every
    ratio is the ratio of the stored medians."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "transfer.json"
    cases = ["raw_socket", "tcp", "memcpy", "shm", "shm_segment"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "transfer.py"), "--reps", "1", "--prompts",
         "64,256", "--pool-pages", "64", "--cases", ",".join(cases), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(data["pools"]) == {"tcp", "shm", "shm_segment"}
    assert data["pools"]["tcp"] == {"src": "torch", "dst": "torch"}
    assert data["pools"]["shm_segment"] == {"src": "shm", "dst": "shm"}
    for w in ("64_tokens", "256_tokens"):
        r = data["results"][w]
        assert list(r["cases"]) == cases
        assert all(c["median_s"] > 0 for c in r["cases"].values())
        for name, v in data["ratios"][w].items():
            a, b = name.split("/")
            assert abs(v["value"] - r["cases"][b]["median_s"] / r["cases"][a]["median_s"]) < 1e-9


def test_prefix_cache_bench_small_run_reports_cache_hits(tiny_llama_dir: Path,
                                                          tmp_path: Path) -> None:
    """bench/prefix_cache.py, all three parts on a tiny model and tiny sizes: the JSON holds
    every phase, the cache-on runs report cached tokens and the cache-off runs none, (b) has
    one row per turn, and (c) gives both policies the same greedy answers."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "prefix_cache.json"
    sizes = {"--system-len": 64, "--questions": 4, "--question-len": 8, "--out-len": 2,
             "--conversations": 2, "--turns": 2, "--first-len": 40, "--user-len": 8,
             "--answer-len": 4, "--prefixes": 2, "--prefix-len": 48, "--per-prefix": 2,
             "--max-total-tokens": 2048, "--b-reps": 1}  # one repetition shows the format
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "prefix_cache.py"), "--model-path",
         str(tiny_llama_dir), "--out", str(out), *(str(x) for kv in sizes.items() for x in kv)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    a = data["a"]
    assert set(a) == {"unified_on", "unified_off", "pd_on", "pd_off"}
    for name, run in a.items():
        assert run["ttft_s"]["n"] == sizes["--questions"] - 1, name
        assert run["prompt_tokens"] == (sizes["--questions"] - 1) * (
            sizes["--system-len"] + sizes["--question-len"]), name
        if name.endswith("_on"):  # the first request put the shared prefix in the cache
            assert run["cached_tokens"] > 0, name
        else:
            assert run["cached_tokens"] == 0, name
    assert set(data["ratios"]["a_unified_ttft_on_over_off"]) == {"p50", "p90"}
    assert set(data["ratios"]["a_pd_ttft_on_over_off"]) == {"p50", "p90"}
    for name in ("plain", "reuse"):
        b = data["b"][name]
        assert [t["turn"] for t in b["turns"]] == [1, 2], name
        assert all(t["kv_bytes_per_conversation"] > 0 for t in b["turns"]), name
        assert b["turns"][1]["cached_tokens"] > 0, name  # P kept turn 1's prompt
    assert "b_bytes_reuse_over_plain_from_turn2" in data["ratios"]
    c = data["c"]
    for policy in ("cache_aware", "round_robin"):
        assert c[policy]["prompt_tokens"] == sizes["--prefixes"] * sizes["--per-prefix"] * (
            sizes["--prefix-len"] + sizes["--question-len"]), policy
        assert 0 <= c[policy]["hit_rate"] <= 1
    assert c["outputs_identical"] is True
    assert set(data["targets_met"]) >= {"a_unified", "a_pd", "b_bytes", "b_ttft",
                                        "c_cache_aware_higher"}
    assert "RATIO (a)" in proc.stdout and "HIT RATE (c)" in proc.stdout
