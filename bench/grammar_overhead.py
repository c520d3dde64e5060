"""What structured output costs per decode step (#32: <= 10% of TPOT at batch 8, JSON schema).

Two measurements in one run, on SmolLM2-135M (the default model) and this CPU:
1. **Served, side by side**: one unified server; rounds alternate a batch of 8 concurrent
   streamed requests under a JSON schema (a list of records: long outputs) with a batch of 8
   unconstrained requests of the same lengths (ignore_eos, max_new_tokens = the constrained
   answer's length). TPOT per request = (end - first token) / (tokens - 1); the ratio of the
   medians is the overhead as a client sees it.
2. **The sampler alone**: `sample()` on [8, vocab] logits with 8 matchers (mask fill + one
   bitmask application) against 8 plain greedy rows, the extra milliseconds per step divided
   by the served TPOT: the part of the step the grammar adds, free of server noise.

Run: `python bench/grammar_overhead.py [--rounds 3] [--batch 8]`; JSON + PNG in
bench/results/grammar_overhead.*.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure, start_unified, summary

NAME = "grammar_overhead"
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 6, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "price": {"type": "integer", "minimum": 0, "maximum": 9999},
        "in_stock": {"type": "boolean"}},
    "required": ["name", "price", "in_stock"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
PROMPTS = [f"List {k + 6} products of a {shop} shop as JSON." for k, shop in enumerate(
    ["hardware", "book", "toy", "food", "garden", "music", "sports", "pet", "shoe", "tea"])]


def _stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    first, n, last = None, 0, t0
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True},
                      timeout=600) as r:
        r.raise_for_status()
        prev = 0
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            out = json.loads(line[5:])
            got = len(out.get("output_ids") or [])
            if got > prev:
                now = time.monotonic()
                first = first if first is not None else now
                last, prev = now, got
                n = got
    tpot = (last - first) / (n - 1) if first is not None and n > 1 else float("nan")
    return {"tokens": n, "ttft_s": (first or last) - t0, "tpot_ms": tpot * 1e3}


def _batch(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: _stream(url, b), bodies))


def served(url: str, batch: int, rounds: int) -> dict[str, Any]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    out: dict[str, list[float]] = {"json_schema": [], "plain": []}
    lengths: list[int] = []
    for rnd in range(rounds):
        constrained = [{"text": p, "sampling_params": {
            "temperature": 0, "max_new_tokens": 400, "json_schema": json.dumps(SCHEMA)}}
            for p in prompts]
        order = ["json_schema", "plain"] if rnd % 2 == 0 else ["plain", "json_schema"]
        res: dict[str, list[dict[str, Any]]] = {}
        if order[0] == "plain" and not lengths:
            order = ["json_schema", "plain"]
        for kind in order:
            if kind == "json_schema":
                res[kind] = _batch(url, constrained)
                lengths = [r["tokens"] for r in res[kind]]
            else:
                res[kind] = _batch(url, [{"text": p, "sampling_params": {
                    "temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
                    for p, n in zip(prompts, lengths)])
        for kind, rs in res.items():
            out[kind].extend(r["tpot_ms"] for r in rs)
        print(f"round {rnd}: " + ", ".join(
            f"{k} TPOT median {statistics.median(r['tpot_ms'] for r in v):.1f} ms"
            for k, v in res.items()), flush=True)
    return {"tpot_ms": {k: summary(v) for k, v in out.items()}, "tokens": lengths,
            "ratio_median": statistics.median(out["json_schema"]) / statistics.median(
                out["plain"])}


def sampler_alone(batch: int, steps: int) -> dict[str, Any]:
    """ms per step of sample() for `batch` constrained rows against `batch` greedy rows."""
    import torch

    from pdcore.messages.io import GrammarSpec, SamplingParams
    from pdcore.engine.model.tokenizer import default_model_file, load_tokenizer
    from pdcore.constrained.backend import GrammarBackend
    from pdcore.engine.sched.sampler import SampleState, sample

    tok = load_tokenizer(argparse.Namespace(model_path=default_model_file()))
    vocab = len(tok)
    backend = GrammarBackend("xgrammar", lambda: tok, vocab, [tok.eos_token_id])
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    text = json.dumps({"items": [{"name": f"thing{k}", "price": 10 * k, "in_stock": k % 2 == 0}
                                 for k in range(12)]}, separators=(", ", ": "))
    path = tok.encode(text, add_special_tokens=False)[:steps]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    backend.constraint(spec)  # compile (cached) and warm up
    times: dict[str, list[float]] = {"json_schema": [], "plain": []}
    for kind in ("plain", "json_schema", "plain", "json_schema"):
        states = [SampleState.create(SamplingParams(
            temperature=0.0, grammar=spec if kind == "json_schema" else None), [1])
            for _ in range(batch)]
        for tok_id in path:
            # force the text's own token so every matcher walks a long valid path
            row = logits.clone()
            row[:, tok_id] = 1e4
            t = time.perf_counter()
            toks, _, errs = sample(row, states, [None] * batch, backend)
            times[kind].append((time.perf_counter() - t) * 1e3)
            assert errs == [None] * batch and toks == [tok_id] * batch, (errs, toks, tok_id)
    return {"ms_per_step": {k: summary(v) for k, v in times.items()}, "steps": len(path),
            "added_ms": statistics.median(times["json_schema"]) - statistics.median(
                times["plain"])}


def plot(data: dict[str, Any]) -> None:
    fig, (a, b) = figure(2)
    t = data["served"]["tpot_ms"]
    kinds = ["plain", "json_schema"]
    a.bar(kinds, [t[k]["p50"] for k in kinds], color=["#888", "#3a7"])
    a.set_ylabel("TPOT median (ms)")
    a.set_title(f"served, batch {data['config']['batch']}: "
                f"{data['served']['ratio_median']:.3f}x")
    s = data["sampler"]["ms_per_step"]
    b.bar(kinds, [s[k]["p50"] for k in kinds], color=["#888", "#3a7"])
    b.set_ylabel("sample() ms per step (median)")
    b.set_title(f"sampler alone: +{data['sampler']['added_ms']:.2f} ms "
                f"= {100 * data['sampler_share_of_tpot']:.1f}% of TPOT")
    save_figure(fig, NAME)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--model-path", default=None)
    a = ap.parse_args()
    run = Run(NAME, vars(a))
    sampler = sampler_alone(a.batch, 120)
    print(f"sampler alone: {sampler['added_ms']:.3f} ms added per step", flush=True)
    server = start_unified(a.model_path, ("--max-running-requests", str(a.batch)))
    try:
        serve = served(server.url, a.batch, a.rounds)
    finally:
        server.stop()
    plain = serve["tpot_ms"]["plain"]["p50"]
    data = {"served": serve, "sampler": sampler,
            "sampler_share_of_tpot": sampler["added_ms"] / plain, "note": load_note(run)}
    path = run.finish(data)
    data["config"] = run.config
    plot(data)
    print(f"served: json_schema/plain TPOT {serve['ratio_median']:.3f}x; sampler adds "
          f"{sampler['added_ms']:.2f} ms = {100 * data['sampler_share_of_tpot']:.1f}% of the "
          f"{plain:.1f} ms TPOT; {path}")


if __name__ == "__main__":
    main()
