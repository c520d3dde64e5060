"""hold_heap: an engine process keeps freed activation memory for the next step (no page faults
per step), and a user's glibc malloc variables win."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, resource, sys
import torch
from pdcore import runtime_env

held = runtime_env.hold_heap() if sys.argv[1] == "hold" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step(T):  # a prefill's activations on SmolLM2's widths, allocated and freed layer by layer
    h = torch.empty(T, 576).fill_(1)
    for _ in range(4):
        qkv = torch.empty(T, 960).fill_(1); o = torch.empty(T, 576).fill_(1); del qkv
        gu = torch.empty(T, 3072).fill_(1); a = torch.empty(T, 1536).fill_(1); del gu
        d = torch.empty(T, 576).fill_(1); del a, o, d
lengths = (1024, 896, 512, 1024)
for i in range(4):  # warm up
    step(lengths[i])
before = faults()
for i in range(20):
    step(lengths[i % 4])
print(json.dumps({"held": held, "faults": faults() - before}))
"""


def _run(mode: str, **env: str) -> dict:
    e = {k: v for k, v in os.environ.items()
         if k not in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=e, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_held_heap_reuses_freed_activations():
    held = _run("hold")
    plain = _run("plain")
    assert held["held"] is True
    # without it glibc maps (or trims and regrows) the larger blocks again in most steps (here
    # ~35000 faults over the 20 steps); held, the steps reuse the first ones' pages
    assert held["faults"] < plain["faults"] / 5, (held, plain)


def test_user_malloc_variables_win():
    assert _run("hold", MALLOC_TRIM_THRESHOLD_="131072")["held"] is False
    assert _run("hold", GLIBC_TUNABLES="glibc.malloc.check=0")["held"] is False
