"""Jump-forward for structured output (#32): output tok/s of JSON-schema requests with and
without the grammar's forced tokens as verified drafts, side by side in one run.

Two unified servers on SmolLM2-135M (the default model), started once: one with
PDSERVE_JUMP_FORWARD=0 (one token per step), one with its default (jump-forward on); no
--speculative-algorithm on either, so the only drafts are what the grammar forces. Requests: chat
prompts asking for records under two schemas, one with short keys and one with long ones (forced
text is what the grammar spells: keys, punctuation, enum tails), greedy, compact JSON
(--constrained-json-disable-any-whitespace), at concurrency 1 and 4; rounds alternate which
server goes first. Greedy outputs of both servers are compared (verification keeps them equal
unless a near-tie flips).

Run: `python bench/jump_forward.py [--rounds 2]`; JSON + PNG in bench/results/jump_forward.*.
"""

from __future__ import annotations

import argparse
import json
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

NAME = "jump_forward"
SYSTEMS = ("plain", "jump_forward")


def _records(props: dict[str, Any]) -> dict[str, Any]:
    item = {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}
    return {"type": "object", "properties": {"records": {
        "type": "array", "minItems": 3, "maxItems": 3, "items": item}},
        "required": ["records"], "additionalProperties": False}


SCHEMAS = {
    "short keys": _records({"name": {"type": "string", "maxLength": 12},
                            "price": {"type": "integer", "minimum": 0, "maximum": 9999},
                            "ok": {"type": "boolean"}}),
    "long keys": _records({"customer_display_name": {"type": "string", "maxLength": 12},
                           "shipping_priority_level": {"enum": ["standard", "express"]},
                           "requires_signature_on_delivery": {"type": "boolean"},
                           "loyalty_program_tier": {"enum": ["bronze", "silver", "gold"]}}),
}
TOPICS = ["a hardware shop", "a bakery", "a bike repair shop", "a tea house", "a bookshop",
          "a florist"]


def _one(url: str, text: str, schema: dict[str, Any]) -> list[int]:
    r = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": f"Three records for {text}, as JSON."}],
        "temperature": 0, "max_tokens": 400,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "r", "schema": schema, "strict": True}},
        "logprobs": True}, timeout=900)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    json.loads(choice["message"]["content"])  # a valid document, or the bench stops
    return [t["token"] for t in choice["logprobs"]["content"]]


def batch(url: str, schema: dict[str, Any], conc: int) -> tuple[float, list[list[int]]]:
    return timed_map(lambda t: _one(url, t, schema), TOPICS, conc)


def _jf_tokens(url: str) -> int:
    return httpx.get(url + "/get_load", timeout=30).json()[0].get(
        "spec_jump_forward_tokens_total", 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4")
    a = ap.parse_args()
    run = Run(NAME, vars(a))
    flags = ("--max-running-requests", "8", "--constrained-json-disable-any-whitespace")
    servers = {"plain": start_unified(None, flags, wait=False,
                                      env={"PDSERVE_JUMP_FORWARD": "0"}),
               "jump_forward": start_unified(None, flags, wait=False)}
    rows: dict[str, dict[str, Any]] = {}
    try:
        for s in servers.values():
            s.wait_healthy(600)
        for schema in SCHEMAS.values():  # compile each schema on both servers first
            for s in servers.values():
                _one(s.url, TOPICS[0], schema)
        for rep in range(a.rounds):
            for w, schema in SCHEMAS.items():
                for c in (int(x) for x in a.concurrency.split(",")):
                    key = f"{w} c{c}"
                    row = rows.setdefault(key, {"tok_s": {k: [] for k in SYSTEMS},
                                                "identical": [], "jump_tokens": []})
                    outs = {}
                    for name in alternating(SYSTEMS, rep):
                        before = _jf_tokens(servers[name].url)
                        wall, outs[name] = batch(servers[name].url, schema, c)
                        row["tok_s"][name].append(sum(len(o) for o in outs[name]) / wall)
                        if name == "jump_forward":
                            row["jump_tokens"].append(_jf_tokens(servers[name].url) - before)
                    row["identical"].append(sum(x == y for x, y in zip(outs["plain"],
                                                                        outs["jump_forward"])))
                    t = row["tok_s"]
                    print(f"round {rep} {key}: plain {t['plain'][-1]:.1f} tok/s, jump-forward "
                          f"{t['jump_forward'][-1]:.1f} tok/s "
                          f"({t['jump_forward'][-1] / t['plain'][-1]:.2f}x), jump tokens "
                          f"{row['jump_tokens'][-1]}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    medians_and_speedup(rows, "plain", "jump_forward")
    path = run.finish({"rows": rows, "note": load_note(run)})
    plot(rows)
    for key, row in rows.items():
        print(f"{key}: {row['speedup']:.2f}x, identical {row['identical']}")
    print(path)


def plot(rows: dict[str, dict[str, Any]]) -> None:
    speedup_bars(rows, "plain", "jump_forward",
                 "SmolLM2-135M, JSON schema: jump-forward drafts vs one token per step", NAME,
                 width=8)


if __name__ == "__main__":
    main()
