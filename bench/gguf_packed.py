"""The default GGUF (SmolLM2-135M Q4_1, Q8_0 embedding) served packed against the same file
de-quantized to float32 (#48): two real `pdserve serve` servers on loopback, the only difference
PDCORE_GGUF_PACKED=1 / 0 (the packed one's GEMM: --dot, PDCORE_GGUF_DOT). Measured side by
side in one run:

- resident memory: VmRSS of each server's process tree (the HTTP process and the engine), after
  a warm-up request, and the engine's weight bytes (/server_info);
- decode TPOT at batch 1 and 8: B concurrent /generate requests of --prompt tokens (greedy,
  ignore_eos), once with 1 new token and once with 1 + --new; TPOT = (t_long - t_short) / --new.
  Rounds alternate the servers' order; the median is reported, every round is kept.

The CPU's flags and the machine's load (start, end) are in the JSON: on a shared box the
numbers are a first look. Run: `python bench/gguf_packed.py [--rounds 3] [--new 32]`; JSON + PNG
in bench/results/gguf_packed.*.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, _children, alternating, bar_groups, figure, load_note, save_figure, \
    start_unified

NAME = "gguf_packed"
SYSTEMS = {"float32": "0", "packed": "1"}


def tree_rss_mib(pid: int) -> dict[str, float]:
    """VmRSS (MiB) of pid and each descendant, by pid, and their sum under 'total'."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("VmRSS:")), 0)
        out[str(p)] = kb / 1024
        todo += _children(p)
    out["total"] = sum(out.values())
    return out


def _generate(url: str, ids: list[int], new: int) -> None:
    import httpx

    r = httpx.post(url + "/generate", timeout=600, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0,
                                              "ignore_eos": True}})
    r.raise_for_status()


def _timed(url: str, batch: int, prompt: int, new: int) -> float:
    prompts = [[(7 * i + 31 * j) % 5000 + 100 for j in range(prompt)] for i in range(batch)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        list(pool.map(lambda p: _generate(url, p, new), prompts))
    return time.perf_counter() - t0


def _metric(url: str, name: str) -> float | None:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dot", choices=("int8", "float"), default="float",
                    help="the packed server's PDCORE_GGUF_DOT (int8: activations quantized per "
                         "block of 32, integer dot products; float: the de-quantized weights)")
    args = ap.parse_args()
    import httpx

    batches = [int(b) for b in args.batches.split(",")]
    run = Run(NAME, vars(args))
    servers = {name: start_unified(None, ("--max-total-tokens", "8192"),
                                   env={"PDCORE_GGUF_PACKED": v, "PDCORE_GGUF_DOT": args.dot})
               for name, v in SYSTEMS.items()}
    out: dict[str, Any] = {"systems": {}}
    samples: dict[str, dict[int, list[float]]] = {}
    try:
        for name, s in servers.items():
            _timed(s.url, 8, args.prompt, 4)  # warm-up: every batch size's buffers
            info = httpx.get(s.url + "/server_info", timeout=30).json()
            out["systems"][name] = {
                "rss_mib": tree_rss_mib(s.proc.pid),
                "weight_bytes": info.get("weight_bytes"),
                "gemm_weights_gguf": _metric(s.url, "pdserve_scheduler_gemm_weights_gguf"),
            }
        for r in range(args.rounds):
            for name in alternating(list(servers), r):
                url = servers[name].url
                for b in batches:
                    short = _timed(url, b, args.prompt, 1)
                    long = _timed(url, b, args.prompt, 1 + args.new)
                    samples.setdefault(name, {}).setdefault(b, []).append(
                        max(long - short, 1e-9) / args.new)
        for name, s in servers.items():  # after the runs too: the peak working set
            out["systems"][name]["rss_mib_after"] = tree_rss_mib(s.proc.pid)
    finally:
        for s in servers.values():
            s.stop()
    for name, per in samples.items():
        out["systems"][name]["decode"] = {
            str(b): {"tpot_ms": 1e3 * statistics.median(v), "tokens_per_s": b / statistics.median(v),
                     "tpot_ms_rounds": [1e3 * x for x in v]} for b, v in per.items()}
    f, p = out["systems"]["float32"], out["systems"]["packed"]
    out["ratios"] = {
        "rss_packed_over_float32": p["rss_mib_after"]["total"] / f["rss_mib_after"]["total"],
        **{f"tpot_packed_over_float32_batch{b}":
           p["decode"][str(b)]["tpot_ms"] / f["decode"][str(b)]["tpot_ms"] for b in batches}}
    out["note"] = load_note(run)
    for name, m in out["systems"].items():
        print(f"{name}: RSS {m['rss_mib_after']['total']:.0f} MiB, " + ", ".join(
            f"batch {b} TPOT {m['decode'][str(b)]['tpot_ms']:.1f} ms" for b in batches),
              flush=True)
    print({k: round(v, 3) for k, v in out["ratios"].items()})
    print(run.finish(out))
    fig, (ax1, ax2) = figure(2, width=5)
    bar_groups(ax1, ["server RSS"], {n: [out["systems"][n]["rss_mib_after"]["total"]]
                                     for n in SYSTEMS}, "MiB", "resident memory")
    bar_groups(ax2, [f"batch {b}" for b in batches],
               {n: [out["systems"][n]["decode"][str(b)]["tpot_ms"] for b in batches]
                for n in SYSTEMS}, "decode TPOT (ms)", f"TPOT ({out['note']})")
    print(save_figure(fig, NAME))


if __name__ == "__main__":
    main()
