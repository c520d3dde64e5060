"""Goodput: the highest request rate a system serves within a pair of latency targets.

DistServe's measure, for the reason PD disaggregation exists: requests arrive as a Poisson
process (bench/workload.py's ShareGPT-like mix, fixed seed; each rate its own requests, the
same for every system, so no trial finds its prompts in a cache an earlier trial filled); a rate is served when, over its requests, TTFT p99 <= --ttft-p99 and
TPOT p99 <= --tpot-p99 and none failed. Default targets for SmolLM2 on a 2-core CPU box:
TTFT p99 <= 3 s, TPOT p99 <= 100 ms (state others with the flags; the result records them).
`--attainment 0.9` judges a rate by DistServe's own rule instead: served when 90% of its
requests met both targets each (with a few dozen requests a trial, a p99 is their maximum).

A trial is --seeds request sets of --requests each (each seed its own draws of the mix, sent
back to back as one Poisson stream: one warm-up, one drain), judged over all of them; its
attainment is the mean of the seeds' shares, and their spread is recorded. A trial of 100
requests was +-20% noisy (s10: a few long prompts decide it); 4 x 50 halves that at the
same cost as two trials.

Search per system: rates from --rate-start, times --rate-step while served (up to --rate-max),
then --bisect halvings between the last served and the first missed rate. Each trial also
records the share of requests that met both targets themselves (SLO attainment).

Systems (one at a time, each started, warmed up, searched, stopped): pdserve unified and 1P1D
(`pdserve up`), vLLM unified / 1P1D with --vllm-python; `--variants 'label:system:flags'` adds
pdserve configurations (a P:D split: `pd2p1d:pdserve-1p1d:--prefill 2`; scheduler flags:
`chunk512:pdserve-unified:--chunked-prefill-size 512`). The table says which wins.

The load average is recorded with every trial; on a shared machine numbers under load are not
the system's, and no ratio to vLLM taken under load means anything. `--quiet-lock FILE` takes
that flock (the team's quiet lock) around each system alone, so one run compares systems side
by side while no hold lasts longer than one system's search (start it under `nice -n -10`).

Writes bench/results/goodput.json and .png (`--name`). `--quick`: the mix at 1/8 its lengths,
8 requests a trial, one bisection, pdserve unified only unless --systems says more.

Run: `python bench/goodput.py [--quick] [--ttft-p99 3] [--tpot-p99 0.1]
[--systems pdserve-unified pdserve-1p1d] [--variants ...] [--vllm-python PATH]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure
from many_streams import PDSERVE, VLLM, level_stats, start, system_args, vocab
from workload import QUICK, Shape, closed_loop, open_loop, requests

NAME = "goodput"


def judge(results: list[Any], ttft: float, tpot: float) -> dict[str, Any]:
    """p99s against the targets, and each request's own verdict (attainment)."""
    ok = 0
    for r in results:
        if r.error is not None or r.ttft is None:
            continue
        own_tpot = ((r.chunk_times[-1] - r.chunk_times[0]) / (r.tokens - 1)
                    if r.tokens > 1 and len(r.chunk_times) > 1 else 0.0)
        ok += r.ttft <= ttft and own_tpot <= tpot
    return {"attainment": ok / len(results) if results else 0.0}


def seeds_at(rate: float, args: argparse.Namespace) -> list[int]:
    """The request seeds of a trial at `rate`. Each rate its own prompts (the same for every
    system at that rate): a search runs every trial on one server, and a repeated prompt set
    answered its prefills from pdserve's prefix cache (TTFT p99 2.0 s at 0.6 req/s, 0.13 s at
    0.96). The first is the seed one-seed runs used."""
    return [args.seed + round(rate * 1000) + 100_003 * k for k in range(args.seeds)]


def trial_requests(rate: float, args: argparse.Namespace, shape: Shape, voc: int
                   ) -> list[list[Any]]:
    """Each seed's requests, their arrivals shifted to follow the previous seed's (one
    Poisson stream at `rate`)."""
    sets, t = [], 0.0
    for s in seeds_at(rate, args):
        reqs = requests(args.requests, voc, s, shape, rate=rate)
        sets.append([replace(r, arrival=r.arrival + t) for r in reqs])
        t = sets[-1][-1].arrival + 1.0 / rate if reqs else t
    return sets


def trial(url: str, rate: float, args: argparse.Namespace, shape: Shape, voc: int
          ) -> dict[str, Any]:
    sets = trial_requests(rate, args, shape, voc)
    load0 = os.getloadavg()
    results, wall = asyncio.run(open_loop(url, [r for s in sets for r in s], args.timeout,
                                          args.sampling))
    st = level_stats(results, wall)
    t99 = st["ttft_s"].get("p99", math.inf)
    p99 = st["tpot_s"].get("p99", math.inf)
    per_seed, i = [], 0
    for s in sets:
        per_seed.append(judge(results[i:i + len(s)], args.ttft_p99, args.tpot_p99)["attainment"])
        i += len(s)
    out = {"rate": rate, "ttft_p99_s": t99, "tpot_p99_s": p99,
           "ttft_p50_s": st["ttft_s"].get("p50"), "tpot_p50_s": st["tpot_s"].get("p50"),
           "output_tok_s": st["output_tok_s"], "errors": st["errors"],
           "error_samples": st.get("error_samples", []), "wall_s": wall,
           "seeds": seeds_at(rate, args), "requests": len(results),
           "attainment": statistics.fmean(per_seed) if per_seed else 0.0,
           "attainment_per_seed": per_seed,
           "attainment_sd": statistics.stdev(per_seed) if len(per_seed) > 1 else None,
           "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg())}
    if args.attainment is None:  # both p99s within their targets
        out["served"] = st["errors"] == 0 and t99 <= args.ttft_p99 and p99 <= args.tpot_p99
    else:  # DistServe's rule: this share of the requests met both targets themselves
        out["served"] = st["errors"] == 0 and out["attainment"] >= args.attainment
    print(f"    rate {rate:6.3f}/s: TTFT p99 {t99:6.2f} s, TPOT p99 {p99 * 1e3:6.0f} ms, "
          f"attainment {out['attainment']:.0%}, errors {st['errors']} -> "
          f"{'served' if out['served'] else 'missed'} (load {load0[0]:.1f})", flush=True)
    return out


def search(url: str, args: argparse.Namespace, shape: Shape, voc: int) -> dict[str, Any]:
    trials: list[dict[str, Any]] = []
    good, bad = 0.0, None
    rate = args.rate_start
    while rate <= args.rate_max:
        t = trial(url, rate, args, shape, voc)
        trials.append(t)
        if not t["served"]:
            bad = rate
            break
        good = rate
        rate *= args.rate_step
    for _ in range(args.bisect if bad is not None else 0):
        mid = (good + bad) / 2 if good else bad / 2
        t = trial(url, mid, args, shape, voc)
        trials.append(t)
        good, bad = (mid, bad) if t["served"] else (good, mid)
    return {"goodput_req_s": good, "first_missed_req_s": bad, "trials": trials}


@contextlib.contextmanager
def quiet(path: str | None, timeout: float) -> Iterator[float]:
    """flock(2) on `path` (the lock `flock FILE cmd` takes) while the block runs; the seconds
    waited for it. No path: no lock."""
    if not path:
        yield 0.0
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    t0 = time.monotonic()
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"the quiet lock {path} was busy for {timeout:.0f} s")
                time.sleep(1.0)
        yield time.monotonic() - t0
    finally:
        os.close(fd)  # releases the lock


def run_system(label: str, system: str, flags: list[str], args: argparse.Namespace,
               shape: Shape, voc: int) -> dict[str, Any]:
    with quiet(args.quiet_lock, args.lock_timeout) as waited:
        t0 = time.monotonic()
        out = _run_system(label, system, flags, args, shape, voc)
        out.update(lock_wait_s=waited, hold_s=time.monotonic() - t0,
                   loadavg_end=list(os.getloadavg()))
    return out


def _run_system(label: str, system: str, flags: list[str], args: argparse.Namespace,
                shape: Shape, voc: int) -> dict[str, Any]:
    print(f"{label} {' '.join(flags)}:", flush=True)
    out: dict[str, Any] = {"system": system, "flags": flags, "loadavg_start": list(os.getloadavg())}
    group = start(system, args, flags)
    try:
        out["startup_s"] = group.wait_ready(args.startup_timeout)
        asyncio.run(closed_loop(group.url, requests(4, voc, args.seed + 99, shape), 2,
                                args.timeout))
        out.update(search(group.url, args, shape, voc))
    except RuntimeError as e:
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"  {label}: {out['error']}", flush=True)
    finally:
        out["logs"] = group.logs()
        group.stop()
    return out


def plot(data: dict[str, Any], args: argparse.Namespace) -> Path:
    fig, axes = figure(3, 4.8, 4.0)
    labels = list(data["systems"])
    for label in labels:
        tr = sorted(data["systems"][label].get("trials", []), key=lambda t: t["rate"])
        if not tr:
            continue
        rates = [t["rate"] for t in tr]
        axes[0].plot(rates, [t["ttft_p99_s"] for t in tr], marker="o", label=label)
        axes[1].plot(rates, [t["tpot_p99_s"] * 1e3 for t in tr], marker="o", label=label)
    axes[0].axhline(args.ttft_p99, color="k", ls=":", label="target")
    axes[1].axhline(args.tpot_p99 * 1e3, color="k", ls=":", label="target")
    axes[0].set(xlabel="request rate (req/s)", ylabel="s", title="TTFT p99", yscale="log")
    axes[1].set(xlabel="request rate (req/s)", ylabel="ms", title="TPOT p99", yscale="log")
    axes[2].bar(range(len(labels)), [data["systems"][k].get("goodput_req_s") or 0
                                     for k in labels])
    axes[2].set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    axes[2].set(ylabel="req/s", title="goodput (within both targets)")
    for ax in axes[:2]:
        ax.legend(fontsize=6)
    fig.suptitle(f"goodput at TTFT <= {args.ttft_p99} s, TPOT <= {args.tpot_p99 * 1e3:.0f} ms "
                 f"({data['targets']['rule']}); {data['load']}", fontsize=9)
    return save_figure(fig, args.name, args.out_dir)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ttft-p99", type=float, default=3.0, help="seconds")
    ap.add_argument("--tpot-p99", type=float, default=0.1, help="seconds")
    ap.add_argument("--systems", nargs="+", default=list(PDSERVE), choices=[*PDSERVE, *VLLM])
    ap.add_argument("--variants", nargs="*", default=[],
                    help="'label:system:flags' (a pdserve system with these flags)")
    ap.add_argument("--server-flag", action="append", default=[],
                    help="a flag for every pdserve system (repeat)")
    ap.add_argument("--requests", type=int, default=64, help="per seed of a trial")
    ap.add_argument("--seeds", type=int, default=1,
                    help="request sets a trial sends back to back; attainment is their mean")
    ap.add_argument("--quiet-lock", default=None,
                    help="flock this file around each system (e.g. /tmp/pd-quiet.lock)")
    ap.add_argument("--lock-timeout", type=float, default=3600.0, help="seconds")
    ap.add_argument("--rate-start", type=float, default=0.25)
    ap.add_argument("--rate-step", type=float, default=1.5)
    ap.add_argument("--rate-max", type=float, default=64.0)
    ap.add_argument("--bisect", type=int, default=2)
    ap.add_argument("--attainment", type=float, default=None,
                    help="serve by SLO attainment instead of p99s (DistServe: e.g. 0.9, a rate "
                         "is served when that share of its requests met both targets)")
    system_args(ap, NAME)
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.requests < 1:
        ap.error("--seeds and --requests must be >= 1")
    if args.quick:
        args.requests, args.bisect, args.rate_start, args.rate_step = 8, 1, 0.5, 3.0
        if args.systems == list(PDSERVE):
            args.systems = ["pdserve-unified"]
    if any(s in VLLM for s in args.systems) and not args.vllm_python:
        ap.error("vLLM systems need --vllm-python (a Python with vllm installed)")
    for v in args.variants:
        if v.count(":") < 2 or v.split(":")[1] not in PDSERVE:
            ap.error(f"--variants {v!r}: write label:{'|'.join(PDSERVE)}:flags")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    shape = QUICK if args.quick else Shape()
    voc = vocab(args.model_path)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    run = Run(args.name, {**config, "shape": shape.as_dict()})
    data: dict[str, Any] = {"targets": {"ttft_p99_s": args.ttft_p99,
                                        "tpot_p99_s": args.tpot_p99,
                                        "rule": "p99" if args.attainment is None else
                                        f"attainment >= {args.attainment}"},
                            "shape": shape.as_dict(), "systems": {}}
    runs = [(s, s, list(args.server_flag) if s in PDSERVE else []) for s in args.systems]
    for v in args.variants:
        label, system, flags = v.split(":", 2)
        runs.append((label, system, [*args.server_flag, *shlex.split(flags)]))
    for label, system, flags in runs:
        data["systems"][label] = run_system(label, system, flags, args, shape, voc)
    ranked = sorted(((res.get("goodput_req_s") or 0.0, label)
                     for label, res in data["systems"].items()), reverse=True)
    data["best"] = ranked[0][1] if ranked and ranked[0][0] > 0 else None
    data["load"] = load_note(run)
    path = run.finish(data, args.out_dir)
    print(f"\ngoodput at TTFT p99 <= {args.ttft_p99} s, TPOT p99 <= {args.tpot_p99 * 1e3:.0f} ms:")
    for g, label in ranked:
        print(f"  {label:28s} {g:6.3f} req/s")
    print(f"best: {data['best']}; {data['load']}; wrote {path} and {plot(data, args)}")
    return data


if __name__ == "__main__":
    main()
