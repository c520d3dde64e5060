"""Serving benchmark: streamed `/v1/completions` requests (random 128-token prompts sent as token
ids, 64 output tokens, ignore_eos, greedy) at concurrency 8 against a running server (`--url`),
one this script starts (`--start unified|pd`), or unified and 1P1D over tcp and shm side by side
(`--compare`); output tokens/s, TTFT and inter-token latency (p50/p99).

Lifecycle:
1. start the systems (all at once, so rounds can alternate): unified pinned to --unified-cpus
   with that many torch threads; 1P1D with P and D pinned to one core each (1 thread) and our
   router; the pinning each process really got is read back from /proc and recorded;
2. warm up every system (a few short requests);
3. per round, each system in alternating order gets --num-requests requests from an asyncio
   httpx client holding --concurrency streams open; per request: TTFT (first text chunk), the
   gaps between chunks (ITL), output tokens (usage, else chunks);
4. per system: output tokens/s per round (median over rounds), output tokens per CPU-second of
   the system's processes (read from /proc: what the work cost, which the machine's load
   disturbs less than the wall clock), percentiles over all requests; RATIOS against unified,
   and against vLLM's figures on this machine (for scale);
5. stop what was started; write bench/results/serving.json and .png.

Run: `python bench/serving.py --compare [--quick]`, or `--url http://127.0.0.1:30000`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from common import (
    Run,
    alternating,
    bar_groups,
    cpu_by_process,
    cpu_seconds,
    figure,
    load_note,
    parse_cpus,
    ratio,
    save_figure,
    start_pd,
    start_unified,
    summary,
    tree_affinity,
)

NAME = "serving"
# vLLM's CPU build on this machine, same shape (128 in, 64 out, concurrency 8, float32); rough
# figures from a loaded machine, quoted by the issues: scale only, not measured in this run
VLLM_TOK_S = {"unified": 83.0, "pd": 36.0}
SYSTEM_KINDS = ("unified", "unified-1t", "pd-tcp", "pd-shm")


# -- client ------------------------------------------------------------------------------------
@dataclass
class Result:
    prompt_len: int
    start: float
    ttft: float | None = None  # seconds from send to the first text chunk
    chunk_times: list[float] = field(default_factory=list)  # absolute times of text chunks
    tokens: int = 0
    end: float | None = None
    error: str | None = None
    kind: str = ""

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in pairwise(t)]


# client sampling modes: "greedy" sends temperature 0; "default" sends no temperature, so the
# server's default applies (1.0 on both pdserve and vLLM for a model folder without a
# generation_config.json): what a client that names none gets
SAMPLINGS = {"greedy": {"temperature": 0.0}, "default": {}}


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A server-sent event stream's lines, split only where SSE ends a line (CR LF, LF, CR).
    httpx's aiter_lines splits as str.splitlines does, also at U+0085, U+2028, U+2029 and the
    other separators JSON allows raw inside a string: a sampled token that decodes to one of
    them (s13: vLLM, temperature 1, one request in ~200) cut its event in two, and the client
    counted a good answer as an error."""
    buf = ""
    async for chunk in chunks:
        buf += chunk
        held = buf.endswith("\r")  # maybe the first half of a CR LF: decide with the next chunk
        parts = re.split(r"\r\n|\r|\n", buf[:-1] if held else buf)
        buf = parts.pop() + ("\r" if held else "")
        for line in parts:
            yield line
    if buf:
        yield buf.removesuffix("\r")


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int],
                            max_tokens: int, kind: str = "", timeout: float = 600.0,
                            sink: list[Result] | None = None, sampling: str = "greedy"
                            ) -> Result:
    """One streamed, ignore_eos completion, greedy unless `sampling` (a SAMPLINGS key) says
    otherwise; errors are recorded, not raised. With a `sink`, the result is appended at once,
    so a cancelled stream keeps what it saw."""
    body = {"prompt": prompt, "max_tokens": max_tokens, **SAMPLINGS[sampling], "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result(len(prompt), time.perf_counter(), kind=kind)
    if sink is not None:
        sink.append(res)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in sse_lines(r.aiter_text()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:300]
                    break
                if msg.get("usage"):
                    res.tokens = int(msg["usage"].get("completion_tokens") or 0)
                if any(c.get("text") for c in msg.get("choices") or []):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - res.start
                    res.chunk_times.append(now)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        res.error = "cancelled"
        raise
    finally:
        res.end = time.perf_counter()
        res.tokens = res.tokens or len(res.chunk_times)
    return res


async def closed_loop(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                      sampling: str = "greedy") -> tuple[list[Result], float]:
    """All prompts, at most `concurrency` in flight; (results, wall seconds)."""
    queue = list(reversed(prompts))
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        async def worker() -> None:
            while queue:
                results.append(await stream_completion(client, url, queue.pop(), max_tokens,
                                                       sampling=sampling))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def latency_stats(results: list[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itls]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.tokens - 1)
            for r in ok if r.tokens > 1 and len(r.chunk_times) > 1]
    return {"requests": len(results), "errors": len(results) - len(ok),
            "error_samples": [r.error for r in results if r.error][:3],
            "output_tokens": sum(r.tokens for r in ok),
            "ttft_s": summary(ttft), "itl_s": summary(itl), "tpot_s": summary(tpot),
            "e2e_s": summary([r.end - r.start for r in ok if r.end])}


# -- systems -----------------------------------------------------------------------------------
class System:
    """A started unified server or 1P1D cluster: `ready()` waits for it, `stop()` ends it."""

    def __init__(self, name: str, url: str = "", handle: Any = None,
                 pids: dict[str, int] | None = None) -> None:
        self.name, self.url, self.handle, self.pids = name, url, handle, pids or {}

    def ready(self, timeout: float = 600.0) -> System:
        h = self.handle
        if h is None:
            return self
        if hasattr(h, "wait_healthy"):
            h.wait_healthy(timeout)
        else:
            h.start(timeout)
            self.pids["router"] = h.router.proc.pid
        self.url = h.url
        return self

    def affinity(self) -> dict[str, Any]:
        return {role: tree_affinity(pid) for role, pid in self.pids.items()}

    def cpu_seconds(self) -> float | None:
        """CPU seconds used so far by every process of this system (None: not ours)."""
        return sum(cpu_seconds(pid) for pid in self.pids.values()) if self.pids else None

    def cpu_snapshot(self) -> dict[str, float]:
        """CPU seconds so far per process: '<role> http' (the server itself, or the router)
        and '<role> scheduler' (its children: the model's process)."""
        out: dict[str, float] = {}
        for role, pid in self.pids.items():
            per = cpu_by_process(pid)
            out[f"{role} http" if role != "router" else role] = per.pop(pid, 0.0)
            if per:
                out[f"{role} scheduler"] = sum(per.values())
        return out

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.stop()


def spawn_system(kind: str, args: argparse.Namespace) -> System:
    """Spawn without waiting, so several systems load their models at the same time."""
    flags = ("--max-total-tokens", str(args.max_total_tokens), *args.server_flag)
    if kind.startswith("unified"):
        cpus = parse_cpus(args.unified_cpus) if args.pin else None
        threads = args.unified_threads or (len(cpus) if cpus else None)
        if kind == "unified-1t":
            threads = 1
        s = start_unified(args.model_path, flags, cpus, threads, wait=False,
                          wait_policy=args.omp_wait_policy or None)
        return System(kind, s.url, s, {"unified": s.proc.pid})
    pin = args.pin
    c = start_pd(args.model_path, kind.removeprefix("pd-"), flags,
                 parse_cpus(args.p_cpus) if pin else None, parse_cpus(args.d_cpus) if pin else None,
                 args.pd_threads or (1 if pin else None), wait=False,
                 wait_policy=args.omp_wait_policy or None)
    return System(kind, "", c, {"prefill": c.prefills[0].proc.pid,
                                "decode": c.decodes[0].proc.pid})


def start_systems(kinds: list[str], args: argparse.Namespace) -> dict[str, System]:
    systems: dict[str, System] = {}
    try:
        for kind in kinds:
            print(f"starting {kind} ...", flush=True)
            systems[kind] = (System("given", args.url) if kind == "given"
                             else spawn_system(kind, args))
        for s in systems.values():
            s.ready()
    except BaseException:
        for s in systems.values():
            s.stop()
        raise
    return systems


def vocab_size(url: str) -> int:
    """From /get_server_info (a pdserve server, or a router that passes it through)."""
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    if isinstance(info, dict) and "vocab_size" not in info:  # a router: per-worker entries
        info = next((v for v in info.values() if isinstance(v, dict) and "vocab_size" in v),
                    next((x for v in info.values() if isinstance(v, list) for x in v
                          if isinstance(x, dict) and "vocab_size" in x), {}))
    if "vocab_size" not in info:
        raise RuntimeError(f"{url}/get_server_info has no vocab_size; is it a pdserve server?")
    return int(info["vocab_size"])


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--url", help="benchmark this running server or router")
    mode.add_argument("--start", choices=["pd", *SYSTEM_KINDS])
    mode.add_argument("--compare", action="store_true", help="unified, pd-tcp, pd-shm in one run")
    ap.add_argument("--systems", nargs="+", default=["unified", "pd-tcp", "pd-shm"],
                    choices=SYSTEM_KINDS, help="with --compare (unified-1t: one torch thread)")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-requests", type=int, default=48, help="per system and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool per server")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin servers (taskset-like) and set torch threads = cores")
    ap.add_argument("--unified-cpus", default="0,1")
    ap.add_argument("--p-cpus", default="0")
    ap.add_argument("--d-cpus", default="1")
    ap.add_argument("--unified-threads", type=int, default=0, help="0: one per pinned CPU")
    ap.add_argument("--pd-threads", type=int, default=0, help="P and D each; 0: 1 when pinned")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY of every server ('' leaves it unset; see common.py)")
    ap.add_argument("--server-flag", action="append", default=[],
                    help="extra `pdserve serve` flag (repeat; e.g. --server-flag=--page-size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--name", default=NAME, help="result file name")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.rounds, args.output_len = 8, 1, 16
    if args.start == "pd":
        args.start = "pd-tcp"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    run = Run(args.name, config)
    kinds = args.systems if args.compare else [args.start or "given"]
    systems = start_systems(kinds, args)
    try:
        data = asyncio.run(measure(systems, args))
        data["affinity"] = {k: s.affinity() for k, s in systems.items()}
    finally:
        for s in systems.values():
            s.stop()
    path = run.finish(data, args.out_dir)
    report(data, args, load_note(run), path)
    plot(data, args, load_note(run))
    return data


async def measure(systems: dict[str, System], args: argparse.Namespace) -> dict[str, Any]:
    vocab = vocab_size(next(iter(systems.values())).url)
    for s in systems.values():  # warm-up
        await closed_loop(s.url, random_prompts(2, args.input_len, vocab, 999), 4, 2)
    per_round: dict[str, list[dict[str, Any]]] = {k: [] for k in systems}
    cpu_before = {k: s.cpu_snapshot() for k, s in systems.items()}
    pooled: dict[str, list[Result]] = {k: [] for k in systems}
    for rnd in range(args.rounds):
        prompts = random_prompts(args.num_requests, args.input_len, vocab, args.seed + rnd)
        for kind in alternating(list(systems), rnd):
            c0 = systems[kind].cpu_seconds()
            results, wall = await closed_loop(systems[kind].url, prompts, args.output_len,
                                              args.concurrency)
            c1 = systems[kind].cpu_seconds()
            toks = sum(r.tokens for r in results if r.error is None)
            st = latency_stats(results)
            cpu = None if c0 is None or c1 is None else c1 - c0
            per_round[kind].append({"round": rnd, "wall_s": wall, "output_tok_s": toks / wall,
                                    "server_cpu_s": cpu,
                                    "output_tok_per_cpu_s": toks / cpu if cpu else None, **st})
            pooled[kind] += results
            print(f"round {rnd} {kind:8s} {toks / wall:7.1f} tok/s  TTFT p50 "
                  f"{st['ttft_s'].get('p50', float('nan')):.3f}s  ITL p50 "
                  f"{st['itl_s'].get('p50', float('nan')) * 1000:.0f}ms  errors {st['errors']}",
                  flush=True)
    cpu_split = {k: {role: round(v - cpu_before[k].get(role, 0.0), 2)
                     for role, v in s.cpu_snapshot().items()} for k, s in systems.items()}
    stats = {}
    for kind in systems:
        st = latency_stats(pooled[kind])
        st["output_tok_s"] = statistics.median(r["output_tok_s"] for r in per_round[kind])
        st["output_tok_s_rounds"] = [r["output_tok_s"] for r in per_round[kind]]
        per_cpu = [r["output_tok_per_cpu_s"] for r in per_round[kind] if r["output_tok_per_cpu_s"]]
        st["output_tok_per_cpu_s"] = statistics.median(per_cpu) if per_cpu else None
        stats[kind] = st
    ratios: dict[str, dict[str, float]] = {}
    if "unified" in stats:
        u = stats["unified"]
        for kind in (k for k in stats if k != "unified"):
            s = stats[kind]
            ratios[f"{kind}/unified"] = {
                "output_tok_s": ratio(s["output_tok_s"], u["output_tok_s"]),
                "output_tok_per_cpu_s": ratio(s["output_tok_per_cpu_s"] or 0,
                                              u["output_tok_per_cpu_s"] or 0),
                **{f"{m}_{p}": ratio(s[f"{m}_s"].get(p, 0), u[f"{m}_s"].get(p, 0))
                   for m in ("ttft", "itl") for p in ("p50", "p99")}}
    vs_vllm = {kind: ratio(s["output_tok_s"],
                           VLLM_TOK_S["pd" if kind.startswith("pd") else "unified"])
               for kind, s in stats.items()}
    return {"stats": stats, "rounds": per_round, "ratios": ratios,
            "server_cpu_s_by_process": cpu_split,
            "vs_vllm_cpu_reference": {"reference_tok_s": VLLM_TOK_S, "ratio": vs_vllm},
            "raw": {k: [asdict(r) | {"itls": r.itls} for r in v] for k, v in pooled.items()}}


def report(data: dict[str, Any], args: argparse.Namespace, note: str, path: Path) -> None:
    print(f"\n{args.num_requests} req x {args.rounds} rounds, {args.input_len} in / "
          f"{args.output_len} out, concurrency {args.concurrency}")
    print(f"{'system':>8} {'tok/s':>7} {'tok/cpu-s':>9} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} "
          f"{'p99':>7} {'errors':>6}  vs vLLM")
    for kind, s in data["stats"].items():
        t, i = s["ttft_s"], s["itl_s"]
        print(f"{kind:>8} {s['output_tok_s']:7.1f} {s['output_tok_per_cpu_s'] or 0:9.1f} "
              f"{t.get('p50', 0):8.3f}s {t.get('p99', 0):6.3f}s {i.get('p50', 0) * 1000:6.0f}ms "
              f"{i.get('p99', 0) * 1000:5.0f}ms {s['errors']:6d}"
              f"  {data['vs_vllm_cpu_reference']['ratio'][kind]:.2f}x")
    for kind, split in data["server_cpu_s_by_process"].items():
        print(f"CPU s during the rounds, {kind}: " + ", ".join(f"{k} {v:.1f}"
                                                          for k, v in split.items()))
    for name, r in data["ratios"].items():
        print(f"RATIO {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    print(f"({note}) -> {path}")


def plot(data: dict[str, Any], args: argparse.Namespace, note: str) -> None:
    stats = data["stats"]
    kinds = list(stats)
    fig, (a, b, c) = figure(3, 4.6, 4.0)
    bar_groups(a, kinds, {"output tok/s": [stats[k]["output_tok_s"] for k in kinds],
                          "vLLM CPU (ref)": [VLLM_TOK_S["pd" if k.startswith("pd") else "unified"]
                                             for k in kinds]},
               "output tokens/s", f"throughput, conc. {args.concurrency}",
               errors={"output tok/s": [(min(stats[k]["output_tok_s_rounds"]),
                                         max(stats[k]["output_tok_s_rounds"])) for k in kinds]})
    for ax, metric, unit, scale in ((b, "ttft_s", "s", 1.0), (c, "itl_s", "ms", 1000.0)):
        bar_groups(ax, kinds, {p: [stats[k][metric].get(p, 0) * scale for k in kinds]
                               for p in ("p50", "p99")}, f"{metric[:-2].upper()} ({unit})",
                   f"{metric[:-2].upper()} p50 / p99")
    fig.suptitle(f"serving: {args.input_len} in / {args.output_len} out; {note}", fontsize=9)
    save_figure(fig, args.name, args.out_dir)


if __name__ == "__main__":
    main()
