"""bench/wave_c4.py on a tiny random model: the closed loop runs every prompt to its length and
books every forward (prefill tokens, decode rows) so the steps add up to the work done."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wave_books_every_step(tiny_llama_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "wave_c4.py"), "--model-path", str(tiny_llama_dir),
         "--input-len", "24", "--output-len", "5", "--concurrency", "2", "--num-prompts", "5",
         "--chunk", "2048,8", "--tag", "t", "--timeline", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "wave_t.json").read_text())
    runs = {r["chunk"]: r for r in data["runs"]}
    assert set(runs) == {2048, 8}
    for chunk, r in runs.items():
        steps = data["timelines"][f"greedy/{chunk}/0"]
        # every prompt token is computed once (no prefix cache hits: random prompts), and
        # every output token but each request's first comes from a decode row
        assert sum(s[1] for s in steps) == 5 * 24
        assert sum(s[2] for s in steps) == 5 * 4
        assert max(s[1] for s in steps) <= chunk
        assert r["tok_s"] > 0 and r["extend_steps"] + r["decode_steps"] == len(steps)
    # 8-token chunks: a 24-token prompt takes three steps, and decodes ride along some of them
    assert runs[8]["extend_steps"] >= 15 and runs[8]["extend_rows"] > 0
