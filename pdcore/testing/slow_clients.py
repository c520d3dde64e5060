"""Slow-body clients for tests and benches (#44 item 4): `n` connections, spread over `sources`
loopback addresses (127.0.0.2, 127.0.0.3, ...), opened at `rate` a second (0: as fast as it
can, a connection flood of its own), each sends a request's headers (a POST with a
large Content-Length) and one body byte, then one more byte every `trickle_s` until `hold_s`
has passed since the last one opened. Connections the server closes are not reopened.

Run in its own process (`python -m pdcore.testing.slow_clients --port P ...`) so the prober's
timings do not share its interpreter. It lifts its soft descriptor limit to the hard one, prints
`opened N failed F` when every connection is made, and at the end `alive A closed C`, then a
line `answers K` with how many of the closed ones got a 408 first.
"""

from __future__ import annotations

import argparse
import resource
import socket
import sys
import time

HEAD = (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n{")


def _connect(port: int, source: str, path: bytes) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind((source, 0))
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        s.sendall(HEAD % path)
        s.setblocking(False)
        return s
    except OSError:
        s.close()
        return None


def _closed(s: socket.socket) -> tuple[bool, bool]:
    """(closed by the server, it said 408 first); never blocks."""
    try:
        got = s.recv(4096)
    except BlockingIOError:
        return False, False
    except OSError:
        return True, False
    return (not got or b" 408 " in got[:16]), b" 408 " in got[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--sources", type=int, default=50)
    ap.add_argument("--path", default="/generate")
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--trickle-s", type=float, default=1.0)
    ap.add_argument("--hold-s", type=float, default=10.0)
    a = ap.parse_args(argv)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    t0 = time.monotonic()
    socks, failed = [], 0
    for i in range(a.n):
        if a.rate > 0 and (ahead := t0 + i / a.rate - time.monotonic()) > 0:
            time.sleep(ahead)
        s = _connect(a.port, f"127.0.0.{2 + i % max(1, min(a.sources, 250))}", a.path.encode())
        if s is None:
            failed += 1
        else:
            socks.append(s)
    print(f"opened {len(socks)} failed {failed} in {time.monotonic() - t0:.1f} s", flush=True)
    closed = answers = 0
    t1 = time.monotonic()
    while (left := t1 + a.hold_s - time.monotonic()) > 0:
        time.sleep(min(a.trickle_s, left))
        alive = []
        for s in socks:
            gone, said_408 = _closed(s)
            if not gone:
                try:
                    s.send(b" ")
                except BlockingIOError:
                    pass
                except OSError:  # reset or broken pipe: the server closed it
                    gone = True
            if gone:
                closed, answers = closed + 1, answers + said_408
                s.close()
            else:
                alive.append(s)
        socks = alive
    print(f"alive {len(socks)} closed {closed}\nanswers {answers}", flush=True)
    for s in socks:
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
