"""Per-(P, D) pair circuits: a pairing whose transfers fail is avoided while other pairings work.

A partition between one prefill and one decode server leaves both healthy to the router (each
answers its health checks and serves other peers), so the worker circuits (circuit.py) stay
closed; without this every request on that pair waits out P's claim timeout or D's bootstrap
before its retry. The rule (applied by proxy.py):

- a **pair failure** is a peer-fault report (HTTP 502, PEER_FAULT) from either leg: P saying its
  decode peer failed the room, D saying its prefill peer did; never `peer_restarted` (that
  instance is gone) nor a failure once the client's own `timeout` passed. It counts on the
  blamed worker's circuit as before, and on the pair's;
- a **pair success** is P's good answer (P answers once the KV went to D), in the background
  too; not a commit (a stream may commit on D's first event and an error event);
- closed -> open after `failure_threshold` consecutive pair failures; open: the pair is avoided
  for `timeout_s`; then half-open: one request at a time may try it (the trial); a successful
  trial (`success_threshold` in a row) closes it, a failed one opens it again for `timeout_s`;
- **avoided, never refused:** `choose` prefers allowed pairs; when the available workers form
  none, it takes the policies' choice among all of them, and that outcome counts like a trial's;
- a request also avoids the pairs that failed it earlier, so its retry takes another pairing;
- memory: a pair has an entry only once it failed (closed with no failure left: dropped), and a
  removed worker's pairs go with it (`forget`, a registry remove listener).
Observable: `snapshot()` (GET /workers `pairs`), /metrics (router/metrics.py), log lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcore.router.circuit import CircuitState

if TYPE_CHECKING:
    from pdcore.router.policies import Policy
    from pdcore.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pdcore.router.pairs")

PairKey = tuple[str, str]  # (prefill worker key, decode worker key)


@dataclass
class _Pair:
    state: CircuitState = CircuitState.CLOSED
    failures: int = 0  # consecutive
    successes: int = 0  # consecutive, while half-open or open
    opened_at: float = 0.0
    trial: bool = False  # a half-open trial is in flight
    total_failures: int = 0
    times_opened: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class Ticket:
    """One attempt on a pair (`begin`); `end` settles it."""

    key: PairKey
    trial: bool


class PairCircuits:
    def __init__(self, failure_threshold: int, success_threshold: int, timeout_s: float,
                 enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.clock = clock
        self._pairs: dict[PairKey, _Pair] = {}
        self.total_failures = 0  # pair failures ever recorded (metrics)
        self.total_opened = 0  # closed/half-open -> open transitions (metrics)

    def _state(self, key: PairKey, c: _Pair) -> CircuitState:
        if c.state is CircuitState.OPEN and self.clock() - c.opened_at >= self.timeout_s:
            c.state, c.successes, c.trial = CircuitState.HALF_OPEN, 0, False
            log.info("pair circuit half-open: prefill %s -> decode %s after %g s; one request "
                     "at a time may try it", key[0], key[1], self.timeout_s)
        return c.state

    def state(self, prefill: Worker, decode: Worker) -> CircuitState:
        c = self._pairs.get((prefill.key, decode.key))
        return CircuitState.CLOSED if c is None else self._state((prefill.key, decode.key), c)

    def allows(self, prefill: Worker, decode: Worker) -> bool:
        """Selectable: closed, or half-open with no trial in flight."""
        key = (prefill.key, decode.key)
        c = self._pairs.get(key)
        if c is None or not self.enabled:
            return True
        state = self._state(key, c)
        return state is CircuitState.CLOSED or (state is CircuitState.HALF_OPEN and not c.trial)

    def choose(self, registry: WorkerRegistry, policies: Mapping[str, Policy], text: str,
               avoid: Collection[PairKey] = ()) -> tuple[Worker, Worker] | str:
        """A (P, D) pair among available workers, allowed pairs first; or why there is none."""
        found = {role: registry.available(role) for role in ("prefill", "decode")}
        for role, workers in found.items():
            if not workers:
                return f"No available {role} workers (all unhealthy or circuits open)"
        ps, ds = found["prefill"], found["decode"]
        if not self._pairs and not avoid:
            p = policies["prefill"].select(ps, text)
            return p, policies["decode"].select(ds, text)

        def ok(p: Worker, d: Worker) -> bool:
            return (p.key, d.key) not in avoid and self.allows(p, d)

        p = policies["prefill"].select([p for p in ps if any(ok(p, d) for d in ds)] or ps, text)
        return p, policies["decode"].select([d for d in ds if ok(p, d)] or ds, text)

    def begin(self, prefill: Worker, decode: Worker) -> Ticket:
        key = (prefill.key, decode.key)
        c = self._pairs.get(key)
        trial = bool(self.enabled and c is not None
                     and self._state(key, c) is CircuitState.HALF_OPEN and not c.trial)
        if trial:
            assert c is not None
            c.trial = True
        return Ticket(key, trial)

    def end(self, ticket: Ticket, outcome: bool | None, error: str = "") -> bool | None:
        """Settle an attempt: True the pair worked, False a pair failure, None neither (another
        failure, the client went away, P's answer still to come: `ok`): a trial's slot is
        freed for the next request. Returns `outcome`."""
        c = self._pairs.get(ticket.key)
        if ticket.trial and c is not None:
            c.trial = False
        if outcome:
            self._success(ticket.key, c)
        elif outcome is False:
            self._failure(ticket.key, c, error)
        return outcome

    def ok(self, prefill: Worker, decode: Worker) -> None:
        """The pair worked: P answered well (it sent the KV), whenever that came."""
        key = (prefill.key, decode.key)
        self._success(key, self._pairs.get(key))

    def _success(self, key: PairKey, c: _Pair | None) -> None:
        if c is None:
            return
        if not self.enabled or self._state(key, c) is CircuitState.CLOSED:
            del self._pairs[key]  # nothing left to remember
            return
        c.successes += 1
        if c.successes >= self.success_threshold:
            del self._pairs[key]
            log.info("pair circuit closed: prefill %s -> decode %s served again", *key)

    def _failure(self, key: PairKey, c: _Pair | None, error: str) -> None:
        self.total_failures += 1
        if c is None:
            c = self._pairs[key] = _Pair()
        c.total_failures += 1
        c.last_error = error[:300]
        c.successes = 0
        if not self.enabled:
            return
        state = self._state(key, c)
        c.failures += 1
        if state is CircuitState.CLOSED and c.failures < self.failure_threshold:
            return
        if state is not CircuitState.OPEN:
            self.total_opened += 1
            c.times_opened += 1
            log.warning("pair circuit open: prefill %s -> decode %s after %d consecutive pair "
                        "failures (last: %s); other pairings are preferred for %g s",
                        key[0], key[1], c.failures, c.last_error, self.timeout_s)
        c.state, c.opened_at, c.failures = CircuitState.OPEN, self.clock(), 0

    def forget(self, worker: Worker) -> None:
        """A removed worker's pairs go with it."""
        for key in [k for k in self._pairs if worker.key in k]:
            del self._pairs[key]

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in CircuitState}
        for key, c in self._pairs.items():
            out[self._state(key, c).value] += 1
        return out

    def snapshot(self) -> list[dict[str, object]]:
        now, out = self.clock(), []
        for key, c in list(self._pairs.items()):
            state = self._state(key, c)
            row: dict[str, object] = {
                "prefill": key[0], "decode": key[1], "state": state.value,
                "consecutive_failures": c.failures, "consecutive_successes": c.successes,
                "total_failures": c.total_failures, "times_opened": c.times_opened,
                "trial_in_flight": c.trial, "last_error": c.last_error}
            if state is CircuitState.OPEN:
                row["half_open_in_s"] = round(max(0.0, c.opened_at + self.timeout_s - now), 3)
            out.append(row)
        return out
