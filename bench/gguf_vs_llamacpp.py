"""pdserve serving the default GGUF (SmolLM2-135M Q4_1, Q8_0 embedding) packed, against llama.cpp
(llama-cpp-python's OpenAI server) on the same file (#48's acceptance): streamed
/v1/completions of the same text prompts, greedy, --new tokens each (EOS kept out: pdserve's
ignore_eos, llama.cpp's logit_bias on EOS), closed loop at concurrency 1 and 8; output tokens/s
and TPOT (per request, first to last text chunk over tokens - 1), median over rounds, rounds
alternating the systems' order. Both run on the same CPUs with the same thread count.

llama-cpp-python is not a dependency: it is built from source into its own environment
(`--llama-python`, default /work/venv-llama/bin/python):
  python3 -m venv /work/venv-llama
  CMAKE_ARGS="-DGGML_NATIVE=ON" /work/venv-llama/bin/pip install "llama-cpp-python[server]"
Its server runs one request at a time (a lock around the model), so its concurrency 8 is
queueing, not batching; the JSON says so beside the numbers.

The CPU's flags and the load (start, end) are in the JSON. Run:
`python bench/gguf_vs_llamacpp.py [--rounds 3] [--new 64]`; JSON + PNG in
bench/results/gguf_vs_llamacpp.*.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from common import Run, alternating, bar_groups, figure, load_note, save_figure, start_unified
from serving import sse_lines
from gguf_packed import tree_memory_mib

NAME = "gguf_vs_llamacpp"
EOS_TOKEN = 2  # when the file names none
PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who",
    "In mathematics, a prime number is",
    "The recipe for a simple tomato soup:",
    "Explain how a bicycle stays upright:",
    "Once upon a time in a small village,",
    "The main causes of the French Revolution were",
    "A good way to learn a new language is",
]


def eos_id(gguf_path: str) -> int:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.ggml.eos_token_id")
    return int(field.parts[field.data[0]][0]) if field is not None else EOS_TOKEN


def free_port() -> int:
    from pdcore.testing.processes import free_port as fp

    return fp()


class LlamaServer:
    """llama_cpp.server on loopback (same threads as pdserve), stopped with its process."""

    def __init__(self, python: str, model: str, threads: int, ctx: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llamacpp-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [python, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--n_threads", str(threads),
             "--n_threads_batch", str(threads), "--n_ctx", str(ctx), "--verbose", "False",
             "--interrupt_requests", "False"],  # else a new request cancels the streaming one
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float = 300.0) -> LlamaServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited {self.proc.returncode}: see "
                                   f"{self.log.name}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama_cpp.server not up in {timeout:.0f} s ({self.log.name})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


async def stream_text(client: httpx.AsyncClient, url: str, prompt: str, new: int,
                      extra: dict[str, Any]) -> dict[str, Any]:
    """One streamed greedy completion: TTFT, chunk times, tokens (usage, else chunks)."""
    import json

    body = {"prompt": prompt, "max_tokens": new, "temperature": 0.0, "stream": True, **extra}
    t0 = time.perf_counter()
    times: list[float] = []
    tokens, error = 0, None
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in sse_lines(r.aiter_text()):
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                error = str(msg["error"])[:200]
                break
            if msg.get("usage"):
                tokens = int(msg["usage"].get("completion_tokens") or 0)
            if any(c.get("text") for c in msg.get("choices") or []):
                times.append(time.perf_counter())
    end = time.perf_counter()
    return {"error": error, "ttft": times[0] - t0 if times else None, "times": times,
            "tokens": tokens or len(times), "e2e": end - t0}


async def closed_loop(url: str, prompts: list[str], new: int, conc: int,
                      extra: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    queue = list(reversed(prompts))
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=2 * conc)) as client:
        async def worker() -> None:
            while queue:
                out.append(await stream_text(client, url, queue.pop(), new, extra))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return out, time.perf_counter() - t0


def one(url: str, prompts: list[str], new: int, conc: int, extra: dict[str, Any]
        ) -> dict[str, Any]:
    res, wall = asyncio.run(closed_loop(url, prompts, new, conc, extra))
    ok = [r for r in res if r.get("error") is None]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1)
            for r in ok if r["tokens"] > 1 and len(r["times"]) > 1]
    toks = sum(r["tokens"] for r in ok)
    return {"errors": [r["error"] for r in res if r.get("error")][:3], "output_tokens": toks,
            "expected_tokens": len(prompts) * new,
            "wall_s": wall, "tokens_per_s": toks / wall,
            "tpot_ms": 1e3 * statistics.median(tpot) if tpot else None,
            "ttft_ms": 1e3 * statistics.median([r["ttft"] for r in ok if r["ttft"]])
            if ok else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-python", default="/work/venv-llama/bin/python")
    args = ap.parse_args()
    from pdcore.engine.model.source import default_model_file

    model = default_model_file()
    concs = [int(c) for c in args.concurrency.split(",")]
    run = Run(NAME, {**vars(args), "model": model})
    ver = subprocess.run([args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                         capture_output=True, text=True, timeout=120)
    if ver.returncode != 0:
        sys.exit(f"llama-cpp-python is not importable from {args.llama_python} (see the "
                 f"docstring to build it): {ver.stderr.strip()[-300:]}")
    eos = eos_id(model)
    extras = {"pdserve": {"ignore_eos": True},
              "llama.cpp": {"logit_bias": {str(eos): -100.0}}}
    servers: dict[str, Any] = {
        "pdserve": start_unified(model, ("--max-total-tokens", "8192"), threads=args.threads,
                                 env={"PDCORE_GGUF_PACKED": "1"}),
        "llama.cpp": LlamaServer(args.llama_python, model, args.threads, 8 * 512).wait_healthy(),
    }
    out: dict[str, Any] = {"llama_cpp_python": ver.stdout.strip(), "eos_id": eos,
                           "llama_cpp_note": "llama_cpp.server serves one request at a time: "
                           "its concurrency 8 queues", "systems": {}}
    samples: dict[str, dict[int, list[dict[str, Any]]]] = {}
    try:
        for name, s in servers.items():  # warm-up
            one(s.url, PROMPTS[:2], 4, 2, extras[name])
        for r in range(args.rounds):
            for name in alternating(list(servers), r):
                for c in concs:
                    samples.setdefault(name, {}).setdefault(c, []).append(
                        one(servers[name].url, PROMPTS[: max(c, 4)] if c > 1 else PROMPTS[:3],
                            args.new, c, extras[name]))
        out["rss_mib"] = {name: tree_memory_mib(servers[name].proc.pid)["resident"]["total"]
                          for name in ("pdserve", "llama.cpp")}
    finally:
        for s in servers.values():
            s.stop()
    for name, per in samples.items():
        out["systems"][name] = {str(c): {
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in v),
            "tpot_ms": statistics.median(x["tpot_ms"] for x in v if x["tpot_ms"] is not None),
            "rounds": v} for c, v in per.items()}
    out["note"] = load_note(run)
    for name, per in out["systems"].items():
        print(name, {c: (round(m["tokens_per_s"], 1), round(m["tpot_ms"], 1))
                     for c, m in per.items()}, flush=True)
    print(run.finish(out))
    fig, (ax1, ax2) = figure(2, width=5)
    groups = [f"c{c}" for c in concs]
    bar_groups(ax1, groups, {n: [out["systems"][n][str(c)]["tokens_per_s"] for c in concs]
                             for n in servers}, "output tok/s", "throughput")
    bar_groups(ax2, groups, {n: [out["systems"][n][str(c)]["tpot_ms"] for c in concs]
                             for n in servers}, "TPOT (ms)", f"TPOT ({out['note']})")
    print(save_figure(fig, NAME))


if __name__ == "__main__":
    main()
