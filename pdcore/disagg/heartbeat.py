"""D's heartbeat toward every prefill instance it knows.

Lifecycle:
1. `start()` runs a daemon thread that, every `interval` seconds, GETs `/health` of each address
   returned by `addresses()` (short connect/read timeouts, so a hung P cannot stall the loop);
2. after `max_failure` consecutive failures it calls `on_lost(addr, reason)`; an answer carrying
   another instance id than the one D resolved calls `on_restart(addr, "... restarted")` at once
   (`on_lost` where none is given); `down_since(addr)` says since when the current streak of
   failed checks runs (None: the last check answered), so D can tell a room sent to an instance
   already unreachable from one the old instance may have started on;
3. `close()` stops the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdcore.disagg.bootstrap import BootstrapClient
from pdcore.errors import TransferError

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, interval: float, max_failure: int,
                 addresses: Callable[[], dict[str, str]],
                 on_lost: Callable[[str, str], None], token: str | None = None,
                 on_restart: Callable[[str, str], None] | None = None) -> None:
        self.interval = interval
        self.max_failure = max(1, max_failure)
        timeout = min(2.0, max(0.2, interval))
        self.client = BootstrapClient(connect_timeout=timeout,
                                      read_timeout=min(3.0, max(0.2, interval)), token=token)
        self._addresses, self._on_lost = addresses, on_lost
        self._on_restart = on_restart or on_lost
        # addr -> (failed checks in a row, monotonic end of the streak's first failure)
        self._streaks: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pd-heartbeat", daemon=True)
        self.checks = 0

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            known = self._addresses()  # addr -> instance id D resolved
            for addr in list(self._streaks):
                if addr not in known:
                    del self._streaks[addr]
            for addr, instance in known.items():
                if self._stop.is_set():
                    return
                self._check(addr, instance)

    def _check(self, addr: str, instance: str) -> None:
        self.checks += 1
        try:
            got = self.client.health(addr)
        except TransferError as e:
            n, since = self._streaks.get(addr, (0, time.monotonic()))
            self._streaks[addr] = (n + 1, since)
            log.warning("heartbeat to prefill %s failed (%d/%d): %s", addr, n + 1,
                        self.max_failure, e)
            if n + 1 >= self.max_failure:
                self._safe(self._on_lost, addr, f"lost connection with prefill instance {addr}")
                self._streaks.pop(addr, None)
            return
        if got and instance and got != instance:  # the streak stays readable (down_since) in it
            self._safe(self._on_restart, addr, f"prefill instance {addr} restarted")
        self._streaks.pop(addr, None)

    def down_since(self, addr: str) -> float | None:
        """When the running streak of failed checks of addr began (None: none running)."""
        streak = self._streaks.get(addr)
        return streak[1] if streak else None

    def _safe(self, fn: Callable[[str, str], None], addr: str, reason: str) -> None:
        try:
            fn(addr, reason)
        except Exception:  # never let one callback error end the heartbeat
            log.exception("heartbeat: on_lost(%s) raised", addr)

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
