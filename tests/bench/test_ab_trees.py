"""The A/B benches that time source trees side by side (bench/attn_orders.py,
bench/prefill_tile.py) must load each tree's own library in its child: bench/common.py puts the
script's own tree first on sys.path, which shadowed the tree the parent named (every child then
timed the script's tree: an A/B of a tree against itself). A stand-in tree whose `native` says
where it lives proves which one a child imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"

STUB = '''
from pathlib import Path
import torch
SOURCE = Path(__file__).with_name("decode_step.cpp")
def isa(): return "stub"
def status(): return "stub"
class _Ops:
    def prefill_attention_paged(self, q, *a): return torch.zeros_like(q)
    def decode_attention_paged(self, q, *a): return torch.zeros_like(q)
def ops(): return _Ops()
'''


def _stand_in_tree(root: Path) -> Path:
    native = root / "pdcore" / "engine" / "native"
    native.mkdir(parents=True)
    for d in (root / "pdcore", root / "pdcore" / "engine"):
        (d / "__init__.py").write_text("")
    (native / "__init__.py").write_text(STUB)
    return root


def _child(script: str, tree: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, str(BENCH / script), *args], env=env,
                       capture_output=True, text=True, timeout=300, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_prefill_tile_child_loads_the_named_tree(tmp_path: Path) -> None:
    tree = _stand_in_tree(tmp_path)
    res = _child("prefill_tile.py", tree, "--child", str(tree), "--chunk", "16", "--ctx", "32",
                 "--reps", "1")
    assert res["source"] == str(tree / "pdcore" / "engine" / "native" / "decode_step.cpp")


def test_attn_orders_child_loads_the_named_tree(tmp_path: Path) -> None:
    tree = _stand_in_tree(tmp_path)
    res = _child("attn_orders.py", tree, "--child", "--reps", "1", "--engine-reps", "0")
    assert res["source"] == str(tree / "pdcore" / "engine" / "native" / "decode_step.cpp")
