"""bench/gguf_packed.py's memory rule (#48): 'resident' (anonymous pages plus each mapped file's
resident pages once per process tree) and its breakdown by kind, on a parent and a child that
map the same libraries; and --before refusing a folder without pdcore/ (exit 2, no server
started); the streamed TPOT's and the forward split's arithmetic (decode_tpot, _per_step). No
timing is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from gguf_packed import tree_memory_mib  # noqa: E402


def test_resident_counts_a_shared_file_once_and_the_breakdown_adds_up() -> None:
    # a child holding 64 MiB of its own anonymous pages, mapping the interpreter's files as we do
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(64 << 20); "
                              "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        m = tree_memory_mib(os.getpid())
        me, kid = str(os.getpid()), str(child.pid)
        assert kid in m["resident"] and kid in m["breakdown"]
        for pid, kinds in m["breakdown"].items():
            assert abs(sum(kinds.values()) - m["resident"][pid]) < 1e-6, (pid, kinds)
            assert min(kinds.values()) >= 0.0, (pid, kinds)
        assert m["breakdown"][kid]["heap"] + m["breakdown"][kid]["anonymous"] >= 63.0
        # the child's libraries (libpython, libc) are already ours: charged to us, not again to it
        assert m["breakdown"][kid].get("other files", 0.0) < m["breakdown"][me]["other files"]
        assert m["resident"]["total"] < m["rss"]["total"]
        assert abs(m["resident"]["total"] - sum(v for k, v in m["resident"].items()
                                                if k != "total")) < 1e-6
    finally:
        child.kill()
        child.wait(10)


def test_before_without_pdcore_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gguf_packed.py"), "--before",
                           str(tmp_path)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert "no pdcore/ there" in proc.stderr


def test_decode_tpot_counts_the_tokens_between_the_first_and_last_event() -> None:
    from gguf_packed import decode_tpot

    # first event after the prefill at t=5.0 (1 token), then events carrying 1, 2 and 4 tokens
    assert decode_tpot([(5.0, 1), (5.01, 2), (5.03, 4), (5.07, 8)]) == pytest.approx(0.07 / 7)
    for bad in ([], [(5.0, 1)], [(5.0, 3), (5.1, 3)]):
        with pytest.raises(ValueError):
            decode_tpot(bad)


def test_forward_per_step_is_the_difference_of_the_totals() -> None:
    from gguf_packed import _per_step

    assert _per_step((2.0, 100.0), (2.5, 150.0)) == pytest.approx(0.01)
    assert _per_step((2.0, 100.0), (2.0, 100.0)) is None  # no decode step between
    assert _per_step((None, None), (2.5, 150.0)) is None  # a server without the metrics
