"""Speculative decoding, NGRAM (#33): output tok/s with and without, side by side in one run.

Two unified servers on SmolLM2-135M (the default model), one plain and one with
`--speculative-algorithm NGRAM` (its defaults, cost gate on), started once; rounds alternate
which goes first. Two workloads, each at concurrency 1 and 4:
- **repetitive**: code editing (rewrite a source file of this repository with one identifier
  renamed) and quoting summaries (repeat a paragraph of docs/, then summarize it), chat-templated,
  greedy, up to 192 tokens: outputs that copy much of their prompt;
- **random**: 256 random prompt token ids, 128 output tokens (ignore_eos), greedy, as `vllm
  bench serve`'s random dataset. SmolLM2 answers such prompts by falling into loops, which
  drafts predict well: this measures what a benchmark client sees, not the no-help case;
- **random sampled**: the same prompts sampled at temperature 1 (a seed per request): output
  that the context does not predict, the case where speculation must not cost.
The speculating server runs with `--speculative-ngram-capacity 0` by default (drafts from each
request's own context only): the same prompts come back every round and concurrency, and the
cross-request cache would draft them from the earlier answers, a speed-up that only repeated
traffic gets (`--ngram-capacity N` measures it).
Output tok/s = completion tokens / wall time of the batch; accept length and verify counts from
the speculating server's /get_load deltas. Greedy outputs of both servers are compared (equal
unless a near-tie flips).

Run: `python bench/spec.py [--rounds 2] [--requests 6]`; JSON + PNG in bench/results/spec.*.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Run,
    alternating,
    load_note,
    medians_and_speedup,
    speedup_bars,
    start_unified,
    timed_map,
)

NAME = "spec"
ROOT = Path(__file__).resolve().parent.parent
SOURCES = [("pdcore/engine/kv/blocks.py", "BlockManager", "PagePool"),
           ("pdcore/engine/kv/cache.py", "KVCache", "PagedKV"),
           ("pdcore/engine/sched/fork.py", "fork", "split"),
           ("pdcore/engine/model/rope.py", "make_rotary", "build_rope")]
SYSTEMS = ("plain", "ngram")


def _chat(tok: Any, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, tokenize=True)


def repetitive_prompts(tok: Any, n: int) -> list[list[int]]:
    out = []
    for path, old, new in SOURCES:
        code = (ROOT / path).read_text()[:1400]
        out.append(_chat(tok, f"Rewrite this Python code with `{old}` renamed to `{new}`. "
                              f"Output only the code.\n```python\n{code}\n```"))
    # the long paragraphs of the docs that were the README's (server, parallelism) before it
    # became a tour
    text = "\n\n".join((ROOT / "docs" / f).read_text() for f in ("server.md", "parallelism.md"))
    paras = [p for p in text.split("\n\n") if len(p) > 300]
    for p in paras[: max(0, n - len(out))]:
        out.append(_chat(tok, "Quote this paragraph exactly, then summarize it in one "
                              f"sentence.\n\n{p[:900]}"))
    return [p if isinstance(p, list) else list(p["input_ids"]) for p in out[:n]]


def random_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(256)] for _ in range(n)]


def _one(url: str, ids: list[int], new: int, ignore_eos: bool, temp: float) -> list[int]:
    seed = {"seed": sum(ids) % 1000} if temp else {}
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": new, "temperature": temp, "ignore_eos": ignore_eos, **seed}},
        timeout=900)
    r.raise_for_status()
    return r.json()["output_ids"]


def batch(url: str, prompts: list[list[int]], new: int, ignore_eos: bool, temp: float,
          conc: int) -> tuple[float, list[list[int]]]:
    return timed_map(lambda p: _one(url, p, new, ignore_eos, temp), prompts, conc)


def _spec_stats(url: str) -> dict[str, float]:
    s = httpx.get(url + "/get_load", timeout=30).json()[0]
    return {k: s.get(k, 0) for k in ("spec_verifies_total", "spec_draft_tokens_total",
                                     "spec_accepted_tokens_total", "spec_emitted_tokens_total",
                                     "spec_gated_steps_total", "spec_cost_ratio",
                                     "forward_decode_steps_total")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--ngram-capacity", type=int, default=0)
    a = ap.parse_args()
    run = Run(NAME, vars(a))
    from pdcore.config import ServerArgs
    from pdcore.engine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(ServerArgs())
    rnd = random_prompts(len(tok), a.requests)
    workloads = {"repetitive": (repetitive_prompts(tok, a.requests), 192, False, 0.0),
                 "random": (rnd, 128, True, 0.0), "random sampled": (rnd, 128, True, 1.0)}
    concs = [int(c) for c in a.concurrency.split(",")]
    servers = {"plain": start_unified(None, ("--max-running-requests", "8"), wait=False),
               "ngram": start_unified(None, ("--max-running-requests", "8",
                                             "--speculative-algorithm", "NGRAM",
                                             "--speculative-ngram-capacity",
                                             str(a.ngram_capacity)), wait=False)}
    rows: dict[str, dict[str, Any]] = {}
    try:
        for s in servers.values():
            s.wait_healthy(600)
        for w, (prompts, new, ign, temp) in workloads.items():  # warm both (first use)
            for s in servers.values():
                batch(s.url, prompts[:1], 8, ign, temp, 1)
        for rep in range(a.rounds):
            for w, (prompts, new, ign, temp) in workloads.items():
                for c in concs:
                    key = f"{w} c{c}"
                    row = rows.setdefault(key, {"tok_s": {k: [] for k in SYSTEMS},
                                                "identical": [], "spec": []})
                    outs = {}
                    for name in alternating(SYSTEMS, rep):
                        before = _spec_stats(servers[name].url)
                        wall, outs[name] = batch(servers[name].url, prompts, new, ign, temp,
                                                 c)
                        n = sum(len(o) for o in outs[name])
                        row["tok_s"][name].append(n / wall)
                        if name == "ngram":
                            after = _spec_stats(servers[name].url)
                            row["spec"].append({k: after[k] - before[k] if k != "spec_cost_ratio"
                                                else after[k] for k in after})
                    row["identical"].append(sum(x == y for x, y in zip(outs["plain"],
                                                                        outs["ngram"])))
                    print(f"round {rep} {key}: plain {row['tok_s']['plain'][-1]:.1f} tok/s, "
                          f"ngram {row['tok_s']['ngram'][-1]:.1f} tok/s "
                          f"({row['tok_s']['ngram'][-1] / row['tok_s']['plain'][-1]:.2f}x), "
                          f"spec {row['spec'][-1]}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    medians_and_speedup(rows, "plain", "ngram")
    for row in rows.values():
        sp = row["spec"]
        ver = sum(x["spec_verifies_total"] for x in sp)
        row["accept_length"] = (sum(x["spec_emitted_tokens_total"] for x in sp) / ver
                                if ver else 0.0)
        prop = sum(x["spec_draft_tokens_total"] for x in sp)
        row["accept_rate"] = sum(x["spec_accepted_tokens_total"] for x in sp) / prop if prop \
            else 0.0
    data = {"rows": rows, "requests": a.requests, "note": load_note(run)}
    path = run.finish(data)
    plot(rows)
    for key, row in rows.items():
        print(f"{key}: {row['speedup']:.2f}x, accept length {row['accept_length']:.2f}, "
              f"accept rate {row['accept_rate']:.2f}, identical {row['identical']}")
    print(path)


def plot(rows: dict[str, dict[str, Any]]) -> None:
    speedup_bars(rows, "plain", "ngram", "SmolLM2-135M, NGRAM speculative decoding vs plain",
                 NAME, note=lambda row: f"\nacc {row['accept_length']:.1f}")


if __name__ == "__main__":
    main()
