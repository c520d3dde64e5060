"""hold_heap: an engine process keeps freed activation memory for the next step (nothing more
taken from the kernel per step), and a user's glibc malloc variables win."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import ctypes, json, resource, sys
import torch
from pdcore import runtime_env

held = runtime_env.hold_heap() if sys.argv[1] == "hold" else None

class MallInfo2(ctypes.Structure):  # glibc >= 2.33; the main arena, where this thread allocates
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
last = [0]
taken = [0]
def sample():  # bytes glibc holds from the kernel: the heap (sbrk) plus mmapped chunks
    m = libc.mallinfo2()
    now = m.arena + m.hblkhd
    taken[0] += max(0, now - last[0])
    last[0] = now
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step(T):  # a prefill's activations on SmolLM2's widths, allocated and freed layer by layer
    h = torch.empty(T, 576).fill_(1); sample()
    for _ in range(4):
        qkv = torch.empty(T, 960).fill_(1); o = torch.empty(T, 576).fill_(1); sample(); del qkv
        gu = torch.empty(T, 3072).fill_(1); sample(); a = torch.empty(T, 1536).fill_(1); sample()
        del gu
        d = torch.empty(T, 576).fill_(1); sample(); del a, o, d
    del h
    sample()
# glibc's starting thresholds are 128 KiB: the first large block is always mmapped, and its free
# unmaps it; held, it comes from the heap and stays there when freed
# held, the block is carved from the heap's top chunk (keepcost: free already, so not counted
# as kept) plus what the heap grows by; freed, it joins the top again
maps, free, top = libc.mallinfo2().hblks, libc.mallinfo2().fordblks, libc.mallinfo2().keepcost
big = torch.empty(1024, 3072).fill_(1)
first_mmapped = libc.mallinfo2().hblks > maps
del big
kept = libc.mallinfo2().fordblks - free + top
last[0] = libc.mallinfo2().arena + libc.mallinfo2().hblkhd
lengths = (1024, 896, 512, 1024)
for i in range(4):  # warm up
    step(lengths[i])
before = faults()
taken[0] = 0
for i in range(20):
    step(lengths[i % 4])
print(json.dumps({"held": held, "first_mmapped": first_mmapped, "kept": kept, "top": top,
                  "faults": faults() - before, "taken": taken[0]}))
"""


def _run(mode: str, **env: str) -> dict:
    e = {k: v for k, v in os.environ.items()
         if k not in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=e, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33's allocator (mallinfo2)")
def test_held_heap_reuses_freed_activations():
    held = _run("hold")
    plain = _run("plain")
    assert held["held"] is True
    block = 1024 * 3072 * 4
    # the mechanism, the same in every run: glibc maps the first 12 MiB block and unmaps it on
    # free; held, it comes from the heap and stays there, free, for the next step
    assert plain["first_mmapped"] is True, plain
    # (counted with the heap top that was free before it (keepcost), which the block absorbs:
    # its size follows what was imported, 325 KiB when s13 grew pdcore/env.py by 13 lines; less
    # the interpreter's own small allocations between the free and the count; unheld, the block
    # is unmapped and only the old top is counted, 0.3-0.6 MiB)
    assert held["first_mmapped"] is False and held["kept"] >= block - (256 << 10), held
    # the steady state: after the warm-up, 20 steps take (almost) nothing more from the kernel
    # (glibc's own count, mallinfo2; one step's peak is ~30 MiB). Without it, what glibc takes
    # varies from run to run (0 when its dynamic thresholds adapt to the first frees, ~800 MiB
    # when they don't): printed, not asserted
    assert held["taken"] < 4 * block, (held, plain)
    print("plain", plain, "held", held)


def test_user_malloc_variables_win():
    assert _run("hold", MALLOC_TRIM_THRESHOLD_="131072")["held"] is False
    assert _run("hold", GLIBC_TUNABLES="glibc.malloc.check=0")["held"] is False
