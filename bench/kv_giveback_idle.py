"""What a KV give-back costs the next request: the numbers behind PDSERVE_KV_GIVEBACK_IDLE_S.

A give-back (engine/kv/giveback.py) drops the free, written pages of the KV pool; the next
requests fault fresh zero pages back in. Bursty traffic that idles just past the threshold pays
that once per burst, so the threshold is chosen from the cost: at a threshold T a burst pattern
idling just over T pays at most cost / T of its time (the re-fault) more.

1. micro: a --mib MiB float32 buffer rewritten while resident, against rewritten right after
   madvise(MADV_DONTNEED) (the faults and the kernel's zeroing): ms per MiB;
2. engine: an in-process LLMEngine (--model, default SmolLM2-135M float32) serves a batch of
   --batch prompts of --prompt tokens, --new new tokens, after an idle that kept its pages
   (`release_caches(give_back=False)`) or gave them back (`release_caches()`), rounds
   alternating the order; the median extra ms of the batch and the bytes given back per cycle.
Run: `python bench/kv_giveback_idle.py --suffix _s13` under the quiet lock; JSON + PNG in
bench/results/kv_giveback_idle<suffix>.*.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, bar_groups, figure, load_note, save_figure

NAME = "kv_giveback_idle"


def micro(mib: int, rounds: int) -> dict[str, Any]:
    import torch

    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    buf = torch.zeros(mib * 2**20 // 4)
    buf.fill_(1.0)
    start = -(-buf.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    length = (buf.data_ptr() + buf.numel() * 4 - start) // mmap.PAGESIZE * mmap.PAGESIZE
    resident, faulted = [], []
    for r in range(rounds):
        t = time.perf_counter()
        buf.fill_(float(r))
        resident.append(time.perf_counter() - t)
        assert fn(start, length, 4) == 0, ctypes.get_errno()
        t = time.perf_counter()
        buf.fill_(float(r))
        faulted.append(time.perf_counter() - t)
    res, fau = statistics.median(resident), statistics.median(faulted)
    return {"mib": mib, "resident_ms": [x * 1e3 for x in resident],
            "faulted_ms": [x * 1e3 for x in faulted],
            "fault_ms_per_mib": (fau - res) * 1e3 / mib}


def engine(model: str, batch: int, prompt: int, new: int, rounds: int) -> dict[str, Any]:
    import torch

    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    eng = LLMEngine(ServerArgs(model_path=model, max_total_tokens=8192,
                               disable_radix_cache=True))
    times: dict[str, list[float]] = {"kept": [], "given back": []}
    given: list[int] = []
    try:
        mr = eng.loop.runner.model_runner
        eng.generate([torch.randint(3, 4000, (prompt,), generator=g).tolist()] * batch, sp)
        for r in range(rounds):
            for how in (("kept", "given back") if r % 2 == 0 else ("given back", "kept")):
                prompts = [torch.randint(3, 4000, (prompt,), generator=g).tolist()
                           for _ in range(batch)]
                before = mr.given_back
                eng.loop.release_caches(give_back=how == "given back")
                if how == "given back":
                    given.append(mr.given_back - before)
                t = time.perf_counter()
                eng.generate(prompts, sp)
                times[how].append((time.perf_counter() - t) * 1e3)
    finally:
        eng.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch_ms": times, "median_ms": med, "extra_ms": med["given back"] - med["kept"],
            "given_back_bytes": given}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/work/smollm2-hf")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args()
    run = Run(NAME + args.suffix, vars(args))
    m = micro(args.mib, 2 * args.rounds)
    e = engine(args.model, args.batch, args.prompt, args.new, args.rounds)
    mib = statistics.median(e["given_back_bytes"]) / 2**20
    cost = max(e["extra_ms"], 0.0)
    share = {f"{t} s": cost / (t * 1e3) for t in (0.1, 0.3, 0.5, 1.0, 2.0)}
    print(f"micro: {m['fault_ms_per_mib']:.3f} ms per MiB re-faulted ({args.mib} MiB)")
    print(f"engine: {mib:.1f} MiB given back per idle; the next batch {e['median_ms']['kept']:.1f}"
          f" ms kept, {e['median_ms']['given back']:.1f} ms given back (+{e['extra_ms']:.1f} ms;"
          f" micro predicts {m['fault_ms_per_mib'] * mib:.1f})")
    print("re-fault share of a burst pattern idling just past T: " +
          ", ".join(f"T={k}: {v:.1%}" for k, v in share.items()))
    fig, axes = figure(2)
    bar_groups(axes[0], ["resident", "after DONTNEED"],
               {f"{args.mib} MiB fill": [statistics.median(m["resident_ms"]),
                                         statistics.median(m["faulted_ms"])]},
               "ms", "rewrite of a buffer")
    bar_groups(axes[1], ["pages kept", "pages given back"],
               {f"batch {args.batch}": [e["median_ms"]["kept"], e["median_ms"]["given back"]]},
               "ms", f"next batch after idle ({mib:.1f} MiB given)\n{load_note(run)}")
    save_figure(fig, NAME + args.suffix)
    print(run.finish({"micro": m, "engine": e, "given_back_mib_median": mib,
                      "refault_share_at_threshold": share}))


if __name__ == "__main__":
    main()
