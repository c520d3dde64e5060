"""Decode speed of each native-kernel ISA side by side (pdcore/engine/native, PDCORE_NATIVE_ISA).

One engine process per setting (avx512, avx2, off: the native library is chosen once per
process; avx2/avx2 and off/avx2 with PDCORE_CPU_ISA=avx2 too, torch's and oneDNN's kernels
capped at AVX2: an AVX2-only CPU such as AMD Zen 2, after and before), all loaded at once (SmolLM2 by default, one torch thread each), then measured in turns
(A, B, C, then C, B, A, ...), so the shared machine's load drifts over all of them alike:
- engine step: end-to-end decode steps of B prompts through the engine (scheduler, packing,
  model, sampling): (T(1 + N new tokens) - T(1 new token)) / N, this process's CPU time;
- forward: the model's decode forward alone, N steps of B sequences from ctx tokens (the decode
  K/V view filled on the first step, appended after), as bench/step_vs_gemm.py times it.
Medians over --iters; tokens/s = B / step (one core). Written to bench/results/native_isa.json.

Run: `python bench/native_isa.py [--batch 8] [--ctx 256] [--isas avx512,avx2,off]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAME = "native_isa"


def child(args: argparse.Namespace) -> None:
    """One engine; per line on stdin, one measurement as a JSON line on stdout."""
    import torch
    from engine_throughput import PdserveRunner, make_prompts
    from step_vs_gemm import decode_steps, timed

    from pdcore.engine import native

    torch.set_num_threads(1)
    tokens = args.batch * (max(args.ctx, args.prompt_len) + args.new_tokens + 8)
    pd = PdserveRunner(args.model_path, tokens, "float32")
    model, kv = pd.engine.engine.model, pd.engine.engine.kv
    batches = decode_steps(args.batch, args.ctx, args.new_tokens, pd.vocab, True)

    @torch.inference_mode()
    def forward() -> None:
        for b in batches:
            model(b, kv.layers)

    prompts = make_prompts(args.batch, args.prompt_len, pd.vocab, 1)
    forward()
    pd.generate(prompts, 2)
    from pdcore.engine.model.layers import weight_layouts

    print(json.dumps({"ready": native.status(), "layouts": weight_layouts(model)}), flush=True)
    for _ in sys.stdin:
        fwd = timed(forward) / args.new_tokens
        t1 = timed(lambda: pd.generate(prompts, 1))
        tn = timed(lambda: pd.generate(prompts, args.new_tokens + 1))
        print(json.dumps({"forward_ms": fwd, "engine_step_ms": (tn - t1) / args.new_tokens,
                          "native_steps": int(getattr(model, "native_steps", 0))}), flush=True)
    pd.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--isas", default="avx512,avx2,off,avx2/avx2,off/avx2",
                    help="settings: NATIVE_ISA or NATIVE_ISA/CPU_ISA (PDCORE_CPU_ISA: torch's "
                         "and oneDNN's kernels capped too, as on an AVX2-only CPU)")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return {}
    from common import Run, alternating, load_note

    run = Run(NAME, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    isas = args.isas.split(",")
    flags = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--child"]
    procs = {}
    for isa in isas:  # one at a time: each builds or loads its library and the model
        nat, _, cpu = isa.partition("/")
        env = {**os.environ, "PDCORE_NATIVE_ISA": nat, "PDCORE_CPU_ISA": cpu}
        p = subprocess.Popen([sys.executable, __file__, *flags, "--child"], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        ready = json.loads(p.stdout.readline())
        procs[isa] = (p, ready["ready"], ready["layouts"])
        print(f"{isa}: {ready['ready']}, GEMM weights {ready['layouts']}", flush=True)
    raw: dict[str, list[dict[str, float]]] = {isa: [] for isa in isas}
    try:
        for rep in range(args.iters):
            for isa in alternating(isas, rep):
                p = procs[isa][0]
                p.stdin.write("go\n")
                p.stdin.flush()
                raw[isa].append(json.loads(p.stdout.readline()))
    finally:
        for p, *_ in procs.values():
            p.stdin.close()
            p.wait(60)
    out: dict[str, Any] = {}
    for isa in isas:
        step = statistics.median(r["engine_step_ms"] for r in raw[isa])
        fwd = statistics.median(r["forward_ms"] for r in raw[isa])
        out[isa] = {"status": procs[isa][1], "gemm_weights": procs[isa][2],
                    "engine_step_ms": step, "forward_ms": fwd,
                    "tokens_per_s": args.batch * 1000 / step,
                    "native_steps": raw[isa][-1]["native_steps"], "raw": raw[isa]}
    base = out["off"]["engine_step_ms"] if "off" in out else out[isas[-1]]["engine_step_ms"]
    path = run.finish({"results": out}, args.out_dir)
    print(f"batch {args.batch}, ctx {args.ctx}, float32, 1 thread each, CPU time, "
          f"{load_note(run)}")
    for isa in isas:
        r = out[isa]
        print(f"  {isa:10s} {r['status'][:18]:18s} step {r['engine_step_ms']:7.2f} ms "
              f"({r['tokens_per_s']:6.1f} tok/s, {base / r['engine_step_ms']:.2f}x off)"
              f"  forward {r['forward_ms']:7.2f} ms")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
