"""#48 follow-up: a server hands its free KV pages back only once its engine has been idle
PDSERVE_KV_GIVEBACK_IDLE_S seconds (engine/kv/giveback.py's IdleTimer in rank 0's scheduler
loop), so bursty traffic does not re-fault at every burst the pages it gave back at each short
gap; and every TP rank gives its own pool's pages back (the lockstep header tells the others).
The server test crosses the process boundary: a TP 2 unified server, requests closer than the
threshold for longer than it, then a longer idle."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from pdcore.engine.kv.giveback import IdleTimer
from pdcore.env import Env, EnvError
from pdcore.testing.processes import ServerProcess
from pdcore.testing.tiny_models import make_tiny_model

GIVEN = "kv_pages_given_back_bytes_total"


def test_the_idle_timer_is_due_once_an_idle_lasts_its_minimum() -> None:
    t = IdleTimer(1.0)
    assert t.due(0.0) is None  # never idle yet
    for start in (0.0, 0.5, 1.0, 1.5, 2.0):  # a request every 0.5 s, each idle 0.4 s
        t.idle(start)
        assert t.due(start) is None and t.due(start + 0.4) is None
        t.busy()
        assert t.due(start + 5.0) is None  # busy: an old idle start counts for nothing
    t.idle(3.0)
    assert t.due(3.99) is None
    assert t.due(4.25) == pytest.approx(1.25)  # the gap, once
    assert t.due(9.0) is None  # given back already this idle
    t.idle(10.0)
    assert t.due(11.0) == pytest.approx(1.0)
    zero = IdleTimer(0.0)
    zero.idle(7.0)
    assert zero.due(7.0) == 0.0  # 0: at the first idle poll, as before the minimum existed


def test_the_minimum_idle_knob_reads_seconds_at_least_zero() -> None:
    assert Env({}).pdserve_kv_giveback_idle_s == 2.0
    assert Env({"PDSERVE_KV_GIVEBACK_IDLE_S": "0"}).pdserve_kv_giveback_idle_s == 0.0
    assert Env({"PDSERVE_KV_GIVEBACK_IDLE_S": " 2.5 "}).pdserve_kv_giveback_idle_s == 2.5
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(EnvError, match="PDSERVE_KV_GIVEBACK_IDLE_S"):
            Env({"PDSERVE_KV_GIVEBACK_IDLE_S": bad}).pdserve_kv_giveback_idle_s


def _given(server: ServerProcess) -> int:
    load = server.loads()[0]
    assert GIVEN in load, sorted(load)
    return int(load[GIVEN])


def _gave(log: str) -> list[tuple[int, int, float]]:
    """(rank, bytes, idle gap in s) of every give-back the server's ranks logged."""
    return [(int(r), int(b), float(g)) for r, b, g in re.findall(
        r"rank (\d) gave (\d+) bytes of free KV pages back to the kernel after ([\d.]+) s idle",
        log)]


def test_a_tp2_server_gives_back_after_the_minimum_idle_on_every_rank(tmp_path) -> None:
    """Threshold 2 s. Requests 0.1 s apart for 2.5 s (the burst longer than the threshold): no
    give-back comes at a gap shorter than it (before: at the first idle poll after each
    request; a box starved enough to stretch a gap past 2 s may give back there, with that gap
    logged). Then an idle: rank 0's bytes reach /get_load, and both ranks log their bytes and
    an idle gap of at least 2 s (before: rank 1, which follows rank 0's headers and never
    polled idle, gave nothing back)."""
    from pdcore.engine.model.tokenizer import default_model_file

    # 2 KV heads x 64 on 2 ranks: a 16-position page of one head is 4 KiB, one OS page
    model = make_tiny_model(str(tmp_path / "m"), hidden=256, heads=4, kv_heads=2, seed=3,
                            tokenizer_from=default_model_file())
    server = ServerProcess("--model-path", model, "--tp-size", "2", "--max-total-tokens", "4096",
                           "--page-size", "16", "--disable-radix-cache", "--log-level", "debug",
                           env={"PDSERVE_KV_GIVEBACK_IDLE_S": "2.0"})
    try:
        server.wait_healthy(400)
        body = {"input_ids": list(range(3, 203)),
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
        end = time.monotonic() + 2.5
        n = 0
        while time.monotonic() < end or n < 3:
            r = httpx.post(server.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            n += 1
            time.sleep(0.1)
        burst = _gave(server.log())
        assert all(gap >= 2.0 for _, _, gap in burst), burst
        assert _given(server) == sum(b for rank, b, _ in burst if rank == 0)
        deadline = time.monotonic() + 30
        while _given(server) == sum(b for rank, b, _ in burst if rank == 0) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        given = _given(server)
        deadline = time.monotonic() + 10  # rank 1 acts at the next header, 50 ms later
        while sum(rank == 1 for rank, _, _ in _gave(server.log())) <= \
                sum(rank == 1 for rank, _, _ in burst) and time.monotonic() < deadline:
            time.sleep(0.2)
        log = server.log()
    finally:
        server.stop()
    lines = _gave(log)
    after = lines[len(burst):]
    assert {rank for rank, _, _ in after} == {0, 1}, (burst, lines)
    assert all(gap >= 2.0 and b > 0 for _, b, gap in lines), lines
    assert sum(b for rank, b, _ in lines if rank == 0) == given > 0
    assert "[tp1]" in log
