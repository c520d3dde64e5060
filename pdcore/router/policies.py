"""Worker selection policies: random, round_robin, power_of_two, cache_aware.

One policy instance serves one role (prefill or decode), so round_robin keeps separate counters
for P and D and cache_aware separate trees. `select` gets the non-empty list of *available*
workers and the request's routing text (see `routing_text`).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pdcore.router.config import RouterConfig
from pdcore.router.prefix_tree import PrefixTree
from pdcore.router.workers import Worker

_TEXT_LIMIT = 16384  # affinity is about the prompt's head; a long tail only costs memory


class Policy(ABC):
    name: str = ""
    needs_loads: bool = False  # True -> the router polls GET /get_load

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    @abstractmethod
    def select(self, workers: Sequence[Worker], text: str) -> Worker:
        """Pick one of `workers` (non-empty)."""

    def forget(self, worker: Worker) -> None:
        """Drop any state kept for a removed worker."""

    def _least_loaded(self, workers: Sequence[Worker]) -> Worker:
        low = min(w.effective_load() for w in workers)
        return self._rng.choice([w for w in workers if w.effective_load() == low])


class RandomPolicy(Policy):
    name = "random"

    def select(self, workers: Sequence[Worker], text: str) -> Worker:
        return self._rng.choice(list(workers))


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._counter = 0

    def select(self, workers: Sequence[Worker], text: str) -> Worker:
        worker = workers[self._counter % len(workers)]
        self._counter += 1
        return worker


class PowerOfTwoPolicy(Policy):
    """Two distinct random workers; the one with the lower load (polled tokens + in-flight)."""

    name = "power_of_two"
    needs_loads = True

    def select(self, workers: Sequence[Worker], text: str) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        la, lb = a.effective_load(), b.effective_load()
        if la == lb:
            return self._rng.choice((a, b))
        return a if la < lb else b


class CacheAwarePolicy(Policy):
    """Prefix affinity while balanced, least load when imbalanced.

    1. Imbalanced (max - min > balance_abs and max > min * balance_rel, loads = effective_load)
       or no text -> the least loaded worker.
    2. Else the worker whose tree matches the largest share of the text, if that share exceeds
       cache_threshold; otherwise the worker with the smallest tree (most free cache).
    3. The text is inserted into the chosen worker's tree, which is evicted (LRU leaves) when it
       grows past max_tree_size characters.
    """

    name = "cache_aware"

    def __init__(self, config: RouterConfig, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._cfg = config
        self._trees: dict[str, PrefixTree] = {}

    def _tree(self, worker: Worker) -> PrefixTree:
        return self._trees.setdefault(worker.key, PrefixTree())

    def select(self, workers: Sequence[Worker], text: str) -> Worker:
        text = text[:_TEXT_LIMIT]
        loads = [w.effective_load() for w in workers]
        hi, lo = max(loads), min(loads)
        cfg = self._cfg
        imbalanced = hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold
        if imbalanced or not text:
            chosen = self._least_loaded(workers)
        else:
            ratios = [self._tree(w).match(text) / len(text) for w in workers]
            best = max(ratios)
            if best > cfg.cache_threshold:
                pool = [w for w, r in zip(workers, ratios) if r == best]
                chosen = self._least_loaded(pool)
            else:
                smallest = min(self._tree(w).size for w in workers)
                chosen = self._least_loaded([w for w in workers if self._tree(w).size == smallest])
        if text:
            tree = self._tree(chosen)
            tree.insert(text)
            tree.evict_to(cfg.max_tree_size)
        return chosen

    def forget(self, worker: Worker) -> None:
        self._trees.pop(worker.key, None)

    def tree_sizes(self) -> dict[str, int]:
        return {url: tree.size for url, tree in self._trees.items()}


def make_policy(name: str, config: RouterConfig, rng: random.Random | None = None) -> Policy:
    if name == "random":
        return RandomPolicy(rng)
    if name == "round_robin":
        return RoundRobinPolicy(rng)
    if name == "power_of_two":
        return PowerOfTwoPolicy(rng)
    if name == "cache_aware":
        return CacheAwarePolicy(config, rng)
    raise ValueError(f"unknown policy {name!r}")  # config.validate() rejects this earlier


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _ids_text(ids: Any) -> str:
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    if isinstance(ids, list):
        return " ".join(str(i) for i in ids[:_TEXT_LIMIT // 6])
    return ""


def routing_text(route: str, body: dict[str, Any]) -> str:
    """The text cache_aware routes on: generate text (first of a batch), else input_ids as a
    string; completion prompt (first); chat messages' contents concatenated."""
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        if isinstance(messages, list):
            return "".join(
                _content_text(m.get("content")) for m in messages if isinstance(m, dict)
            )
        return ""
    if route == "/v1/responses":
        items = body.get("input")
        if isinstance(items, list):
            return "".join(_content_text(m.get("content")) for m in items if isinstance(m, dict))
        return items if isinstance(items, str) else ""
    key = "prompt" if route == "/v1/completions" else "text"
    value = body.get(key)
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    if isinstance(value, str):
        return value
    if route == "/v1/completions":
        return _ids_text(value)  # token-id prompt(s)
    return _ids_text(body.get("input_ids"))


class DPRanks:
    """The DP-rank fields of one request, added to the body both roles get.

    - a decode entry of --dp-aware names decode's replica: `data_parallel_rank`;
    - a prefill entry of --dp-aware names prefill's: `disagg_prefill_dp_rank`, so decode pulls
      from that replica (a prefill server reads its own rank there, never data_parallel_rank);
    - --prefill-round-robin-balance, prefill server of dp_size N > 1 without --dp-aware: its
      ranks in turn, one counter per server, in `disagg_prefill_dp_rank` too.
    Without any of these a prefill server takes bootstrap_room % dp_size and decode agrees."""

    def __init__(self, round_robin: bool) -> None:
        self.round_robin = round_robin
        self._next: dict[str, int] = {}

    def fields(self, prefill: Worker, decode: Worker) -> dict[str, int]:
        out: dict[str, int] = {}
        if prefill.dp_rank is not None:
            out["disagg_prefill_dp_rank"] = prefill.dp_rank
        elif self.round_robin and prefill.dp_size > 1:
            rank = self._next.get(prefill.url, 0) % prefill.dp_size
            self._next[prefill.url] = rank + 1
            out["disagg_prefill_dp_rank"] = rank
        if decode.dp_rank is not None:
            out["data_parallel_rank"] = decode.dp_rank
        return out
