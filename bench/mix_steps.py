"""What a step of the ShareGPT-like mix (bench/workload.py) at concurrency c costs, by kind, and
what each request's TPOT is made of (#47: at c32 our step loses its c8 lead).

1. LLMEngine in this process, `--max-running-requests c`, every request queued at once: the
   queue admits one as one finishes, as c closed-loop streams do (without HTTP and client);
2. every forward recorded: its decode rows (one-token items), prefill tokens and chunks, wall
   time, and whether the native decode loop ran it (it needs a decode-only step);
3. each request's token times, so its TPOT ((last - first) / (tokens - 1), as bench/serving.py
   computes it) and the share of that span spent in steps that carried a prefill chunk;
4. per kind (decode-only, mixed, prefill-only): steps, time, mean cost; mixed steps at nearly
   full batch fitted as a + b x prefill tokens, against the decode-only median there (a minus
   that median: what a step pays for carrying a chunk beyond the chunk's own tokens);
5. bench/results/<name>.json and .png (step cost vs decode rows and vs prefill tokens).

Run: `python bench/mix_steps.py [--concurrency 32] [--requests 128] [--chunk 2048] [--quick]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, percentile, save_figure
from workload import QUICK, Shape, length_stats, requests

NAME = "mix_steps"


class Recorder:
    """Wraps the engine's StepLoop.run: one record per forward, token times per request."""

    def __init__(self, loop: Any) -> None:
        self.loop, self.steps, self.tokens = loop, [], {}
        self.model = loop.runner.model
        self._run = loop.run
        loop.run = self.run

    def run(self, items: list[tuple[Any, int]]) -> Any:
        native0 = getattr(self.model, "native_steps", 0)
        t0 = time.perf_counter()
        results = self._run(items)
        t1 = time.perf_counter()
        dec = [r for r, n in items if n == 1]
        self.steps.append({
            "t0": t0, "t1": t1, "decode_rows": len(dec),
            "prefill_tokens": sum(n for _, n in items if n > 1),
            "prefill_chunks": sum(1 for _, n in items if n > 1),
            "decode_ctx": statistics.mean(r.num_computed for r in dec) if dec else 0.0,
            "native": getattr(self.model, "native_steps", 0) - native0})
        for res in results:
            if res.token is not None:
                self.tokens.setdefault(res.req.rid, []).append((t1, len(self.steps) - 1))
        return results


def kind(s: dict[str, Any]) -> str:
    if not s["prefill_tokens"]:
        return "decode"
    return "mixed" if s["decode_rows"] else "prefill"


def fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares y = a + b x; None with fewer than 3 points or no spread in x."""
    if len(xs) < 3 or max(xs) == min(xs):
        return None
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def summarize(steps: list[dict[str, Any]], tokens: dict[str, list[tuple[float, int]]],
              c: int) -> dict[str, Any]:
    out: dict[str, Any] = {"kinds": {}}
    total = sum(s["t1"] - s["t0"] for s in steps) or 1e-9
    for k in ("decode", "mixed", "prefill"):
        g = [s for s in steps if kind(s) == k]
        t = [s["t1"] - s["t0"] for s in g]
        out["kinds"][k] = {
            "steps": len(g), "seconds": sum(t), "share": sum(t) / total,
            "mean_ms": statistics.mean(t) * 1e3 if t else None,
            "mean_decode_rows": statistics.mean(s["decode_rows"] for s in g) if g else None,
            "mean_prefill_tokens": statistics.mean(s["prefill_tokens"] for s in g) if g else None,
            "native_steps": sum(s["native"] for s in g)}
    with_dec = [s for s in steps if s["decode_rows"]]
    out["decode_steps_with_chunk"] = (sum(1 for s in with_dec if s["prefill_tokens"])
                                      / len(with_dec) if with_dec else 0.0)
    full = max(2, c - 2)  # nearly full batch: what the steady state runs
    dec_full = [s["t1"] - s["t0"] for s in steps if kind(s) == "decode" and s["decode_rows"] >= full]
    mixed_full = [s for s in steps if kind(s) == "mixed" and s["decode_rows"] >= full]
    line = fit([s["prefill_tokens"] for s in mixed_full], [s["t1"] - s["t0"] for s in mixed_full])
    out["full_batch"] = {
        "decode_rows_at_least": full,
        "decode_only_median_ms": statistics.median(dec_full) * 1e3 if dec_full else None,
        "mixed_steps": len(mixed_full),
        "mixed_fit_ms": None if line is None else {"a": line[0] * 1e3, "per_token": line[1] * 1e3},
        "mixed_extra_ms": None if line is None or not dec_full
        else (line[0] - statistics.median(dec_full)) * 1e3}
    per_req = []
    for rid, tt in tokens.items():
        if len(tt) < 2:
            continue
        span = tt[-1][0] - tt[0][0]
        idx = range(tt[0][1] + 1, tt[-1][1] + 1)  # the steps between its first and last token
        in_chunks = sum(steps[i]["t1"] - steps[i]["t0"] for i in idx if steps[i]["prefill_tokens"])
        per_req.append({"tokens": len(tt), "tpot_ms": span / (len(tt) - 1) * 1e3,
                        "chunk_share": in_chunks / span if span else 0.0})
    tp = [r["tpot_ms"] for r in per_req]
    out["tpot_ms"] = {"p50": percentile(tp, 50), "p99": percentile(tp, 99)} if tp else {}
    worst = sorted(per_req, key=lambda r: -r["tpot_ms"])[: max(1, len(per_req) // 50)]
    out["worst_requests"] = worst  # the p98+ requests: their length and share of chunk steps
    out["chunk_share_all"] = statistics.mean(r["chunk_share"] for r in per_req) if per_req else 0
    return out


def plot(steps: list[dict[str, Any]], data: dict[str, Any], name: str, out_dir: Path | None
         ) -> Path:
    fig, axes = figure(2, 5.0, 4.0)
    for k, color in (("decode", "tab:blue"), ("mixed", "tab:orange"), ("prefill", "tab:green")):
        g = [s for s in steps if kind(s) == k]
        axes[0].scatter([s["decode_rows"] for s in g], [(s["t1"] - s["t0"]) * 1e3 for s in g],
                        s=6, color=color, label=k)
        if k == "mixed":
            axes[1].scatter([s["prefill_tokens"] for s in g],
                            [(s["t1"] - s["t0"]) * 1e3 for s in g], s=6, color=color, label=k)
    ref = data["summary"]["full_batch"]["decode_only_median_ms"]
    if ref:
        axes[1].axhline(ref, color="tab:blue", ls="--", label="decode-only, full batch")
    axes[0].set(xlabel="decode rows", ylabel="step ms", yscale="log", title="step cost")
    axes[1].set(xlabel="prefill tokens (mixed steps)", ylabel="step ms",
                title="mixed steps vs decode-only")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"{name}: c={data['config']['concurrency']}; {data['load']}", fontsize=9)
    return save_figure(fig, name, out_dir)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="default: SmolLM2")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=None, help="default: 4 x concurrency")
    ap.add_argument("--chunk", type=int, default=None, help="--chunked-prefill-size")
    ap.add_argument("--seed", type=int, default=0, help="requests drawn with seed + c")
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="c=4, 8 requests, 1/8 the lengths")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests = 4, args.requests or 8
    args.requests = args.requests or 4 * args.concurrency
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    shape = QUICK if args.quick else Shape()
    run = Run(args.name, {**{k: str(v) if isinstance(v, Path) else v
                             for k, v in vars(args).items()}, "shape": shape.as_dict()})
    extra = {} if args.chunk is None else {"chunked_prefill_size": args.chunk}
    engine = LLMEngine(ServerArgs(model_path=args.model_path, log_level="warning",
                                  max_running_requests=args.concurrency, **extra))
    try:
        voc = int(engine.engine.hf_config.vocab_size)
        rec = Recorder(engine.loop)

        def params(n: int) -> SamplingParams:
            return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

        warm = requests(2, voc, args.seed + 99, shape)
        engine.generate([r.prompt for r in warm], [params(r.max_tokens) for r in warm])
        rec.steps.clear()
        rec.tokens.clear()
        reqs = requests(args.requests, voc, args.seed + args.concurrency, shape)
        t0 = time.perf_counter()
        outs = engine.generate([r.prompt for r in reqs], [params(r.max_tokens) for r in reqs])
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    produced = sum(len(o["output_ids"]) for o in outs)
    data: dict[str, Any] = {
        "lengths": length_stats(reqs), "wall_s": wall, "output_tokens": produced,
        "requested_tokens": sum(r.max_tokens for r in reqs), "tokens_recorded":
        sum(len(t) for t in rec.tokens.values()),
        "output_tok_s": produced / wall, "summary": summarize(rec.steps, rec.tokens,
                                                             args.concurrency),
        "steps": [{k: v for k, v in s.items()} for s in rec.steps]}
    data["config"] = run.config
    data["load"] = load_note(run)
    sm = data["summary"]
    print(f"c={args.concurrency} {args.requests} requests: {data['output_tok_s']:.1f} tok/s, "
          f"{len(rec.steps)} steps; decode steps carrying a chunk "
          f"{sm['decode_steps_with_chunk']:.0%}; in-process TPOT p50/p99 "
          f"{sm['tpot_ms'].get('p50', float('nan')):.0f}/{sm['tpot_ms'].get('p99', float('nan')):.0f}"
          f" ms", flush=True)
    for k, v in sm["kinds"].items():
        if v["steps"]:
            print(f"  {k:8s} {v['steps']:5d} steps {v['seconds']:6.1f} s ({v['share']:.0%}) "
                  f"mean {v['mean_ms']:6.1f} ms  rows {v['mean_decode_rows']:5.1f}  prefill "
                  f"{v['mean_prefill_tokens']:6.1f}  native {v['native_steps']}")
    print(f"  full batch: {sm['full_batch']}")
    path = run.finish(data, args.out_dir)
    print(f"{data['load']}; wrote {path} and {plot(rec.steps, data, args.name, args.out_dir)}")
    return data


if __name__ == "__main__":
    main()
