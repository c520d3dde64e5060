"""Many streams: the ShareGPT-like mix (bench/workload.py: log-normal prompt and output lengths,
fixed seed) at concurrency 1 to 64 against pdserve unified and 1P1D (`pdserve up`), and vLLM
unified / 1P1D where --vllm-python names a Python with vLLM (bench/vllm_launch.py starts them
as bench/vs_vllm.py does); output tok/s, TTFT and TPOT p50 / p99 per concurrency.

`--variants` runs pdserve unified once per scheduler setting (e.g. `chunk512:
--chunked-prefill-size 512`), at every concurrency: what the scheduler's batch and chunk
defaults are chosen from.

One system at a time (started, warmed up, measured at every concurrency, stopped), so no
system shares the cores with another. Each concurrency level c sends max(--min-requests,
--requests-per-stream x c) requests drawn with seed --seed + c (the same requests for every
system; no level finds its prompts in a prefix cache an earlier level filled). The load average is recorded before and after each level:
on a shared machine, numbers under load are not the system's, and no ratio to vLLM taken under
load means anything.

Writes bench/results/many_streams.json and .png (`--name`). `--quick`: levels 1, 4, 16 of a
mix scaled to 1/8 the lengths, few requests, pdserve unified only unless --systems says more.

Run: `python bench/many_streams.py [--quick] [--systems pdserve-unified pdserve-1p1d]
[--variants 'chunk512:--chunked-prefill-size 512' ...] [--vllm-python PATH]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure
from serving import latency_stats
from vllm_launch import Group, Proc, free_port, start_system
from workload import QUICK, Shape, closed_loop, length_stats, requests

NAME = "many_streams"
PDSERVE = ("pdserve-unified", "pdserve-1p1d")
VLLM = ("vllm-unified", "vllm-1p1d")


def start(system: str, args: argparse.Namespace, flags: list[str]) -> Group:
    """pdserve's systems with extra `pdserve serve` flags (`up` passes them to every server);
    vLLM's through vllm_launch."""
    if system in VLLM:
        # the mix's longest request (2048 in + 512 out by default) must fit vLLM's window
        return start_system(system, args.model_path, args.dtype, args.vllm_python,
                            args.vllm_bind, args.vllm_kv_gib,
                            max_model_len=args.vllm_max_model_len)
    py, port = sys.executable, free_port()
    model = ["--model-path", args.model_path] if args.model_path else []
    model += ["--dtype", args.dtype]
    g = Group()
    if system == "pdserve-unified":
        g.add(Proc([py, "-m", "pdcore", "serve", "--host", "127.0.0.1", "--port", str(port),
                    *model, *flags], f"http://127.0.0.1:{port}", name="pdserve"))
    elif system == "pdserve-1p1d":
        g.add(Proc([py, "-m", "pdcore", "up", "--port", str(port), "--server-port-base",
                    str(free_port()), "--bootstrap-port-base", str(free_port()), *model,
                    *flags], f"http://127.0.0.1:{port}", name="pdserve-up"))
    else:
        raise ValueError(f"unknown system {system!r}")
    return g


def vocab(model_path: str | None) -> int:
    from pdcore.engine.model.loader import load_config
    from pdcore.engine.model.tokenizer import resolve_model

    return int(load_config(resolve_model(model_path)).vocab_size)


def level_stats(results: list[Any], wall: float) -> dict[str, Any]:
    st = latency_stats(results)
    st["output_tok_s"] = st["output_tokens"] / wall if wall else 0.0
    st["wall_s"] = wall
    st["request_s"] = (st["requests"] - st["errors"]) / wall if wall else 0.0
    return st


def measure(system: str, flags: list[str], args: argparse.Namespace, shape: Shape,
            voc: int) -> dict[str, Any]:
    out: dict[str, Any] = {"flags": flags, "levels": {}}
    group = start(system, args, flags)
    try:
        out["startup_s"] = group.wait_ready(args.startup_timeout)
        warm = requests(4, voc, args.seed + 99, shape)
        asyncio.run(closed_loop(group.url, warm, 2, args.timeout))
        for c in args.concurrency:
            n = max(args.min_requests, args.requests_per_stream * c)
            # each level its own requests (the same for every system): the levels run on one
            # server, and a repeated prompt would be answered from the prefix cache
            reqs = requests(n, voc, args.seed + c, shape)
            load0 = os.getloadavg()
            results, wall = asyncio.run(closed_loop(group.url, reqs, c, args.timeout,
                                                    args.sampling))
            st = level_stats(results, wall)
            st["loadavg_before"], st["loadavg_after"] = list(load0), list(os.getloadavg())
            out["levels"][str(c)] = st
            print(f"  {system} {' '.join(flags)} c={c:<3d} {st['output_tok_s']:7.1f} tok/s  "
                  f"TTFT p50/p99 {st['ttft_s'].get('p50', float('nan')):.2f}/"
                  f"{st['ttft_s'].get('p99', float('nan')):.2f} s  TPOT p50/p99 "
                  f"{st['tpot_s'].get('p50', float('nan')) * 1e3:.0f}/"
                  f"{st['tpot_s'].get('p99', float('nan')) * 1e3:.0f} ms  errors {st['errors']}"
                  f"  load {load0[0]:.1f}", flush=True)
    except RuntimeError as e:  # one system failing to start must not cost the others
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"  {system}: {out['error']}", flush=True)
    finally:
        out["logs"] = group.logs()
        group.stop()
    return out


def plot(data: dict[str, Any], name: str, out_dir: Path | None) -> Path:
    fig, axes = figure(3, 4.8, 4.0)
    for label, res in data["systems"].items():
        lv = res.get("levels") or {}
        cs = sorted(int(c) for c in lv)
        if not cs:
            continue
        axes[0].plot(cs, [lv[str(c)]["output_tok_s"] for c in cs], marker="o", label=label)
        for ax, key in ((axes[1], "ttft_s"), (axes[2], "tpot_s")):
            scale = 1e3 if key == "tpot_s" else 1.0
            ax.plot(cs, [lv[str(c)][key].get("p99", float("nan")) * scale for c in cs],
                    marker="o", label=f"{label} p99")
            ax.plot(cs, [lv[str(c)][key].get("p50", float("nan")) * scale for c in cs], "--",
                    marker=".", label=f"{label} p50")
    axes[0].set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title="throughput")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="s", title="TTFT")
    axes[2].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="TPOT")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.suptitle(f"ShareGPT-like mix; {data['load']}", fontsize=9)
    return save_figure(fig, name, out_dir)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="+", default=list(PDSERVE), choices=[*PDSERVE, *VLLM])
    ap.add_argument("--variants", nargs="*", default=[],
                    help="'label:<pdserve serve flags>': pdserve unified once per variant")
    ap.add_argument("--server-flag", action="append", default=[],
                    help="a flag for every pdserve system (repeat)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=16)
    system_args(ap, NAME)
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests_per_stream, args.min_requests = [1, 4, 16], 1, 4
        if args.systems == list(PDSERVE):
            args.systems = ["pdserve-unified"]
    if any(s in VLLM for s in args.systems) and not args.vllm_python:
        ap.error("vLLM systems need --vllm-python (a Python with vllm installed)")
    return args


def system_args(ap: argparse.ArgumentParser, name: str) -> None:
    """The flags every serving bench of the mix shares: model, vLLM, seed, limits, output."""
    ap.add_argument("--model-path", default=None, help="default: SmolLM2 (vLLM: an HF folder)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="every system's weights and activations (pdserve and vLLM alike)")
    ap.add_argument("--sampling", choices=("default", "greedy"), default="default",
                    help="default: no temperature sent (the server's 1.0, what most clients "
                    "get); greedy: temperature 0")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    ap.add_argument("--vllm-bind", default="0-1")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument("--vllm-max-model-len", type=int, default=4096,
                    help="vLLM's --max-model-len: at least the mix's longest prompt + output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--name", default=name)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")


def versus_vllm(systems: dict[str, Any]) -> dict[str, Any]:
    """Issue #47's mix ratios per concurrency both unified systems ran: pdserve / vLLM output
    tok/s (>= 1.3 at c32) and p99 TPOT (<= 1)."""
    ours = (systems.get("pdserve-unified") or {}).get("levels") or {}
    theirs = (systems.get("vllm-unified") or {}).get("levels") or {}
    out = {}
    for c in sorted(set(ours) & set(theirs), key=int):
        a, b = ours[c], theirs[c]
        ta, tb = a["tpot_s"].get("p99"), b["tpot_s"].get("p99")
        out[c] = {"tok_s": [a["output_tok_s"], b["output_tok_s"]],
                  "tok_s_ratio": a["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"]
                  else float("nan"), "p99_tpot_s": [ta, tb],
                  "p99_tpot_ratio": ta / tb if ta and tb else float("nan")}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    shape = QUICK if args.quick else Shape()
    voc = vocab(args.model_path)
    run = Run(args.name, {**{k: str(v) if isinstance(v, Path) else v
                             for k, v in vars(args).items()}, "shape": shape.as_dict()})
    data: dict[str, Any] = {"shape": shape.as_dict(), "systems": {},
                            "lengths": length_stats(requests(
                                max(args.min_requests, args.requests_per_stream
                                    * max(args.concurrency)), voc,
                                args.seed + max(args.concurrency), shape))}
    runs = [(s, s, list(args.server_flag) if s in PDSERVE else []) for s in args.systems]
    for v in args.variants:
        label, _, flags = v.partition(":")
        runs.append((f"pdserve-unified[{label}]", "pdserve-unified",
                     [*args.server_flag, *shlex.split(flags)]))
    for label, system, flags in runs:
        print(f"{label}:", flush=True)
        data["systems"][label] = measure(system, flags, args, shape, voc)
    data["vs_vllm"] = versus_vllm(data["systems"])
    for c, v in data["vs_vllm"].items():
        print(f"c={c}: pdserve / vLLM unified tok/s {v['tok_s_ratio']:.2f}x (target >= 1.3), "
              f"p99 TPOT {v['p99_tpot_ratio']:.2f}x (target <= 1)", flush=True)
    data["load"] = load_note(run)
    path = run.finish(data, args.out_dir)
    print(f"{data['load']}; wrote {path} and {plot(data, args.name, args.out_dir)}")
    return data


if __name__ == "__main__":
    main()
