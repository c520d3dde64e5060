"""Smoke test of bench/dp.py: `--quick` on a tiny random Llama starts `--dp-size 1` and
`--dp-size 2` on the same CPUs, writes its JSON (every key the README relies on, the ratio the
ratio of the stored medians) and its plot. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dp_bench_quick_writes_results(tiny_llama_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dp.py"), "--quick", "--model-path",
         str(tiny_llama_dir), "--out-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "dp.json").read_text())
    assert (tmp_path / "dp.png").stat().st_size > 0
    for key in ("config", "machine", "output_tok_s", "median_output_tok_s",
                "ratio_dp2_over_dp1", "latency", "affinity", "note"):
        assert key in data, key
    assert data["config"]["quick"] is True and data["config"]["concurrency"] == 8
    med = data["median_output_tok_s"]
    assert abs(data["ratio_dp2_over_dp1"] - med["dp2"] / med["dp1"]) < 1e-9
    for system in ("dp1", "dp2"):
        assert data["output_tok_s"][system] and all(v > 0 for v in data["output_tok_s"][system])
        lat = data["latency"][system]
        assert lat["errors"] == 0 and lat["requests"] == 8 and lat["output_tokens"] == 8 * 8
    # dp2 really ran two schedulers: its process tree has one more process than dp1's
    assert len(data["affinity"]["dp2"]) == len(data["affinity"]["dp1"]) + 1
    assert "RATIO dp2/dp1" in proc.stdout
