"""A ShareGPT-like synthetic workload, with no download: prompt and output lengths drawn from
log-normal distributions (a fixed seed gives the same requests on every run and host), token
ids drawn uniformly from the vocabulary, and Poisson arrival times for open-loop benches.

The default shape follows what published analyses of ShareGPT conversations report (a long
right tail; prompts median ~100-200 tokens, mean ~250-350; outputs median ~100-150, mean
~200), scaled to SmolLM2's 8,192-token window: prompts log-normal with median 160 tokens and
sigma 1.0 (mean ~265) clipped to [4, 2048]; outputs median 96 and sigma 0.8 (mean ~132)
clipped to [4, 512]. Every parameter is a field of `Shape`; the bench results record it.

Also the streaming client both benches use (bench/many_streams.py, bench/goodput.py): one
streamed /v1/completions request per `Request`, ignore_eos (each request produces
exactly its drawn output length), timed per chunk (serving.py's client); the benches send no
temperature by default (`--sampling default`: the server's default, 1.0, as most clients get),
or temperature 0 with `--sampling greedy`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Shape:
    in_median: float = 160.0
    in_sigma: float = 1.0
    in_min: int = 4
    in_max: int = 2048
    out_median: float = 96.0
    out_sigma: float = 0.8
    out_min: int = 4
    out_max: int = 512

    def scaled(self, f: float) -> Shape:
        """The same distribution with every length times f (smoke runs)."""
        return Shape(self.in_median * f, self.in_sigma, self.in_min, max(self.in_min,
                     int(self.in_max * f)), self.out_median * f, self.out_sigma, self.out_min,
                     max(self.out_min, int(self.out_max * f)))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


QUICK = Shape().scaled(0.125)  # median 20 in / 12 out: seconds per request on a busy box


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after the start (open loop); 0 in a closed loop


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def requests(n: int, vocab: int, seed: int = 0, shape: Shape = Shape(),
             rate: float | None = None) -> list[Request]:
    """n requests; with `rate` (requests per second) Poisson arrivals (exponential gaps, from
    their own stream of the seed, so the lengths do not change with the rate)."""
    rng = random.Random(seed)
    arr = random.Random(seed + 7919)
    t, out = 0.0, []
    for _ in range(n):
        plen = _lognormal(rng, shape.in_median, shape.in_sigma, shape.in_min, shape.in_max)
        olen = _lognormal(rng, shape.out_median, shape.out_sigma, shape.out_min, shape.out_max)
        prompt = [rng.randrange(100, vocab) for _ in range(plen)]
        if rate:
            t += arr.expovariate(rate)
        out.append(Request(prompt, olen, t if rate else 0.0))
    return out


def length_stats(reqs: list[Request]) -> dict[str, Any]:
    from common import summary

    return {"prompt": summary([len(r.prompt) for r in reqs]),
            "output": summary([r.max_tokens for r in reqs])}


# -- client ------------------------------------------------------------------------------------
def _client(concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency * 2 + 8,
                          max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(limits=limits)


async def closed_loop(url: str, reqs: list[Request], concurrency: int, timeout: float,
                      sampling: str = "greedy") -> tuple[list[Any], float]:
    """Every request, at most `concurrency` in flight; (results, wall seconds). `sampling`: a
    serving.SAMPLINGS key (greedy, or default: no temperature sent, what most clients do)."""
    from serving import stream_completion

    queue = list(reversed(reqs))
    results: list[Any] = []
    async with _client(concurrency) as client:
        async def worker() -> None:
            while queue:
                r = queue.pop()
                results.append(await stream_completion(client, url, r.prompt, r.max_tokens,
                                                       timeout=timeout, sampling=sampling))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


async def open_loop(url: str, reqs: list[Request], timeout: float, sampling: str = "greedy"
                    ) -> tuple[list[Any], float]:
    """Each request sent at its arrival time whatever is in flight (Poisson: an open loop);
    (results in the order of `reqs`, wall seconds until the last one ended)."""
    from serving import stream_completion

    results: list[Any] = [None] * len(reqs)
    async with _client(len(reqs)) as client:
        t0 = time.perf_counter()

        async def one(i: int, r: Request) -> None:
            delay = t0 + r.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            results[i] = await stream_completion(client, url, r.prompt, r.max_tokens,
                                                 timeout=timeout, sampling=sampling)

        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        return results, time.perf_counter() - t0
