"""The default GGUF (SmolLM2-135M Q4_1, Q8_0 embedding) served packed against the same file
de-quantized to float32 (#48): real `pdserve serve` servers on loopback, the only differences
PDCORE_GGUF_PACKED=0 / 1 and, packed, the GEMM (--dots: one server per PDCORE_GGUF_DOT).
Measured side by side in one run:

- resident memory of each server's process tree (the HTTP process, the engine, multiprocessing's
  resource tracker) after a warm-up request and after the runs, three ways (tree_memory_mib):
  'resident', the headline ratio: anonymous pages plus each mapped file once per tree; PSS; and
  the VmRSS sum earlier runs reported. Also the engine's weight bytes (/server_info) and
  `memory_mib_peak`: the most 'resident' seen while a batch-8 request set decodes (sampled
  before the timed rounds: the decode K/V view, when a server keeps one, lives only then);
- decode TPOT at batch 1 and 8: B concurrent /generate requests of --prompt tokens (greedy,
  ignore_eos), once with 1 new token and once with 1 + --new; TPOT = (t_long - t_short) / --new.
  Rounds alternate the servers' order; the median is reported, every round is kept. Each round
  also streams the 1 + --new request set once (`tpot_stream_ms`): per request, the time from its
  first token event to its last over the tokens between, the median of the B requests. It leaves
  the prefills out, whose batching (the B requests arrive a few ms apart) moves t_long and
  t_short independently by more than a batch-8 step's differences (s12: the same code's packed
  batch-8 TPOT read 9.4-13.3 ms over four runs). And the engine's own forward time per decode
  step over each long request set (`forward_ms_per_decode_step_rounds`, from /metrics).

- `--before TREE`: one more server per system (float32 and each packed --dots) running TREE's
  code (PYTHONPATH=TREE, e.g. a checkout of main), so a change is measured against what it
  replaces in the same run, the servers' order alternating per round; the ratios are then given
  for both trees, each tree's packed servers over its own float32.

Where each server's resident memory goes (`breakdown`, the same rule as 'resident': a file's
pages once per tree): the heap, other anonymous pages, torch's libraries, other files.
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
# the servers: the GGUF de-quantized at load, and served packed with each GEMM of --dots
FLOAT32 = {"PDCORE_GGUF_PACKED": "0"}


def _smaps(pid: int, paths: dict[str, str] | None = None
           ) -> tuple[float, float, dict[str, float]]:
    """(Rss, Pss, {mapped file: its resident KiB}) of pid from /proc/pid/smaps, KiB; the
    anonymous pages (private copies of a library's pages among them) are under the key '', the
    heap's under '[heap]'. `paths` (if given) gets each file key's path."""
    rss = pss = 0.0
    files: dict[str, float] = {}
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):  # a mapping: address perms offset dev inode [path]
            fields = line.split(maxsplit=5)
            name = f"{fields[3]}:{fields[4]}" if fields[4] != "0" else ""
            if not name and len(fields) > 5 and fields[5].strip() == "[heap]":
                name = "[heap]"
            if paths is not None and name and name != "[heap]":
                paths[name] = fields[5].strip() if len(fields) > 5 else "?"
        elif head == "Rss:":
            rss += int(rest.split()[0])
            files[name] = files.get(name, 0.0) + int(rest.split()[0])
        elif head == "Pss:":
            pss += int(rest.split()[0])
        elif head == "Anonymous:" and name and name != "[heap]":  # copied-on-write pages
            files[name] -= int(rest.split()[0])
            files[""] = files.get("", 0.0) + int(rest.split()[0])
    return rss, pss, files


def _kind(path: str) -> str:
    """A mapped file's breakdown category."""
    return "torch libraries" if "/torch/lib/" in path else "other files"


def tree_memory_mib(pid: int) -> dict[str, Any]:
    """Resident memory (MiB) of pid's process tree (the HTTP process, the engine, the resource
    tracker), three ways, each per pid and summed under 'total':

    - 'resident' (the headline): every process's anonymous pages plus each mapped file's
      resident pages once per tree: what this server alone keeps in RAM, whatever else runs on
      the machine;
    - 'pss': proportional set size, a shared page split among all processes mapping it (on a
      shared machine it moves with the neighbours: the other server's libtorch, say);
    - 'rss': VmRSS, libraries the processes share counted in each (what earlier runs reported);
    and 'breakdown': 'resident' per process by kind (heap, other anonymous pages, torch's
    libraries, other files).
    """
    out: dict[str, Any] = {"rss": {}, "pss": {}, "resident": {}}
    breakdown: dict[str, dict[str, float]] = {}
    once: dict[str, float] = {}
    paths: dict[str, str] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            rss, pss, files = _smaps(p, paths)
        except OSError:
            continue
        todo += _children(p)
        kinds = {"heap": files.pop("[heap]", 0.0) / 1024, "anonymous": files.pop("", 0.0) / 1024}
        out["rss"][str(p)], out["pss"][str(p)] = rss / 1024, pss / 1024
        # a file's pages count once: a process is charged only what it holds beyond the most
        # any earlier process of the tree held of that file
        for k, v in files.items():
            kind = _kind(paths.get(k, ""))
            kinds[kind] = kinds.get(kind, 0.0) + max(0.0, v - once.get(k, 0.0)) / 1024
            once[k] = max(once.get(k, 0.0), v)
        out["resident"][str(p)] = sum(kinds.values())
        breakdown[str(p)] = kinds
    for v in out.values():
        v["total"] = sum(v.values())
    out["breakdown"] = breakdown
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


def decode_tpot(events: list[tuple[float, int]]) -> float:
    """Decode TPOT of one request from its stream's (arrival time, completion_tokens) events:
    the time from the first event to the last over the tokens generated between them (an event
    may carry several tokens), so the prefill, the queueing and the HTTP round trip are out."""
    if len(events) < 2 or events[-1][1] <= events[0][1]:
        raise ValueError(f"a decode TPOT needs two events tokens apart, got {events}")
    return (events[-1][0] - events[0][0]) / (events[-1][1] - events[0][1])


def _stream_tpot(url: str, ids: list[int], new: int) -> float:
    """decode_tpot of one streamed /generate of `new` tokens."""
    import json

    import httpx

    events: list[tuple[float, int]] = []
    with httpx.stream("POST", url + "/generate", timeout=600, json={
            "input_ids": ids, "stream": True, "sampling_params": {
                "max_new_tokens": new, "temperature": 0, "ignore_eos": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            t, event = time.perf_counter(), json.loads(line[6:])
            if "meta_info" not in event:
                raise RuntimeError(f"stream error event: {line[:300]}")
            events.append((t, event["meta_info"]["completion_tokens"]))
    return decode_tpot(events)


def _timed_stream(url: str, batch: int, prompt: int, new: int) -> float:
    """The median over `batch` concurrent streamed requests (the prompts of _timed) of each
    one's decode TPOT (_stream_tpot)."""
    prompts = [[(7 * i + 31 * j) % 5000 + 100 for j in range(prompt)] for i in range(batch)]
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        return statistics.median(pool.map(lambda p: _stream_tpot(url, p, new), prompts))


FORWARD = ("pdserve_scheduler_forward_decode_seconds_total",
           "pdserve_scheduler_forward_decode_steps_total")


def _forward_totals(url: str) -> tuple[float | None, ...]:
    return tuple(_metric(url, k) for k in FORWARD)


def _per_step(before: tuple[float | None, ...], after: tuple[float | None, ...]) -> float | None:
    """Seconds of engine forward per decode step between two _forward_totals (None when the
    server does not export them or ran no decode step): how much of a TPOT the model's forward
    is, the rest being the scheduler, the sampler and the HTTP side."""
    if None in before or None in after or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _median_ms(v: list[float | None]) -> str:
    v = [x for x in v if x is not None]
    return f"{statistics.median(v):.1f} ms" if v else "n/a"


def peak_memory_mib(pid: int, url: str, prompt: int, new: int) -> float:
    """The most 'resident' (tree_memory_mib) seen while 8 requests of `prompt` tokens decode
    `new` tokens each, sampled every 50 ms."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = pool.submit(_timed, url, 8, prompt, new)
        peak = 0.0
        while not done.done():
            peak = max(peak, tree_memory_mib(pid)["resident"]["total"])
            time.sleep(0.05)
        done.result()
    return peak


def _metric(url: str, name: str) -> float | None:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _start_tree(tree: str, env: dict[str, str]) -> Any:
    """`pdserve serve` running `tree`'s pdcore: ServerProcess puts this checkout first on the
    server's PYTHONPATH, so the tree goes first on its sys.path (which multiprocessing's spawn
    hands the engine process)."""
    from pdcore.testing.processes import ServerProcess

    boot = (f"import runpy, sys; sys.path.insert(0, {str(Path(tree).resolve())!r}); "
            "runpy.run_module('pdcore', run_name='__main__', alter_sys=True)")
    return ServerProcess("--max-total-tokens", "8192", command=("-c", boot, "serve"),
                         env=env).wait_healthy(600.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dots", default="float,int8",
                    help="the packed servers, one per PDCORE_GGUF_DOT named (float, the default: "
                         "float activations against the de-quantized blocks; int8: activations "
                         "quantized per block of 32, integer dot products)")
    ap.add_argument("--before", default=None, metavar="TREE",
                    help="also a server per system (float32, each --dots) running TREE's code "
                         "(PYTHONPATH), named '<name> before'")
    ap.add_argument("--suffix", default="",
                    help="added to the result files' name (bench/results/gguf_packed<suffix>.*)")
    args = ap.parse_args()
    import httpx

    batches = [int(b) for b in args.batches.split(",")]
    systems = {"float32": FLOAT32, **{f"packed {d}": {"PDCORE_GGUF_PACKED": "1",
                                                       "PDCORE_GGUF_DOT": d}
                                      for d in args.dots.split(",")}}
    if args.before:
        if not (Path(args.before) / "pdcore").is_dir():
            ap.error(f"--before {args.before}: no pdcore/ there")
        systems.update({f"{name} before": env for name, env in list(systems.items())})
    run = Run(NAME + args.suffix, vars(args))
    servers = {name: start_unified(None, ("--max-total-tokens", "8192"), env=env)
               if not name.endswith(" before") else _start_tree(args.before, env)
               for name, env in systems.items()}
    out: dict[str, Any] = {"systems": {}}
    samples: dict[str, dict[int, list[float]]] = {}
    streamed: dict[str, dict[int, list[float]]] = {}  # _timed_stream's, the same rounds
    forward: dict[str, dict[int, float | None]] = {}  # the engine's forward per decode step
    try:
        for name, s in servers.items():
            _timed(s.url, 8, args.prompt, 4)  # warm-up: every batch size's buffers
            info = httpx.get(s.url + "/server_info", timeout=30).json()
            out["systems"][name] = {
                "memory_mib": tree_memory_mib(s.proc.pid),
                "weight_bytes": info.get("weight_bytes"),
                "gemm_weights_gguf": _metric(s.url, "pdserve_scheduler_gemm_weights_gguf"),
                "memory_mib_peak": peak_memory_mib(s.proc.pid, s.url, args.prompt,
                                                  1 + args.new),
            }
        for r in range(args.rounds):
            for name in alternating(list(servers), r):
                url = servers[name].url
                for b in batches:
                    short = _timed(url, b, args.prompt, 1)
                    before = _forward_totals(url)
                    long = _timed(url, b, args.prompt, 1 + args.new)
                    forward.setdefault(name, {}).setdefault(b, []).append(
                        _per_step(before, _forward_totals(url)))
                    samples.setdefault(name, {}).setdefault(b, []).append(
                        max(long - short, 1e-9) / args.new)
                    streamed.setdefault(name, {}).setdefault(b, []).append(
                        _timed_stream(url, b, args.prompt, 1 + args.new))
        for name, s in servers.items():  # after the runs too: the peak working set
            out["systems"][name]["memory_mib_after"] = tree_memory_mib(s.proc.pid)
    finally:
        for s in servers.values():
            s.stop()
    for name, per in samples.items():
        out["systems"][name]["decode"] = {
            str(b): {"tpot_ms": 1e3 * statistics.median(v), "tokens_per_s": b / statistics.median(v),
                     "tpot_ms_rounds": [1e3 * x for x in v],
                     "tpot_stream_ms": 1e3 * statistics.median(streamed[name][b]),
                     "tpot_stream_ms_rounds": [1e3 * x for x in streamed[name][b]],
                     "forward_ms_per_decode_step_rounds": [
                         None if x is None else 1e3 * x for x in forward[name][b]]}
            for b, v in per.items()}
    out["ratios"] = {}
    for name in systems:
        if name.startswith("float32"):
            continue
        base = "float32 before" if name.endswith(" before") else "float32"
        p, tag, btag = out["systems"][name], name.replace(" ", "_"), base.replace(" ", "_")
        f = out["systems"][base]
        out["ratios"].update({
            **{f"{k}_{tag}_over_{btag}": p["memory_mib_after"][k]["total"]
               / f["memory_mib_after"][k]["total"] for k in ("resident", "pss", "rss")},
            **{f"tpot_{tag}_over_{btag}_batch{b}":
               p["decode"][str(b)]["tpot_ms"] / f["decode"][str(b)]["tpot_ms"] for b in batches},
            **{f"tpot_stream_{tag}_over_{btag}_batch{b}":
               p["decode"][str(b)]["tpot_stream_ms"] / f["decode"][str(b)]["tpot_stream_ms"]
               for b in batches}})
    out["note"] = load_note(run)
    for name, m in out["systems"].items():
        mem = m["memory_mib_after"]
        print(f"{name}: resident {mem['resident']['total']:.0f} MiB (peak "
              f"{m['memory_mib_peak']:.0f}, PSS "
              f"{mem['pss']['total']:.0f}, RSS {mem['rss']['total']:.0f}), " + ", ".join(
            f"batch {b} TPOT {m['decode'][str(b)]['tpot_ms']:.1f} ms (streamed "
            f"{m['decode'][str(b)]['tpot_stream_ms']:.1f}, forward "
            f"{_median_ms(m['decode'][str(b)]['forward_ms_per_decode_step_rounds'])})"
            for b in batches),
              flush=True)
    print({k: round(v, 3) for k, v in out["ratios"].items()})
    print(run.finish(out))
    fig, (ax1, ax2) = figure(2, width=5)
    bar_groups(ax1, ["resident", "PSS", "RSS", "peak resident"],
               {n: [out["systems"][n]["memory_mib_after"][k]["total"]
                    for k in ("resident", "pss", "rss")] + [out["systems"][n]["memory_mib_peak"]]
                for n in systems},
               "MiB (server's processes)", "memory")
    bar_groups(ax2, [f"batch {b}" for b in batches],
               {n: [out["systems"][n]["decode"][str(b)]["tpot_ms"] for b in batches]
                for n in systems}, "decode TPOT (ms)", f"TPOT ({out['note']})")
    print(save_figure(fig, NAME + args.suffix))


if __name__ == "__main__":
    main()
