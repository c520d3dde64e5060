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
         "--systems", "pdserve-unified,pdserve-1p1d,vllm-unified"],
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "pdserve alone: vLLM not measured" in proc.stdout
    data = json.loads((tmp_path / "vs_vllm.json").read_text())
    assert not data["vllm_measured"] and data["skipped"] == {"vllm-unified": "no --vllm-python given"}
    for system in ("pdserve-unified", "pdserve-1p1d"):
        (r,) = data["rounds"][system]
        assert r["errors"] == 0 and r["tok_s"] > 0 and r["mean_tpot_s"] is not None
    assert (tmp_path / "vs_vllm.png").stat().st_size > 0
