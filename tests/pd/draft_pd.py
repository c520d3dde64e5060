"""What the draft-head PD tests share (test_pd_eagle.py, test_pd_nextn.py): a prefill server with
its bootstrap port, the router's fan-out by hand, waiting for pages to come back, and the
non-zero rows of a shm server's draft pool segment."""

from __future__ import annotations

import os
import threading
import time
from itertools import count
from typing import Any

import httpx
import numpy as np

from pdcore.testing.pages import load_at_rest
from pdcore.testing.ports import free_port
from pdcore.testing.processes import ServerProcess, spawned_children

PAGE = 4
FLAGS = ("--max-total-tokens", "2048", "--page-size", str(PAGE), "--chunked-prefill-size", "16")
ENV = {"PDSERVE_SPEC_GATE": "0", "OMP_NUM_THREADS": "1"}  # verify every draft


def env(backend: str) -> dict[str, str]:
    # shm in segment mode: the KV pools are named segments, which the tests read back
    return {**ENV, "PDCORE_SHM_MODE": "segment"} if backend == "shm" else ENV


class Prefill:
    def __init__(self, backend: str, *flags: str) -> None:
        self.port = free_port()
        self.server = ServerProcess(*FLAGS, "--disaggregation-mode", "prefill",
                                    "--disaggregation-transfer-backend", backend,
                                    "--disaggregation-bootstrap-port", str(self.port), *flags,
                                    env=env(backend))


def decode(backend: str, *flags: str) -> ServerProcess:
    return ServerProcess(*FLAGS, *flags, "--disaggregation-mode", "decode",
                         "--disaggregation-transfer-backend", backend, env=env(backend))


def server(s: Prefill | ServerProcess) -> ServerProcess:
    return s.server if isinstance(s, Prefill) else s


def load(s: ServerProcess) -> dict[str, Any]:
    return httpx.get(s.url + "/get_load", timeout=10).json()[0]


_rooms = count(1000, 7)


def pair(p: Prefill, d: ServerProcess, ids: list[int], new: int) -> tuple[httpx.Response, Any]:
    """The router's fan-out by hand: (D's response, P's response or error)."""
    body = {"input_ids": ids, "bootstrap_host": "127.0.0.1", "bootstrap_port": p.port,
            "bootstrap_room": next(_rooms),
            "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}
    got: list[Any] = []

    def prefill() -> None:
        try:
            got.append(httpx.post(p.server.url + "/generate", json=body, timeout=120))
        except httpx.HTTPError as e:
            got.append(e)

    t = threading.Thread(target=prefill, daemon=True)
    t.start()
    r = httpx.post(d.url + "/generate", json=body, timeout=120)
    t.join(120)
    assert got, "prefill did not answer in 120 s"
    return r, got[0]


def at_rest(*servers: ServerProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(load_at_rest(load(s)) for s in servers):
        assert time.monotonic() < deadline, [load(s) for s in servers]
        time.sleep(0.2)


def draft_rows(s: ServerProcess, width: int) -> set[bytes]:
    """The non-zero rows (`width` floats each) of a shm server's draft-K pool, read from its
    scheduler's segment /dev/shm/pdserve_<id>_<pid>_draft-k (with DP attention one per DP
    rank's scheduler: all of them)."""
    pids = spawned_children(s.proc.pid)
    names = [n for n in os.listdir("/dev/shm") if n.endswith("_draft-k")
             and any(f"_{pid}_" in n for pid in pids)]
    assert names, pids
    out: set[bytes] = set()
    for name in names:
        raw = np.fromfile(os.path.join("/dev/shm", name), dtype=np.float32)
        rows = raw[: len(raw) // width * width].reshape(-1, width)
        out |= {r.tobytes() for r in rows[np.abs(rows).sum(1) > 0]}
    return out


def segments(s: ServerProcess) -> list[str]:
    pids = spawned_children(s.proc.pid)
    return [n for n in os.listdir("/dev/shm") if any(f"_{pid}_" in n for pid in pids)]
