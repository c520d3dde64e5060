"""Smoke test of bench/vs_vllm.py on a tiny random model: without vLLM it measures pdserve alone
(unified and 1P1D through `pdserve up`), says why vLLM is missing, and writes JSON + PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_vs_vllm_without_vllm_measures_pdserve_alone(tiny_llama_dir: Path,
                                                     tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vs_vllm.py"), "--model-path", str(tiny_llama_dir),
         "--vllm-python", "", "--rounds", "1", "--num-prompts", "4", "--concurrency", "2",
         "--input-len", "16", "--output-len", "4", "--out-dir", str(tmp_path),
         "--systems", "pdserve-unified,pdserve-1p1d,vllm-unified,vllm-1p1d"],
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "pdserve alone: vLLM not measured" in proc.stdout
    data = json.loads((tmp_path / "vs_vllm.json").read_text())
    why = "no --vllm-python given"
    assert not data["vllm_measured"]
    assert data["skipped"] == {"vllm-unified": why, "vllm-1p1d": why}
    for system in ("pdserve-unified", "pdserve-1p1d"):
        # greedy (temperature 0) and the client's default sampling (no temperature sent), both
        # measured on the one server start
        for key, sampling in (("float32", "greedy"), ("float32/default", "default")):
            (r,) = data["rounds"][key][system]
            assert r["sampling"] == sampling
            assert r["errors"] == 0 and r["tok_s"] > 0 and r["mean_tpot_s"] is not None
            assert r["loadavg_before"] and r["loadavg_after"] and r["probe_text"]
            # where the unified server's wall time went (its /metrics step counters)
            st = r["server_steps"]
            if system == "pdserve-unified":
                assert st["decode_steps"] > 0 and st["extend_steps"] > 0
                assert 0 < st["decode_s"] + st["extend_s"] < r["wall_s"]
            else:
                assert st is None
    # the same weights and greedy decoding: unified and 1P1D must write the same probe text
    assert data["probes"]["float32"]["all_equal"], data["probes"]
    assert data["acceptance"] == {}  # nothing to compare against without vLLM
    # issue #47: no vLLM ratio, only pdserve's own sampled / greedy TPOT
    assert list(data["acceptance_47"]) == ["pdserve_tpot_sampled_over_greedy"]
    assert (tmp_path / "vs_vllm.png").stat().st_size > 0
