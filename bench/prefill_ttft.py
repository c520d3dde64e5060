"""Prefill alone, served: one 512-token prompt and four at once, pdserve against vLLM.

Each system is started as vs_vllm.py starts it (same model folder, dtype, vLLM's thread bind),
warmed up, then for --reps rounds: one fresh random prompt of --input-len tokens with
max_tokens 1 (its time to the one token is the prefill of 1 x 512 plus one step's serving
cost), then --batch fresh prompts sent together (one prefill step of 4 x 512 on both systems),
the time until the last answer. Fresh prompts each time, so no prefix cache helps. Reported:
medians, and ms per prompt token (the wall time over the prompt tokens), next to the GFLOP/s
of the model's linear layers that rate implies (2 x parameters-in-GEMMs FLOP per token).

Run: `python bench/prefill_ttft.py --model-path DIR --vllm-python PATH`.

Two pdserve trees side by side (a change against main): `--trees old=/work/main,new=DIR` runs
pdserve-unified from each tree's code (PYTHONPATH), --starts servers of each, the trees'
order alternating from one start to the next; the reported medians pool every start's reps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from common import Run, alternating
from serving import random_prompts, stream_completion
from vllm_launch import start_system

NAME = "prefill_ttft"


def gemm_flop_per_token(model: str) -> float:
    import json

    c = json.loads((Path(model) / "config.json").read_text())
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return 2.0 * L * (h * (q + 2 * kv) + q * h + 3 * h * i)


async def timed(url: str, prompts: list[list[int]]) -> float:
    async with httpx.AsyncClient() as c:
        t = time.perf_counter()
        res = await asyncio.gather(*(stream_completion(c, url, p, 1) for p in prompts))
        wall = time.perf_counter() - t
    errs = [r.error for r in res if r.error]
    if errs:
        raise RuntimeError(errs[0])
    return wall


def one_system(system: str, a: argparse.Namespace, vocab: int,
               tree: str | None = None) -> dict[str, Any]:
    old_path = os.environ.get("PYTHONPATH")
    if tree:
        os.environ["PYTHONPATH"] = tree
    try:
        g = start_system(system, a.model_path, "float32", a.vllm_python, "0-1", 1)
    finally:
        if tree:
            os.environ.pop("PYTHONPATH") if old_path is None else os.environ.update(
                PYTHONPATH=old_path)
    try:
        startup = g.wait_ready(600)
        seed = 1000
        for n in (1, a.batch, 1, a.batch):  # warm-up: both step shapes twice
            asyncio.run(timed(g.url, random_prompts(n, a.input_len, vocab, seed)))
            seed += 1
        runs: dict[str, list[float]] = {"1": [], str(a.batch): []}
        for _ in range(a.reps):
            for n in (1, a.batch):
                runs[str(n)].append(asyncio.run(timed(
                    g.url, random_prompts(n, a.input_len, vocab, seed))))
                seed += 1
    finally:
        g.stop()
    return summarize(a, {"startup_s": [round(startup, 1)]}, runs)


def summarize(a: argparse.Namespace, out: dict[str, Any], runs: dict[str, list[float]]
              ) -> dict[str, Any]:
    flop = gemm_flop_per_token(a.model_path)
    for n, ws in runs.items():
        med = statistics.median(ws)
        per_tok = med / (int(n) * a.input_len)
        out[f"x{n}"] = {"wall_s": [round(w, 4) for w in ws], "median_s": round(med, 4),
                        "ms_per_prompt_token": round(per_tok * 1e3, 4),
                        "implied_gemm_gflops": round(flop / per_tok / 1e9, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True,
                    help="a float32 HF folder both systems load (SmolLM2's: the default GGUF's "
                         "converted folder under ~/.cache/pdserve/gguf)")
    ap.add_argument("--vllm-python", required=True, help="a Python with vllm installed")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--systems", default="pdserve-unified,vllm-unified")
    ap.add_argument("--tag", default="")
    ap.add_argument("--trees", default="", help="name=dir,...: pdserve from each tree's code")
    ap.add_argument("--starts", type=int, default=2, help="servers per tree (--trees)")
    a = ap.parse_args()
    run = Run(NAME + (f"_{a.tag}" if a.tag else ""), vars(a))
    import json

    vocab = json.loads((Path(a.model_path) / "config.json").read_text())["vocab_size"]
    if a.trees:
        trees = dict(t.split("=", 1) for t in a.trees.split(","))
        raw: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for start in range(a.starts):
            for name in alternating(list(trees), start):
                raw[name].append(one_system("pdserve-unified", a, vocab, trees[name]))
                print(name, start, {k: v["median_s"] for k, v in raw[name][-1].items()
                                    if k.startswith("x")}, flush=True)
        res = {}
        for name, outs in raw.items():
            runs = {k[1:]: [w for o in outs for w in o[k]["wall_s"]]
                    for k in outs[0] if k.startswith("x")}
            res[name] = summarize(a, {"tree": trees[name], "startup_s": [
                s for o in outs for s in o["startup_s"]], "per_start": outs}, runs)
    else:
        res = {s: one_system(s, a, vocab) for s in a.systems.split(",")}
    for s, r in res.items():
        print(s, {k: (v["median_s"], v["ms_per_prompt_token"], v["implied_gemm_gflops"])
                  for k, v in r.items() if k.startswith("x")})
    print(run.finish({"systems": res}))


if __name__ == "__main__":
    main()
