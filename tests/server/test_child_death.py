"""A child started with preexec_die_with_parent dies when its starter is SIGKILLed (what keeps
`pdserve up`'s servers from outliving it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdcore.testing.processes import pid_alive

STARTER = """
import subprocess, sys, time
from pdcore.runtime.lifeline import preexec_die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True, preexec_fn=preexec_die_with_parent())
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_child_gets_sigterm_when_its_starter_is_killed() -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(starter.stdout.readline())
        assert pid_alive(child)
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child), "the child outlived its killed starter"
    finally:
        starter.kill()


NICE_STARTER = """
import subprocess, sys
from pdcore.testing.processes import ServerProcess
with open("/proc/self/autogroup", "w") as f:  # this session's weight: nice 3 (no privilege)
    f.write("3")
server = ServerProcess(command=("-c", "import time; time.sleep(120)"))
plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
print(server.proc.pid, plain.pid, flush=True)
try:
    sys.stdin.read()  # until the test closes it
finally:
    plain.kill()
    server.stop()
"""


def _autogroup_nice(pid: int) -> int:
    with open(f"/proc/{pid}/autogroup") as f:  # "/autogroup-123 nice 5"
        return int(f.read().split()[-1])


def _autogroups_on() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(not _autogroups_on(),
                    reason="the kernel's autogroups are off: a session has no nice of its own")
def test_a_server_in_its_own_session_keeps_its_starters_nice() -> None:
    """With autogroups, a new session is a scheduling group at nice 0 whatever its starter's
    group: ServerProcess (and `pdserve up`) carry the starter session's nice to it
    (lifeline.carry_nice); a plain start_new_session child shows what happens without."""
    starter = subprocess.Popen([sys.executable, "-c", NICE_STARTER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        server, plain = map(int, starter.stdout.readline().split())
        assert _autogroup_nice(server) == 3
        assert _autogroup_nice(plain) == 0, "autogroups no longer reset a session's nice?"
    finally:
        starter.stdin.close()  # it stops both children
        try:
            starter.wait(30)
        finally:
            starter.kill()


STUCK_STARTER = """
import multiprocessing, sys, threading, time
from pdcore.runtime import lifeline

def scheduler(folder):  # what run_scheduler_process registers, and a stop that never comes
    lifeline.when_parent_lost(lambda: lifeline.remove_ipc_sockets(
        f"ipc://{folder}/to_scheduler", f"ipc://{folder}/from_scheduler"))
    lifeline.ParentWatch(lambda: None, "stuck", grace_s=0.5).start()
    print("ready", flush=True)
    threading.Event().wait(120)

if __name__ == "__main__":
    multiprocessing.get_context("fork").Process(target=scheduler, args=(sys.argv[1],)).start()
    time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_scheduler_stuck_in_its_stop_still_removes_the_socket_folder(tmp_path) -> None:
    """The HTTP process SIGKILLed, its scheduler's stop slower than ParentWatch's grace: the
    hard exit skips every `finally`, so the socket folder goes first (when_parent_lost), not
    last (CI stop 54 found a folder left behind under load)."""
    folder = tmp_path / "pdserve-ipc-x"
    folder.mkdir()
    for name in ("to_scheduler", "from_scheduler"):
        (folder / name).touch()
    starter = subprocess.Popen([sys.executable, "-c", STUCK_STARTER, str(folder)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout.readline().strip() == "ready"
        assert folder.exists()  # nothing removed while the parent lives
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 20
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not folder.exists(), f"left behind: {sorted(p.name for p in folder.iterdir())}"
    finally:
        starter.kill()


def test_spawned_children_start_no_resource_tracker() -> None:
    """no_resource_tracker (called before the engine and TP ranks are spawned): spawn starts
    no multiprocessing resource tracker beside the child (a Python process of its own, 6.4
    MiB resident per server, #48), and the child still starts, runs and exits. Without it the
    same script has a tracker child."""
    from pathlib import Path

    code = """
import multiprocessing, os, sys, time
from pdcore.runtime.lifeline import no_resource_tracker
if sys.argv[1] == "off":
    assert no_resource_tracker()
p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0.5,))
p.start()
kids = []
for e in os.listdir("/proc"):
    try:
        with open(f"/proc/{e}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{e}/cmdline", "rb") as f:
            cmd = f.read()
    except (OSError, ValueError):
        continue
    if ppid == os.getpid():
        kids.append("tracker" if b"resource_tracker" in cmd else "child")
p.join(30)
print(sorted(kids), p.exitcode)
"""
    root = Path(__file__).resolve().parents[2]
    for mode, want in (("off", "['child'] 0"), ("on", "['child', 'tracker'] 0")):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                             timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want, (mode, out.stdout, out.stderr)
