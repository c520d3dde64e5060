"""CPU placement of the engine's OpenMP threads (pdcore.runtime_env): the flag / variable
choose the CPUs and the wait policy; a real server's engine process gets exactly that affinity
and environment; `pdserve up` gives servers disjoint CPUs when there are enough."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdcore import runtime_env as rt
from pdcore.testing.processes import ServerProcess, spawned_children
from pdcore.up import UpConfig, plan


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in items}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PLACES",
                "OMP_PROC_BIND", rt.BIND_ENV, rt.DEFAULTED_ENV):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_cpu_lists_parse_and_bad_ones_say_what_is_expected() -> None:
    assert rt.parse_cpus("0-2,5") == [0, 1, 2, 5]
    assert rt.parse_cpus("1") == [1]
    for bad in ("", "x", "2-1", "-1", "0,,1"):
        with pytest.raises(rt.PlacementError, match="auto, all, nobind or a CPU list"):
            rt.parse_cpus(bad)


def test_auto_owns_every_available_cpu_and_spins(clean_env: pytest.MonkeyPatch) -> None:
    rt.apply()  # as the CLI does: PASSIVE by default, remembered as ours
    p = rt.choose_placement(None)
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    assert p.cpus == cpus and p.threads == len(cpus) and p.spin
    env = p.env()
    assert env["GOMP_SPINCOUNT"] == rt.SPIN_COUNT and env["OMP_WAIT_POLICY"] is None
    assert env["OMP_NUM_THREADS"] == str(len(cpus))
    assert env["OMP_PLACES"] == ",".join(f"{{{c}}}" for c in cpus)


def test_sharing_is_passive_and_user_values_win(clean_env: pytest.MonkeyPatch) -> None:
    for spec in ("all", "nobind"):
        p = rt.choose_placement(spec)
        assert p.cpus is None and not p.spin and p.env()["OMP_WAIT_POLICY"] == "PASSIVE"
    clean_env.setenv(rt.BIND_ENV, "nobind")  # the variable when no flag is given
    assert rt.choose_placement(None).cpus is None
    assert rt.choose_placement("auto").cpus is not None  # the flag wins over the variable
    clean_env.delenv(rt.BIND_ENV)
    clean_env.setenv("OMP_NUM_THREADS", "1")  # the user shares the box out by hand
    p = rt.choose_placement("auto")
    assert p.cpus is None and not p.spin and "OMP_NUM_THREADS" not in p.env()
    clean_env.setenv("GOMP_SPINCOUNT", "5")
    assert "GOMP_SPINCOUNT" not in rt.choose_placement("0").env()  # theirs is kept
    assert rt.choose_placement("auto", replicas=2).cpus is None
    shared = rt.choose_placement("0", replicas=2)  # TP ranks / DP replicas on one list
    assert shared.cpus == (0,) and "OMP_PLACES" not in shared.env()


def test_a_cpu_outside_the_affinity_is_refused(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(rt.PlacementError, match="not available to this process"):
        rt.choose_placement(str(max(os.sched_getaffinity(0)) + 1))


def test_a_child_started_inside_spawning_with_gets_the_placement(
        clean_env: pytest.MonkeyPatch) -> None:
    before = os.sched_getaffinity(0)
    code = ("import os; print(sorted(os.sched_getaffinity(0)), os.environ.get('GOMP_SPINCOUNT'),"
            " os.environ.get('OMP_WAIT_POLICY'))")
    with rt.spawning_with(rt.choose_placement("0")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                             timeout=60).stdout.split(maxsplit=1)[1].strip()
    assert out == f"{rt.SPIN_COUNT} None"
    assert os.sched_getaffinity(0) == before and "GOMP_SPINCOUNT" not in os.environ
    with rt.spawning_with(rt.choose_placement("nobind")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                             timeout=60).stdout
    assert out.strip() == f"{sorted(before)} None PASSIVE"


def test_up_gives_disjoint_cpus_when_there_are_enough(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(rt, "available_cpus", lambda: [0, 1, 2, 3])
    servers, _ = plan(UpConfig(prefill=1, decode=1), "tcp")
    binds = [s.argv[s.argv.index("--cpu-omp-threads-bind") + 1] for s in servers]
    assert binds == ["0,1", "2,3"] and all("own" in s.placement for s in servers)
    servers, _ = plan(UpConfig(prefill=2, decode=3), "tcp")  # 5 servers, 4 CPUs: shared
    for s in servers:
        assert s.argv[s.argv.index("--cpu-omp-threads-bind") + 1] == "nobind"
        assert s.env["OMP_NUM_THREADS"] == "1" and "shares" in s.placement
    servers, _ = plan(UpConfig(serve_args=["--cpu-omp-threads-bind", "3"]), "tcp")
    assert all(s.argv.count("--cpu-omp-threads-bind") == 1 for s in servers)


@pytest.fixture(scope="module")
def bound_server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    if "OMP_NUM_THREADS" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        pytest.skip("this test process has OMP_NUM_THREADS/GOMP_SPINCOUNT set: a server "
                    "keeps the user's values")
    # CI exports OMP_WAIT_POLICY=PASSIVE for every process (scripts/test.sh); a server keeps a
    # wait policy the user set, so this one starts without it, as a user's shell would
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OMP_WAIT_POLICY", raising=False)
        s = ServerProcess("--model-path", str(tiny_llama_dir), "--max-total-tokens", "2048",
                          "--cpu-omp-threads-bind", str(min(os.sched_getaffinity(0))))
    try:
        yield s.wait_healthy(180)
    finally:
        s.stop()


def test_a_servers_engine_runs_on_its_cpus_with_a_bounded_spin(
        bound_server: ServerProcess) -> None:
    cpu = min(os.sched_getaffinity(0))
    (engine,) = spawned_children(bound_server.proc.pid)
    assert os.sched_getaffinity(engine) == {cpu}
    env = _environ(engine)
    assert env["GOMP_SPINCOUNT"] == rt.SPIN_COUNT and env["OMP_NUM_THREADS"] == "1"
    assert env["OMP_PLACES"] == f"{{{cpu}}}" and "OMP_WAIT_POLICY" not in env
    info = httpx.get(bound_server.url + "/server_info", timeout=10).json()
    assert info["cpu_placement"].startswith(f"CPUs {cpu}, 1 OpenMP threads, bounded spin")
    r = httpx.post(bound_server.url + "/generate", json={
        "text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4


def test_a_cpu_the_machine_lacks_exits_2() -> None:
    bad = str(max(os.sched_getaffinity(0)) + 1)
    r = subprocess.run([sys.executable, "-m", "pdcore", "serve", "--load-format", "dummy",
                        "--cpu-omp-threads-bind", bad], capture_output=True, text=True, check=False,
                       timeout=120)
    assert r.returncode == 2 and "not available to this process" in r.stderr
