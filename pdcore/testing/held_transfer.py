"""A test hook: a server whose tcp KV sends wait at a gate the test holds and opens, so a test can
put a fault (a frozen decode) exactly between "decode is waiting for this KV" and "prefill sends
it": `python -m pdcore.testing.held_transfer <pdserve serve flags>` with $PDCORE_TEST_HOLD_GATE
naming a file. While that file reads `hold`, every batch the tcp engine is about to send waits
(polling, at most HOLD_MAX_S); once it reads anything else, or is gone, sends go on as usual.
Test-only: nothing in the server imports it.

`TransferGate` is the test's side: hold(), open(), and `held()`, the number of batches waiting."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from pdcore.config import ServerArgs
from pdcore.env import ENV, Env

GATE_ENV = Env.pdcore_test_hold_gate.name
HOLD_MAX_S = 120.0  # a test that never opens its gate fails its own wait, not the server
_POLL_S = 0.02


class TransferGate:
    """The file a held_transfer server's sends wait on; each waiting batch leaves a marker file
    beside it (`<gate>.held.<pid>.<n>`) while it waits, so the test can wait for one."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def env(self) -> dict[str, str]:
        return {GATE_ENV: str(self.path)}

    def hold(self) -> None:
        self.path.write_text("hold")

    def open(self) -> None:
        self.path.write_text("open")

    def held(self) -> int:
        return len(list(self.path.parent.glob(self.path.name + ".held.*")))

    def wait_held(self, n: int = 1, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.held() < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {n} tcp batch(es) waited at the gate within {timeout}s")
            time.sleep(_POLL_S)


def _holding(gate: Path) -> bool:
    try:
        return gate.read_text() == "hold"
    except OSError:
        return False


def held_scheduler(args: ServerArgs, recv_addr: str, send_addr: str, ready_conn: Any) -> None:
    """The real scheduler process, with TcpTransferEngine._send waiting at the gate first."""
    import itertools
    import threading

    from pdcore.builtin.tcp_backend import TcpTransferEngine
    from pdcore.runtime.scheduler_process import run_scheduler_process

    gate = Path(ENV.pdcore_test_hold_gate or "")
    real = TcpTransferEngine._send
    counter, lock = itertools.count(), threading.Lock()

    def send(self: TcpTransferEngine, *a: Any, **kw: Any) -> Any:
        if _holding(gate):
            with lock:
                marker = gate.with_name(f"{gate.name}.held.{os.getpid()}.{next(counter)}")
            marker.touch()
            try:
                deadline = time.monotonic() + HOLD_MAX_S
                while _holding(gate) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
            finally:
                marker.unlink(missing_ok=True)
        return real(self, *a, **kw)

    TcpTransferEngine._send = send  # type: ignore[method-assign]
    run_scheduler_process(args, recv_addr, send_addr, ready_conn)


def main(argv: list[str] | None = None) -> int:
    from pdcore.runtime_env import apply

    apply()
    from pdcore.server.startup.args_parser import parse_server_args
    from pdcore.server.runner import run_server

    if not ENV.is_set(GATE_ENV):
        print(f"python -m pdcore.testing.held_transfer: set {GATE_ENV} to the gate file",
              file=sys.stderr)
        return 2
    args = parse_server_args(sys.argv[1:] if argv is None else argv,
                             prog="python -m pdcore.testing.held_transfer")
    # by its module name, not __main__'s: the spawned scheduler imports it from there
    from pdcore.testing.held_transfer import held_scheduler as target

    return run_server(args, scheduler_target=target)


if __name__ == "__main__":
    sys.exit(main())
