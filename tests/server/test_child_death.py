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
