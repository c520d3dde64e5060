"""`python -m pd_ascend.store`: run memfabric-hybrid's config store on its own.

1. the URL comes from --url, else ASCEND_MF_STORE_URL (else MF_CONFIG_STORE_URL) and is
   validated (`tcp://<ip>:<port>`); a bad one exits 2 with the reason;
2. memfabric's `create_config_store` starts the store in this process; a refusal (port taken,
   URL memfabric rejects) exits 2 with memfabric's own error lines;
3. "memfabric config store listening on tcp://ip:port" is printed, then the process waits for
   SIGINT/SIGTERM and leaves through os._exit (memfabric has no stop call: the store ends with
   the process).

Every P and D server then points ASCEND_MF_STORE_URL at it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from pd_ascend.settings import parse_store_url, store_url_from_env
from pdcore.env import environ
from pdcore.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_ascend.store",
                                     description="Run memfabric-hybrid's config store.")
    parser.add_argument("--url", help="tcp://<ip>:<port> (default: $ASCEND_MF_STORE_URL)")
    args = parser.parse_args(argv)
    try:
        url = parse_store_url(args.url, "--url") if args.url else store_url_from_env(environ())
        from pd_ascend.memfabric_engine import start_config_store

        start_config_store(url)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    # the handler only flips a flag: an Event.set() from a signal handler can deadlock when the
    # signal lands while the main thread holds that Event's lock inside Event.wait (seen once
    # in CI: SIGTERM ignored for 20 s, then SIGKILL)
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    print(f"memfabric config store listening on {url}", flush=True)
    while not stop:
        time.sleep(0.2)
    try:
        print(f"memfabric config store on {url} stopped", flush=True)
    except OSError:  # whoever read our stdout is gone; nothing left to report
        pass
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the store holds nothing to save; skip memfabric's ~3 s teardown of its threads at exit
    os._exit(code)
