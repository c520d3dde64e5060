"""bench/frontcpu.py's bookkeeping on made-up input: variants parse into label, environment and
flags; py-spy's folded stacks sum by category (innermost matching frame) and by frame. No
timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import frontcpu  # noqa: E402


def test_variants_parse() -> None:
    assert frontcpu.parse_variant("base") == ("base", {}, [])
    assert frontcpu.parse_variant("n:PDSERVE_HTTP_NICE=10,PYTHONPATH=/t:--max-running-requests 8"
                                  ) == ("n", {"PDSERVE_HTTP_NICE": "10", "PYTHONPATH": "/t"},
                                        ["--max-running-requests", "8"])


def test_folded_stacks_sum_by_category_and_frame(tmp_path: Path) -> None:
    folded = tmp_path / "raw.txt"
    folded.write_text(
        "main (a.py:1);_stream (pdcore/server/openai_routes.py:9);dumps (json/__init__.py:2) 5\n"
        "main (a.py:1);add (pdcore/server/detokenizer.py:3);ThinTokenizer.decode (t.py:4) 3\n"
        "main (a.py:1);_recv_loop (pdcore/runtime/handle.py:300);recv_pyobj (zmq/x.py:1) 2\n"
        "main (a.py:1);select (selectors.py:468) 7\n"
        "not a sample line\n")
    cats = frontcpu.categorise(folded)
    assert cats == {"sse_http": 5, "detokenize": 3, "zmq_pickle": 2, "event_loop": 7}
    top = frontcpu.top_frames(folded, 2)
    assert top["self"] == {"select (selectors.py:468)": 7, "dumps (json/__init__.py:2)": 5}
    assert top["inclusive"]["main (a.py:1)"] == 17
