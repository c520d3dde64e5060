"""A server whose scheduler hangs in its first step with work, for watchdog tests:
`python -m pdcore.testing.stuck_step <pdserve serve flags>`. Test-only: nothing in the
server imports it."""

from __future__ import annotations

import sys
import time
from typing import Any

from pdcore.config import ServerArgs

HANG_S = 3600.0


def stuck_scheduler(args: ServerArgs, recv_addr: str, send_addr: str, ready_conn: Any) -> None:
    """The real scheduler process, with the engine step (StepLoop.step) sleeping once a request
    arrived."""
    from pdcore.engine.loop import StepLoop
    from pdcore.runtime.scheduler_process import run_scheduler_process

    real = StepLoop.step

    def step(self: StepLoop) -> Any:
        if self.sched.live():
            time.sleep(HANG_S)  # what a deadlocked collective or a stuck device call looks like
        return real(self)

    StepLoop.step = step  # type: ignore[method-assign]
    run_scheduler_process(args, recv_addr, send_addr, ready_conn)


def main(argv: list[str] | None = None) -> int:
    from pdcore.runtime_env import apply

    apply()
    from pdcore.server.startup.args_parser import parse_server_args
    from pdcore.server.runner import run_server

    args = parse_server_args(sys.argv[1:] if argv is None else argv,
                             prog="python -m pdcore.testing.stuck_step")
    # by its module name, not __main__'s: the spawned scheduler imports it from there
    from pdcore.testing.stuck_step import stuck_scheduler as target

    return run_server(args, scheduler_target=target)


if __name__ == "__main__":
    sys.exit(main())
