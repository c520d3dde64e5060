"""What the processes beside the engine cost it (#47 goodput): CPU seconds per output token of
each process during a goodput trial, and the trial's attainment / TTFT / TPOT p99, per variant,
side by side.

A trial is bench/goodput.py's (its Poisson mix, its seeds per rate, --seeds x --requests, the
DistServe attainment at its targets). Each (repeat, rate, variant) starts its own pdserve
unified server (so no variant inherits the other's caches), warms it up, runs one trial and
stops it; variants alternate within each rate, the same requests for each. CPU per process is
read from /proc/<pid>/stat (user + system) before and after the trial: the HTTP process
(`pdserve serve`, tokenization, detokenization, SSE), the scheduler (engine) process, any
other child, and this bench's own process (the client, which shares the box).

A variant is 'label' or 'label:ENV=VALUE,...:flags' (server environment, extra `serve` flags);
`label:...` with `http_nice=N` in the environment list instead renices the HTTP process's threads
by N from outside after start-up (its scheduler keeps the server's nice).

`--py-spy PATH`: one extra trial of the first variant with py-spy sampling the HTTP process
(--nonblocking), its folded stacks summed by category (tokenize, detokenize, SSE / HTTP, zmq /
pickle, logging, metrics, idle); a profiling run, not part of the A/B.

Writes bench/results/<name>.json and .png. Run (timing: under the quiet lock):
`python bench/frontcpu.py --model-path /work/smollm2-hf --dtype bfloat16 --rates 2.25 2.53
--variants base nice10:http_nice=10 --name frontcpu_s14`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, cpu_by_process, figure, load_note, save_figure
from goodput import trial
from many_streams import system_args, vocab
from pdcore.runtime.lifeline import lower_own_priority
from vllm_launch import Group, Proc, free_port
from workload import QUICK, Shape, closed_loop, requests

NAME = "frontcpu"


def parse_variant(spec: str) -> tuple[str, dict[str, str], list[str]]:
    label, _, rest = spec.partition(":")
    env_s, _, flags = rest.partition(":")
    env = dict(kv.split("=", 1) for kv in env_s.split(",") if kv)
    return label, env, shlex.split(flags)


def start(args: argparse.Namespace, env: dict[str, str], flags: list[str]) -> Group:
    port = free_port()
    g = Group()
    g.add(Proc([sys.executable, "-m", "pdcore", "serve", "--host", "127.0.0.1", "--port",
                str(port), *(["--model-path", args.model_path] if args.model_path else []),
                "--dtype", args.dtype, *flags],
               f"http://127.0.0.1:{port}", env=env, name="pdserve"))
    return g


def roles(pid: int) -> dict[int, str]:
    """pid -> http / scheduler / other: the scheduler is the spawned child with most CPU."""
    cpu = cpu_by_process(pid)
    kids = sorted((p for p in cpu if p != pid), key=lambda p: -cpu[p])
    out = {pid: "http"}
    for i, p in enumerate(kids):
        out[p] = "scheduler" if i == 0 else "other"
    return out


def client_cpu() -> float:
    t = os.times()
    return t.user + t.system


def cpu_delta(pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    names = roles(pid)
    out: Counter[str] = Counter()
    for p, s in after.items():
        out[names.get(p, "other")] += s - before.get(p, 0.0)
    return dict(out)


CATEGORIES = [  # first match of a frame's text wins, innermost frame first
    ("detokenize", ("detokenizer.py", "Tokenizer.decode", "decoders", "convert_ids")),
    ("tokenize", ("encode", "tokenizer", "chat_encode")),
    ("zmq_pickle", ("zmq", "pickle", "recv_pyobj", "_recv_loop", "send_pyobj")),
    ("logging", ("logging/", "journal.py")),
    ("metrics", ("metrics.py", "prometheus")),
    ("sse_http", ("openai_routes.py", "generation.py", "uvicorn", "starlette", "h11",
                  "httptools", "json", "output.py", "streams.py", "transports")),
    ("event_loop", ("base_events.py", "selectors.py", "asyncio")),
]


def categorise(folded: Path) -> dict[str, int]:
    """Samples per category from py-spy's raw (folded) output: 'frames;frames count'."""
    out: Counter[str] = Counter()
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")[::-1]
        cat = "other"
        for f in frames:
            hit = next((c for c, keys in CATEGORIES if any(k in f for k in keys)), None)
            if hit:
                cat = hit
                break
        out[cat] += int(n)
    return dict(out)


def top_frames(folded: Path, n: int = 20) -> dict[str, dict[str, int]]:
    """The `n` frames with most samples on top of the stack (self) and anywhere in it."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    for line in folded.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        if k.isdigit():
            frames = stack.split(";")
            own[frames[-1]] += int(k)
            for f in set(frames):
                anywhere[f] += int(k)
    return {"self": dict(own.most_common(n)), "inclusive": dict(anywhere.most_common(n))}


def one(args: argparse.Namespace, rate: float, label: str, env: dict[str, str],
        flags: list[str], shape: Shape, voc: int, pyspy: str | None = None) -> dict[str, Any]:
    nice = int(env.pop("http_nice", "0") or 0) if "http_nice" in env else 0
    group = start(args, env, flags)
    out: dict[str, Any] = {"variant": label, "rate": rate, "env": env, "flags": flags,
                           "http_nice": nice}
    try:
        out["startup_s"] = group.wait_ready(args.startup_timeout)
        pid = group.procs[0].proc.pid
        if nice:
            out["reniced_threads"] = lower_own_priority(nice, pid)
        asyncio.run(closed_loop(group.url, requests(4, voc, args.seed + 99, shape), 2,
                                args.timeout, args.sampling))
        spy = None
        if pyspy:
            raw = Path(args.out_dir or Path(__file__).parent / "results") / \
                f"{args.name}_pyspy_{label}.txt"
            raw.parent.mkdir(parents=True, exist_ok=True)
            spy = subprocess.Popen([pyspy, "record", "-p", str(pid), "-r", "100",
                                    "--nonblocking", "-f", "raw", "-o", str(raw),
                                    "-d", str(int(args.pyspy_s))],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        c0, k0, t0 = cpu_by_process(pid), client_cpu(), time.monotonic()
        res = trial(group.url, rate, args, shape, voc)
        c1, k1 = cpu_by_process(pid), client_cpu()
        out.update(res)
        cpu = cpu_delta(pid, c0, c1)
        cpu["client"] = k1 - k0
        tokens = res["output_tok_s"] * res["wall_s"]
        out["cpu_s"] = cpu
        out["output_tokens"] = tokens
        out["cpu_ms_per_token"] = {k: 1e3 * v / tokens for k, v in cpu.items()} if tokens else {}
        out["trial_s"] = time.monotonic() - t0
        print(f"    {label}: CPU ms/token " + ", ".join(
            f"{k} {v:.2f}" for k, v in out["cpu_ms_per_token"].items()), flush=True)
        if spy is not None:
            try:
                spy.wait(args.pyspy_s + 60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait(10)
            err = spy.stderr.read().decode()[-500:] if spy.stderr else ""
            out["pyspy"] = categorise(raw) if raw.exists() else {"error": err}
            if raw.exists():
                out["pyspy_top"] = top_frames(raw)
            print(f"    py-spy: {out['pyspy']}", flush=True)
    except RuntimeError as e:
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"  {label}: {out['error']}", flush=True)
    finally:
        group.stop()
    return out


def plot(data: dict[str, Any], name: str, out_dir: Path | None) -> Path:
    fig, axes = figure(3, 4.8, 4.0)
    rows = [t for t in data["trials"] if "attainment" in t]
    labels = list(dict.fromkeys(t["variant"] for t in rows))
    rates = sorted({t["rate"] for t in rows})
    for lab in labels:
        for ax, key, scale in ((axes[0], "attainment", 100), (axes[1], "tpot_p99_s", 1e3)):
            pts = [(t["rate"], t[key] * scale) for t in rows if t["variant"] == lab]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=lab)
    roles_ = ["http", "scheduler", "client", "other"]
    w = 0.8 / max(1, len(labels))
    for i, lab in enumerate(labels):
        mine = [t["cpu_ms_per_token"] for t in rows if t["variant"] == lab]
        vals = [sum(m.get(r, 0.0) for m in mine) / len(mine) for r in roles_]
        axes[2].bar([j + i * w for j in range(len(roles_))], vals, w, label=lab)
    axes[2].set_xticks([j + 0.4 - w / 2 for j in range(len(roles_))], roles_)
    axes[0].set(xlabel="req/s", ylabel="%", title="SLO attainment")
    axes[1].set(xlabel="req/s", ylabel="ms", title="TPOT p99")
    axes[2].set(ylabel="CPU ms per output token", title="CPU by process (mean of trials)")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.suptitle(f"pdserve's processes beside the engine ({rates} req/s); {data['load']}",
                 fontsize=9)
    return save_figure(fig, name, out_dir)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[2.25])
    ap.add_argument("--variants", nargs="+", default=["base"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--ttft-p99", type=float, default=3.0)
    ap.add_argument("--tpot-p99", type=float, default=0.1)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--py-spy", default=None, help="py-spy binary: one profiled trial first")
    ap.add_argument("--pyspy-s", type=float, default=60.0)
    system_args(ap, NAME)
    args = ap.parse_args(argv)
    shape = QUICK if args.quick else Shape()
    voc = vocab(args.model_path)
    run = Run(args.name, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    variants = [parse_variant(v) for v in args.variants]
    data: dict[str, Any] = {"trials": [], "shape": shape.as_dict()}
    if args.py_spy:
        lab, env, flags = variants[0]
        data["profile"] = one(args, args.rates[0], lab, dict(env), flags, shape, voc,
                              args.py_spy)
    for rep in range(args.repeats):
        for rate in args.rates:
            order = variants if rep % 2 == 0 else variants[::-1]
            for lab, env, flags in order:
                t = one(args, rate, lab, dict(env), flags, shape, voc)
                t["repeat"] = rep
                data["trials"].append(t)
    data["load"] = load_note(run)
    path = run.finish(data, args.out_dir)
    print(f"wrote {path} and {plot(data, args.name, args.out_dir)}")
    return data


if __name__ == "__main__":
    main()
