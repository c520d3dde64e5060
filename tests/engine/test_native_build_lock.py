"""The native library is built once per machine: two processes that need it at the same moment
(two servers starting together) run the compiler once; the second logs that it waits for the
first and loads the library the first built. The compiler here is a stand-in script (CXX) that
counts its runs and takes a second, so the two processes really overlap."""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from pdcore.engine import native
from pdcore.testing.processes import pid_alive

FAKE_CXX = """#!/bin/sh
echo "$$" >> "{runs}"
sleep 1.5
for last; do :; done
echo built > "$last"
"""


def _stand_in_compiler(script: str, tmp_path: Path, monkeypatch) -> None:
    """CXX is `script`; the libraries go under tmp_path/native."""
    cxx = tmp_path / "fake-g++"
    cxx.write_text(script)
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path / "native"))


def _build_in_child(isa: str, log_file: str, start: multiprocessing.synchronize.Event) -> None:
    handler = logging.FileHandler(log_file)
    native.log.addHandler(handler)
    native.log.setLevel(logging.INFO)
    start.wait(10)
    try:
        print(native._build(isa), file=open(log_file + ".out", "w"))
    finally:
        handler.close()


def test_two_processes_build_once_and_the_second_waits(tmp_path: Path, monkeypatch) -> None:
    runs = tmp_path / "runs"
    _stand_in_compiler(FAKE_CXX.format(runs=runs), tmp_path, monkeypatch)
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    logs = [str(tmp_path / f"p{i}.log") for i in range(2)]
    procs = [ctx.Process(target=_build_in_child, args=("avx2", f, start)) for f in logs]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(runs.read_text().split()) == 1, "the compiler ran more than once"
    texts = [Path(f).read_text() for f in logs]
    waited = [t for t in texts if "waiting for another process that is building" in t]
    assert len(waited) == 1, texts
    assert "built by another process meanwhile" in waited[0]
    outs = {Path(f + ".out").read_text().strip() for f in logs}
    assert len(outs) == 1 and Path(outs.pop()).read_text() == "built\n"
    # a third start finds the library: no compiler run, no lock wait
    native._build("avx2")
    assert len(runs.read_text().split()) == 1
    assert not [f for f in os.listdir(tmp_path / "native") if f.startswith("building-")]


HANGING_CXX = """#!/bin/sh
sleep 120 &
echo "$!" > "{child}"
wait
"""


def test_a_build_past_its_timeout_leaves_no_compiler_running(tmp_path: Path, monkeypatch) -> None:
    """g++ runs cc1plus as a child: a timeout that kills only g++ left cc1plus compiling on,
    orphaned, for minutes (s9: two found on a loaded box). The whole compiler group goes."""
    child = tmp_path / "child"
    _stand_in_compiler(HANGING_CXX.format(child=child), tmp_path, monkeypatch)
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match="did not finish in 1 s"):
        native._build("avx2")
    pid = int(child.read_text())
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid), "the compiler's child outlived the build's timeout"
    assert not [f for f in os.listdir(tmp_path / "native") if f.startswith("building-")]
