"""bench/mix_steps.py: its step accounting (kinds, the mixed-step fit against the decode-only
steps, each request's TPOT and share of chunk steps) on made-up steps, and a quick run on a tiny
Llama whose records add up to what the engine produced. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import mix_steps


def _step(t0: float, ms: float, rows: int, prefill: int = 0) -> dict:
    return {"t0": t0, "t1": t0 + ms / 1e3, "decode_rows": rows, "prefill_tokens": prefill,
            "prefill_chunks": int(prefill > 0), "decode_ctx": 100.0, "native": int(not prefill)}


def test_summary_splits_kinds_and_prices_a_chunk_beyond_its_tokens() -> None:
    # decode-only at 8 rows: 40 ms; mixed: 50 ms + 1 ms per prefill token (10 ms extra)
    steps, t = [], 0.0
    for i, p in enumerate([0, 0, 100, 0, 200, 0, 300, 0]):
        ms = 40.0 if not p else 50.0 + p
        steps.append(_step(t, ms, 8, p))
        t += ms / 1e3
    steps.insert(0, _step(-1.0, 500.0, 0, 400))  # the first prompt alone
    sm = mix_steps.summarize(steps, {}, 8)
    assert [sm["kinds"][k]["steps"] for k in ("decode", "mixed", "prefill")] == [5, 3, 1]
    assert sm["decode_steps_with_chunk"] == pytest.approx(3 / 8)
    assert sm["full_batch"]["decode_only_median_ms"] == pytest.approx(40.0)
    assert sm["full_batch"]["mixed_fit_ms"]["per_token"] == pytest.approx(1.0)
    assert sm["full_batch"]["mixed_extra_ms"] == pytest.approx(10.0)


def test_a_request_s_tpot_and_chunk_share_come_from_the_steps_between_its_tokens() -> None:
    steps = [_step(0.0, 100.0, 2), _step(0.1, 300.0, 2, 50), _step(0.4, 100.0, 2)]
    tokens = {"a": [(0.1, 0), (0.4, 1), (0.5, 2)], "b": [(0.5, 2)]}  # b: one token, no TPOT
    sm = mix_steps.summarize(steps, tokens, 2)
    assert sm["tpot_ms"]["p50"] == pytest.approx(200.0)
    (worst,) = sm["worst_requests"]
    assert worst["tokens"] == 3
    assert worst["chunk_share"] == pytest.approx(0.3 / 0.4)


def test_quick_run_records_every_token_the_engine_produced(tiny_llama_dir: Path,
                                                          tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "mix_steps.py"), "--quick", "--model-path",
         str(tiny_llama_dir), "--out-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "mix_steps.json").read_text())
    assert (tmp_path / "mix_steps.png").stat().st_size > 0
    for key in ("nproc", "loadavg_start", "loadavg_end"):
        assert key in data["machine"], key
    # ignore_eos: every request gives its drawn length, and each token was seen in a step
    assert data["output_tokens"] == data["requested_tokens"] == data["tokens_recorded"] > 0
    steps, kinds = data["steps"], data["summary"]["kinds"]
    assert sum(v["steps"] for v in kinds.values()) == len(steps)
    # every decode row is a token of the run, and so is each request's first (its prefill's)
    assert sum(s["decode_rows"] for s in steps) + 8 == data["output_tokens"]
    assert 0 < data["summary"]["decode_steps_with_chunk"] < 1  # 4 streams, 8 requests
    assert all(v["native_steps"] <= v["steps"] for v in kinds.values())
