"""Engine processes never outlive their parent, and a stuck step ends its process.

1. `die_with_parent()`: on Linux the kernel sends SIGTERM to this process when its parent dies
   (PR_SET_PDEATHSIG); it also checks the parent did not die before that was set
   (`preexec_die_with_parent()` does the same for a child started with subprocess); and it
   leaves Ctrl-C to the parent (SIGINT ignored: a terminal sends it to the whole process group,
   and the parent's shutdown stops this child; before, each engine process printed a
   KeyboardInterrupt traceback);
2. `ParentWatch`: a thread that compares the parent pid every half second, so the check runs
   while the main thread is busy in a long step or blocked in C code; when the parent is gone
   it asks the loop to stop and, if that has not ended the process after a grace period, exits
   hard (a child must never keep a port or memory of a server that is gone);
3. `StepWatchdog`: the scheduler loop marks the start and end of each step; a step that runs
   longer than --watchdog-timeout is logged with the main thread's stack and the process exits
   with EXIT_WATCHDOG, so the HTTP process fails the in-flight requests and exits too.
4. `popen_session`: a child in a session of its own, with 1.'s death signal and the scheduling
   weight of this process's session (`carry_nice`: with the kernel's autogroups a session's
   weight, not a process's nice, decides its share against other sessions).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5
STOP_GRACE_S = 5.0
EXIT_PARENT_GONE = 70  # the scheduler's exit codes the HTTP process explains
EXIT_WATCHDOG = 71


def parent_pid() -> int:
    """The pid of the process that spawned this one (multiprocessing knows it even when the
    parent already died and this process was re-parented)."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid else os.getppid()


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for `sig` when the parent dies; True when that is set up (Linux). Ctrl-C
    (SIGINT) is the parent's to handle: ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid():  # the parent died before prctl: the signal never comes
        os.kill(os.getpid(), sig)
    return True


IPC_DIR_PREFIX = "pdserve-ipc-"  # the HTTP process's private (0700) socket folder: runtime/handle


def remove_ipc_sockets(*addrs: str) -> None:
    """The scheduler removes its socket files, and the folder once empty, when it stops.

    The HTTP process removes the folder on its own stop; SIGKILLed (the OOM killer) it cannot.
    The scheduler cannot reliably tell that its parent is gone: a SIGKILLed multi-threaded
    parent sends die_with_parent's SIGTERM once per exiting thread while getppid() still names
    it, so the scheduler may finish its whole stop before it is re-parented. It does not need
    to: a scheduler never restarts into the same folder (its death ends the server), so its
    stop is always the end of these sockets. Only inside a folder named IPC_DIR_PREFIX..."""
    for addr in addrs:
        path = addr.removeprefix("ipc://")
        folder = os.path.dirname(path)
        if addr.startswith("ipc://") and os.path.basename(folder).startswith(IPC_DIR_PREFIX):
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # once both sockets are gone


_parent_lost_hooks: list[Callable[[], None]] = []


def when_parent_lost(hook: Callable[[], None]) -> None:
    """Run `hook` in this process as soon as a ParentWatch sees the parent gone, before the
    (possibly slow) stop it asks for and before any hard exit: what only matters while the
    parent lives (its socket files) goes first, whatever happens to the rest of the shutdown."""
    _parent_lost_hooks.append(hook)


_libc: ctypes.CDLL | None = None


@contextlib.contextmanager
def interrupts_ignored_by_children():
    """Processes started in the block begin with SIGINT ignored (they inherit it, and Python
    keeps an inherited SIG_IGN), so a Ctrl-C that reaches the whole process group while a
    spawned engine process is still importing does not kill it with a traceback; the parent
    stops it. Only the main thread can change handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def no_resource_tracker() -> bool:
    """Spawn this process's children without multiprocessing's resource tracker, a Python
    process of its own that spawn starts beside the first child (6.4 MiB resident per server,
    #48) to unlink the named semaphores and shared memory multiprocessing made if their
    process dies. pdserve makes none (its segments are its own, builtin/shm_segment.py; the
    loader gives tqdm a thread lock): the tracker's end of the pipe is /dev/null, so a child's
    register / unregister messages go nowhere. Nothing changes where a tracker already runs
    (started by something else in this process). False where this Python's multiprocessing
    has no such attributes (then spawn starts its tracker as before)."""
    try:
        from multiprocessing import resource_tracker

        tracker = resource_tracker._resource_tracker
        with tracker._lock:
            if tracker._fd is None:
                tracker._fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        return True
    except (AttributeError, OSError):
        return False


def preexec_die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the kernel sends `sig` to the child when the thread
    that started it (keep that the main thread) dies. libc is loaded here, in the parent: between
    fork and exec the child only calls prctl, getppid and _exit. None off Linux."""
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    libc, parent = _libc, os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: the signal never comes
            os._exit(1)

    return preexec

def carry_nice(pid: int) -> None:
    """Give the session of child `pid` (started with start_new_session) the scheduling weight
    of this process's session. With the kernel's autogroups on
    (/proc/sys/kernel/sched_autogroup_enabled), each session is one scheduling group, nice 0
    unless /proc/<pid>/autogroup says otherwise, and a task's own nice only ranks it inside its
    group: a server in a session of its own competes as nice 0 with every other session, and a
    timing run that raised its session's weight would otherwise leave its servers unboosted.
    (A process's own nice is not carried: a `nice -n 19` test in a nice-0 session would starve
    its servers against everyone else's nice-0 sessions.) A no-op off Linux, where the group
    is at nice 0, or where the kernel refuses the write."""
    if not sys.platform.startswith("linux"):
        return
    try:
        with open("/proc/self/autogroup") as f:  # "/autogroup-12 nice 0"
            nice = int(f.read().split()[-1])
        if nice:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(nice))
    except (OSError, ValueError, IndexError) as e:  # no autogroups, the child gone, or no
        log.debug("session nice not carried to pid %d: %s", pid, e)  # CAP_SYS_NICE for < 0


def lower_own_priority(by: int, pid: int | str = "self") -> int:
    """Raise the nice of every thread of this process (or of `pid`) by `by` (at most to 19); the
    number of threads changed. Linux keeps a nice per thread (setpriority on the process id
    changes the main thread only) and a new thread starts with its starter's, so threads started
    later follow. Processes started before keep theirs; those started after inherit it."""
    if by <= 0 or not sys.platform.startswith("linux"):
        return 0
    done = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            now = os.getpriority(os.PRIO_PROCESS, int(tid))
            os.setpriority(os.PRIO_PROCESS, int(tid), min(19, now + by))
            done += 1
        except OSError:  # a thread that ended meanwhile
            continue
    return done


def popen_session(argv: list[str], sig: int = signal.SIGTERM, **kw: Any) -> subprocess.Popen:
    """subprocess.Popen(argv, **kw) in a session of its own (its process group is its whole
    tree), sent `sig` when the starting thread dies (preexec_die_with_parent) and given this
    process's nice (carry_nice)."""
    proc = subprocess.Popen(argv, start_new_session=True,  # noqa: PLW1509 - see preexec's doc
                            preexec_fn=preexec_die_with_parent(sig), **kw)
    carry_nice(proc.pid)
    return proc


class ParentWatch:
    def __init__(self, on_lost: Callable[[], None], name: str, grace_s: float = STOP_GRACE_S
                 ) -> None:
        self.parent = parent_pid()
        self.on_lost, self.name, self.grace_s = on_lost, name, grace_s
        self.lost = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-parent-watch",
                                        daemon=True)

    def start(self) -> ParentWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(PARENT_POLL_S):
            if os.getppid() == self.parent:
                continue
            self.lost.set()
            log.warning("%s: parent process %d exited; stopping", self.name, self.parent)
            for hook in list(_parent_lost_hooks):
                try:
                    hook()
                except Exception:  # noqa: BLE001 - a cleanup must not keep the stop from coming
                    log.exception("%s: a parent-lost cleanup failed", self.name)
            self.on_lost()
            if not self._done.wait(self.grace_s):
                log.error("%s: still running %.0fs after its parent exited; exiting now",
                          self.name, self.grace_s)
                logging.shutdown()
                os._exit(EXIT_PARENT_GONE)
            return


class StepWatchdog:
    """Ends the process when one step runs longer than `timeout_s` (0 or less: off)."""

    def __init__(self, timeout_s: float, name: str = "scheduler") -> None:
        self.timeout_s, self.name = timeout_s, name
        self._started: float | None = None
        self._what = ""
        self._main = threading.main_thread().ident
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-watchdog", daemon=True)

    def start(self) -> StepWatchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()

    def begin(self, what: str) -> None:
        self._what, self._started = what, time.monotonic()

    def end(self) -> None:
        self._started = None

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._done.wait(period):
            started = self._started
            if started is None or time.monotonic() - started <= self.timeout_s:
                continue
            frame = sys._current_frames().get(self._main)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            log.error("%s: step stuck for more than --watchdog-timeout %gs (%s); exiting so "
                      "the server fails its requests and can be restarted. Stack:\n%s",
                      self.name, self.timeout_s, self._what, stack)
            logging.shutdown()
            os._exit(EXIT_WATCHDOG)


def describe_exit(code: int | None) -> str:
    """Why a scheduler process ended, from its exit code (for the HTTP process's errors)."""
    if code == EXIT_WATCHDOG:
        return "a scheduler step hung longer than --watchdog-timeout"
    if code == EXIT_PARENT_GONE:
        return "its parent process exited"
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
