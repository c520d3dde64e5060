"""Per-worker circuit breaker: closed -> open -> half-open -> closed.

1. Closed: every outcome is recorded; `failure_threshold` consecutive failures open the circuit.
2. Open: the worker is not selectable until `timeout_s` has passed since it opened.
3. Half-open: the worker is selectable again; `success_threshold` consecutive successes close
   the circuit, a single failure re-opens it (and restarts the timeout). A good health probe
   sent while the circuit is half-open closes it too (`probe_ok`): a worker nobody sends
   traffic to must not stay half-open, one failure away from the whole timeout again.

Only the worker's own faults count. The rule (applied in upstream.py and proxy.py):
- failure: a 5xx answer and a transport error or timeout (the worker died, hung or broke);
- success: 2xx, and 4xx (the worker answered; a 4xx is the client's fault, not the worker's);
- neither (`record_client_error`, counted apart): an answer the server marked as caused by the
  client (`X-PD-Error-Origin: client`, e.g. the 504 of a request whose own `timeout` ran out),
  and anything that goes wrong once the client's `timeout` has passed (the router's own
  deadline, a peer-fault report, a cut connection): the client asked for that deadline.
  Such answers are passed to the client as they are and never retried on another worker, so a
  client cannot open (or, half-open, re-open) a healthy worker's circuit.
`last_failure_at` tells the health monitor to probe the worker now; `retry_now()` (the worker's
health came back after it was down) moves an open circuit to half-open at once instead of
after the timeout.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class CircuitState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int,
        success_threshold: int,
        timeout_s: float,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.timeout_s = timeout_s
        self.enabled = enabled
        self._clock = clock
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._half_open_at = 0.0  # clock() when the circuit last turned half-open
        self.total_failures = 0
        self.total_successes = 0
        self.total_client_errors = 0  # outcomes the client caused: not counted either way
        self.last_failure_at = 0.0  # clock() of the last failed outcome (enabled or not)

    @property
    def state(self) -> CircuitState:
        # The open -> half-open move is time driven, so it happens on read.
        if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self.timeout_s:
            self._half_open(self._opened_at + self.timeout_s)
        return self._state

    def allows_requests(self) -> bool:
        return not self.enabled or self.state is not CircuitState.OPEN

    def record(self, success: bool) -> None:
        if success:
            self.total_successes += 1
        else:
            self.total_failures += 1
            self.last_failure_at = self._clock()
        if not self.enabled:
            return
        state = self.state
        if success:
            self._failures = 0
            if state is CircuitState.HALF_OPEN:
                self._successes += 1
                if self._successes >= self.success_threshold:
                    self._state = CircuitState.CLOSED
            return
        self._successes = 0
        self._failures += 1
        if state is CircuitState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._open()

    def record_client_error(self) -> None:
        """An outcome the client caused: neither a failure nor a success of the worker."""
        self.total_client_errors += 1

    def probe_ok(self, sent_at: float) -> None:
        """A health probe sent at `sent_at` (clock time) succeeded: half-open -> closed, when
        the circuit was half-open already when the probe went out."""
        if (self.enabled and self.state is CircuitState.HALF_OPEN
                and sent_at >= self._half_open_at):
            self._state = CircuitState.CLOSED
            self._failures = self._successes = 0

    def retry_now(self) -> None:
        """Open -> half-open now: the worker was down and answers its health checks again."""
        if self.state is CircuitState.OPEN:
            self._half_open(self._clock())

    def _half_open(self, at: float) -> None:
        self._state = CircuitState.HALF_OPEN
        self._half_open_at = at
        self._successes = 0

    def _open(self) -> None:
        self._state = CircuitState.OPEN
        self._opened_at = self._clock()
        self._failures = 0

    def snapshot(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "consecutive_failures": self._failures,
            "consecutive_successes": self._successes,
            "total_failures": self.total_failures,
            "total_successes": self.total_successes,
            "total_client_errors": self.total_client_errors,
        }
