"""Where a bf16 decode step's time goes at the batches goodput runs (#47): phases and symbols.

Lifecycle:
1. load pdserve's engine with bfloat16 weights (LLMEngine, the packaged SmolLM2 unless
   --model-path), its K/V pool filled with random values;
2. per shape (--shapes, B x ctx): a model-only decode step (B sequences, ctx tokens each,
   the native decode_layers path the server takes) timed by phase with the wall clock:
   begin (embedding, rotary, the decode group), the layer loop (fast_layers: the C++ step),
   logits (final norm + lm_head) and the sampler at temperature 1 over the B x vocab logits;
   with --co-runner D, a process of our own beside it the whole time, busy a fraction D of
   every 4 ms on one core (what a server's HTTP process and its clients do to a 2-core box);
3. with --perf, `perf record` of the same loop (this process only) and its self time by
   symbol, grouped (bf16 GEMM, attention, norms/rope/silu, OpenMP runtime, libtorch,
   python, sampler, other);
4. the bf16 GEMM alone over the body's packed matrices at --bandwidth-rows rows (one
   linear_bf16 call each, in the step's order) and the lm_head, against a plain 2-thread read
   of as many bytes: GB/s, i.e. whether the GEMM is at the memory's rate or bound by its
   vdpbf16ps work (which grows with the rows);
5. write bench/results/bf16_step_profile<suffix>.json and .png (load and CPU recorded).

Run: `python bench/bf16_step_profile.py [--shapes 8x512 16x1024] [--iters 30] [--perf]`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Run, figure, load_note, save_figure
from engine_profile import decode_batch
from engine_throughput import PdserveRunner

NAME = "bf16_step_profile"
# first match wins; matched against the demangled symbol and its DSO
SYMBOL_GROUPS = (
    ("omp_runtime", ("libgomp", "libiomp", "gomp_", "__kmp")),
    ("attention", ("attn", "attend", "attention", "softmax_block", "decode_part")),
    ("bf16_gemm", ("bf16", "panel", "gemm", "dpbf16")),
    ("norm_rope_silu", ("rms", "rope", "silu", "norm")),
    ("sampler", ("sample", "sampler")),
    ("python", ("python", "libpython", "_Py", "Py")),
    ("libtorch", ("libtorch", "libc10", "at::", "c10::", "torch::")),
    ("kernel", ("[kernel", "kallsyms")),
)


def phase_timers(model: Any) -> tuple[dict[str, list[float]], Any]:
    """Wraps begin / fast_layers / logits_of of this model instance with wall-clock timers."""
    times: dict[str, list[float]] = defaultdict(list)
    originals = {}
    for name in ("begin", "fast_layers", "logits_of"):
        fn = getattr(model, name)
        originals[name] = fn

        def wrapped(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = _fn(*a, **k)
            times[_name].append((time.perf_counter() - t0) * 1000)
            return out
        setattr(model, name, wrapped)

    def restore() -> None:
        for name in originals:
            delattr(model, name)
    return times, restore


def sample_states(batch: int) -> list[Any]:
    from pdcore.engine.sched.sampler import SampleState
    from pdcore.messages.io import SamplingParams

    return [SampleState.create(SamplingParams(temperature=1.0, max_new_tokens=1 << 20,
                                              ignore_eos=True), [1, 2, 3])
            for _ in range(batch)]


HOG = ("import sys, time\nd, p = float(sys.argv[1]), 0.004\nwhile True:\n"
       "    t = time.perf_counter()\n    while time.perf_counter() - t < p * d: pass\n"
       "    time.sleep(p * (1 - d))\n")


@contextlib.contextmanager
def co_runner(duty: float) -> Iterator[None]:
    """A busy-then-sleep process beside the timed loop (duty 0: none); killed on the way out."""
    if duty <= 0:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", HOG, str(duty)])
    try:
        yield
    finally:
        proc.kill()
        proc.wait(timeout=10)


def perf_start(out: Path) -> subprocess.Popen[bytes] | None:
    try:
        p = subprocess.Popen(["perf", "record", "-F", "1999", "-p", str(os.getpid()), "-o",
                              str(out), "-q"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    except OSError:
        return None
    time.sleep(1.0)  # perf attaches
    return p


def perf_stop(p: subprocess.Popen[bytes] | None, out: Path) -> dict[str, Any] | None:
    if p is None:
        return None
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)
        return None
    rep = subprocess.run(["perf", "report", "-i", str(out), "--stdio", "--no-children",
                          "--sort", "dso,sym", "--percent-limit", "0.2"],
                         capture_output=True, text=True, timeout=300)
    rows: list[tuple[float, str, str]] = []
    for line in rep.stdout.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*)$", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3).strip()))
    groups: dict[str, float] = defaultdict(float)
    for pct, dso, sym in rows:
        text = f"{dso} {sym}"
        g = next((g for g, keys in SYMBOL_GROUPS if any(k in text for k in keys)), "other")
        groups[g] += pct
    listed = sum(p for p, _, _ in rows)
    groups["below_0.2pct"] = max(0.0, 100.0 - listed)
    return {"groups_pct": dict(groups),
            "top": [{"pct": p, "dso": d, "sym": s[:160]} for p, d, s in rows[:30]]}


def profile_shape(runner: PdserveRunner, batch: int, ctx: int, iters: int,
                  use_perf: bool) -> dict[str, Any]:
    from pdcore.engine.sched import sampler

    model, kv = runner.engine.engine.model, runner.engine.engine.kv
    vocab = runner.vocab
    steps_before = getattr(model, "native_steps", 0)
    times, restore = phase_timers(model)
    step_ms, sample_ms = [], []
    states = sample_states(batch)
    paths: dict[str, int] = {}
    perf_file = Path(tempfile.mkdtemp()) / "perf.data"
    try:
        for _ in range(3):  # warm up
            model(decode_batch(model, batch, ctx, vocab), kv.layers)
        times.clear()
        p = perf_start(perf_file) if use_perf else None
        for _ in range(iters):
            b = decode_batch(model, batch, ctx, vocab)
            t0 = time.perf_counter()
            logits = model(b, kv.layers)
            t1 = time.perf_counter()
            sampler.sample(logits, states, [None] * batch, paths=paths)
            t2 = time.perf_counter()
            step_ms.append((t1 - t0) * 1000)
            sample_ms.append((t2 - t1) * 1000)
        perf = perf_stop(p, perf_file) if use_perf else None
    finally:
        restore()
    med = {k: statistics.median(v) for k, v in times.items()}
    step = statistics.median(step_ms)
    out = {"batch": batch, "ctx": ctx, "iters": iters,
           "forward_ms": step, "forward_raw_ms": step_ms,
           "sample_t1_ms": statistics.median(sample_ms), "sampler_paths": paths,
           "phase_ms": {"begin": med.get("begin"), "layers_native": med.get("fast_layers"),
                        "logits_norm_lm_head": med.get("logits_of"),
                        "rest_of_forward": step - sum(med.values())},
           "native_steps": getattr(model, "native_steps", 0) - steps_before,
           "perf": perf}
    return out


def bandwidth(runner: PdserveRunner, rows: int, iters: int) -> dict[str, Any]:
    """The bf16 GEMM's read rate over the body weights (every layer's four packed matrices at
    `rows` rows, one linear_bf16 call each, in the step's order) and the lm_head's, against a
    plain 2-thread read of as many bytes (torch sum over a float32 view): is it at bandwidth?"""
    from pdcore.engine import native

    o = native.ops()
    model = runner.engine.engine.model
    p = model.native
    if o is None or p is None:
        return {"skipped": "no native ops / no native decode loop"}
    mats = [w for i in range(len(p["qkv_w"]))
            for w in (p["qkv_w"][i], p["o_w"][i], p["gu_w"][i], p["down_w"][i])]
    head = model.lm_head_packed
    g = torch.Generator().manual_seed(2)

    def xs(w: torch.Tensor) -> torch.Tensor:
        return torch.randn(rows, w.shape[1] * 2, generator=g).to(torch.bfloat16)
    inputs = [xs(w) for w in mats]
    body_bytes = sum(w.numel() * 2 for w in mats)
    blob = torch.ones(body_bytes // 4)  # float32, as many bytes as the body weights
    res: dict[str, list[float]] = defaultdict(list)
    for it in range(iters + 2):
        t0 = time.perf_counter()
        for w, x in zip(mats, inputs):
            o.linear_bf16(x, w, w.shape[0] * 32, None)
        t1 = time.perf_counter()
        blob.sum()
        t2 = time.perf_counter()
        if head is not None and head.dim() == 4:
            o.linear_bf16(xs(head), head, head.shape[0] * 32, None)
        t3 = time.perf_counter()
        if it >= 2:
            res["body_gemm_ms"].append((t1 - t0) * 1000)
            res["plain_read_ms"].append((t2 - t1) * 1000)
            res["lm_head_ms"].append((t3 - t2) * 1000)
    med = {k: statistics.median(v) for k, v in res.items()}
    head_bytes = head.numel() * 2 if head is not None else 0
    return {"rows": rows, "body_bytes": body_bytes, "lm_head_bytes": head_bytes, **med,
            "raw": dict(res),
            "body_gemm_GBps": body_bytes / med["body_gemm_ms"] / 1e6,
            "plain_read_GBps": body_bytes / med["plain_read_ms"] / 1e6,
            "lm_head_GBps": head_bytes / med["lm_head_ms"] / 1e6 if head_bytes else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--shapes", nargs="+", default=["8x512", "16x1024"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--perf", action="store_true")
    ap.add_argument("--co-runner", type=float, default=0.0,
                    help="duty (0-1) of a busy process of ours beside the timed loops")
    ap.add_argument("--bandwidth-rows", type=int, nargs="*", default=[1, 6, 8, 12, 16])
    ap.add_argument("--suffix", default="_s13")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    if not 0.0 <= args.co_runner < 1.0:
        ap.error(f"--co-runner {args.co_runner}: a duty in [0, 1)")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    torch.set_num_threads(args.threads)
    run = Run(NAME + args.suffix, {k: str(v) if isinstance(v, Path) else v
                                   for k, v in vars(args).items()})
    tokens = max(b * (c + 1) for b, c in shapes)
    runner = PdserveRunner(args.model_path, tokens, "bfloat16")
    try:
        kv = runner.engine.engine.kv
        g = torch.Generator().manual_seed(1)
        for k, v in kv.layers:
            for t in (k, v):
                t.copy_(torch.randn(t.shape, generator=g))
        with co_runner(args.co_runner):
            results = [profile_shape(runner, b, c, args.iters, args.perf) for b, c in shapes]
            bw = [bandwidth(runner, r, args.iters) for r in args.bandwidth_rows]
    finally:
        runner.close()
    path = run.finish({"shapes": results, "bandwidth": bw}, args.out_dir)
    plot(results, bw, load_note(run), NAME + args.suffix, args.out_dir)
    for r in results:
        ph = r["phase_ms"]
        print(f"bf16 b{r['batch']} x ctx {r['ctx']}: forward {r['forward_ms']:.2f} ms "
              f"(begin {ph['begin']:.2f}, layers {ph['layers_native']:.2f}, logits "
              f"{ph['logits_norm_lm_head']:.2f}, rest {ph['rest_of_forward']:.2f}; native steps "
              f"{r['native_steps']}), sampler t=1 {r['sample_t1_ms']:.2f} ms {r['sampler_paths']}")
        if r["perf"]:
            print("  perf self %: " + ", ".join(
                f"{g} {p:.1f}" for g, p in sorted(r["perf"]["groups_pct"].items(),
                                                   key=lambda x: -x[1])))
            for row in r["perf"]["top"][:14]:
                print(f"    {row['pct']:5.1f}% {row['dso'][:28]:28s} {row['sym'][:90]}")
    for b in bw:
        if "skipped" in b:
            print(f"bandwidth: {b['skipped']}")
            continue
        print(f"bf16 GEMM at {b['rows']} rows over the body ({b['body_bytes'] / 1e6:.0f} MB): "
              f"{b['body_gemm_ms']:.2f} ms = {b['body_gemm_GBps']:.1f} GB/s; a plain read of "
              f"as many bytes {b['plain_read_ms']:.2f} ms = {b['plain_read_GBps']:.1f} GB/s; "
              f"lm_head ({b['lm_head_bytes'] / 1e6:.0f} MB) {b['lm_head_ms']:.2f} ms = "
              f"{b['lm_head_GBps'] or 0:.1f} GB/s")
    print(f"({load_note(run)}) -> {path}")
    return {"shapes": results, "bandwidth": bw}


def plot(results: list[dict[str, Any]], bw: list[dict[str, Any]], note: str, name: str,
         out_dir: Path | None) -> None:
    """Left: the forward per shape split by perf's self-time shares (thread time, both
    threads). Right: the bf16 GEMM's read rate over the body against the rows, and the plain
    read's."""
    fig, (a, b) = figure(2, 5.5, 4.4)
    labels = [f"b{r['batch']} x {r['ctx']}" for r in results]
    groups = sorted({g for r in results if r["perf"] for g in r["perf"]["groups_pct"]})
    bottom = [0.0] * len(results)
    for g in groups:
        vals = [r["forward_ms"] * (r["perf"] or {"groups_pct": {}})["groups_pct"].get(g, 0) / 100
                for r in results]
        a.bar(labels, vals, bottom=bottom, label=g)
        bottom = [x + y for x, y in zip(bottom, vals)]
    a.set_ylabel("ms per forward (perf self-time shares)")
    a.set_title("bf16 decode forward by symbol group", fontsize=10)
    a.legend(fontsize=6)
    ok = [x for x in bw if "skipped" not in x]
    if ok:
        rows = [x["rows"] for x in ok]
        b.plot(rows, [x["body_gemm_GBps"] for x in ok], "o-", label="bf16 GEMM, body")
        b.plot(rows, [x["lm_head_GBps"] or 0 for x in ok], "s-", label="bf16 GEMM, lm_head")
        b.plot(rows, [x["plain_read_GBps"] for x in ok], "k--", label="plain read (sum)")
        b.set_xlabel("rows (decode batch)")
        b.set_ylabel("GB/s of weights read")
        b.set_ylim(bottom=0)
        b.legend(fontsize=7)
        b.set_title("is the bf16 GEMM at bandwidth?", fontsize=10)
    fig.suptitle(f"{name}: {note}", fontsize=9)
    save_figure(fig, name, out_dir)


if __name__ == "__main__":
    main()
