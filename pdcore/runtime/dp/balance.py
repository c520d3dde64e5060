"""Which DP replica a request goes to (`--load-balance-method`, SGLang's names).

The balancer counts what it sent and what came back, so it needs no round trip to the schedulers:
- round_robin: replicas in turn;
- shortest_queue: the replica with the fewest requests in flight;
- minimum_tokens: the replica with the fewest tokens in flight (prompt + max new tokens).
Ties go to the replica after the last one picked, so equal replicas still alternate.
"""

from __future__ import annotations

from pdcore.config import LOAD_BALANCE_METHODS


class DPBalancer:
    def __init__(self, size: int, method: str = "round_robin") -> None:
        if size < 1:
            raise ValueError("a balancer needs at least one replica")
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"unknown load balance method {method!r}")
        self.size, self.method = size, method
        self.reqs = [0] * size  # requests in flight per replica
        self.tokens = [0] * size  # their prompt + max new tokens
        self._next = 0

    def pick(self) -> int:
        """The replica for the next request (call `start` once it is sent)."""
        order = [(self._next + i) % self.size for i in range(self.size)]
        if self.method == "round_robin":
            rank = order[0]
        elif self.method == "shortest_queue":
            rank = min(order, key=lambda r: self.reqs[r])
        else:
            rank = min(order, key=lambda r: self.tokens[r])
        self._next = (rank + 1) % self.size
        return rank

    def start(self, rank: int, tokens: int) -> None:
        self.reqs[rank] += 1
        self.tokens[rank] += tokens

    def finish(self, rank: int, tokens: int) -> None:
        self.reqs[rank] = max(0, self.reqs[rank] - 1)
        self.tokens[rank] = max(0, self.tokens[rank] - tokens)
