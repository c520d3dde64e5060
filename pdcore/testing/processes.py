"""Real server processes on loopback for end-to-end tests: one server, or a whole PD cluster
(N prefill + M decode + router) with kill / restart helpers for fault tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pdcore.runtime.lifeline import preexec_die_with_parent
from pdcore.runtime_env import server_threads
from pdcore.testing.pages import load_at_rest

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()
LOWEST_PORT = 20000



def spawned_children(pid: int) -> list[int]:
    """Pids of the processes that multiprocessing spawned under `pid` (its scheduler, TP ranks;
    not its resource tracker), read from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server started later. Taken below the kernel's
    ephemeral range: a port from bind(0) comes from that range, and between this check and the
    server's bind the kernel may give it to any outgoing connection (a 2P2D test once lost its
    bootstrap port that way). Never the same port twice in one process."""
    low = _ephemeral_low()
    with _PORTS_LOCK:
        for _ in range(200 if low > LOWEST_PORT + 1000 else 0):
            port = random.randrange(LOWEST_PORT, low)
            if port in _PORTS_GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _PORTS_GIVEN.add(port)
            return port
        with socket.socket() as s:  # no room below the ephemeral range: the kernel's pick
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        _PORTS_GIVEN.add(port)
        return port


class ServerProcess:
    """`python -m pdcore serve <flags>` (or another module) on 127.0.0.1:<port>, log in a
    temp file, in its own session (so its process group is the server's whole tree, killed as
    one on stop) and killed by the kernel when the test process dies. The death signal follows
    the thread that started the server: start servers from the main thread or a thread that
    outlives them."""

    def __init__(self, *flags: str, port: int | None = None, env: dict[str, str] | None = None,
                 command: tuple[str, ...] = ("-m", "pdcore", "serve")) -> None:
        self.flags, self.command, self.extra_env = flags, command, env or {}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="pdserve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.start()

    def loads(self) -> list[dict[str, Any]]:
        """Its /get_load: one entry per DP rank."""
        r = httpx.get(self.url + "/get_load", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def start(self) -> ServerProcess:
        env = {**os.environ, **self.extra_env}
        cwd = None
        if (REPO_ROOT / "pyproject.toml").is_file():  # a checkout, not an installed package
            env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT),
                                                 *filter(None, [env.get("PYTHONPATH")])])
            cwd = str(REPO_ROOT)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, *self.command, "--host", "127.0.0.1", "--port", str(self.port),
             *self.flags], stdout=self._log, stderr=subprocess.STDOUT, env=env,
            # the preexec_fn only calls prctl, getppid and _exit: safe in a threaded parent
            cwd=cwd, start_new_session=True, preexec_fn=preexec_die_with_parent(signal.SIGKILL))  # noqa: PLW1509
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout: float = 300.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.command} exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"not healthy after {timeout}s:\n{self.log()[-4000:]}")

    def kill(self) -> None:
        """SIGKILL the whole process group (server and scheduler): a crash."""
        if self.alive():
            self._kill_group()
            self.proc.wait(10)
        self._log.close()

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_group()
                self.proc.wait(10)
        if self.proc is not None:
            self._kill_group()  # stragglers of the group
        self._log.close()
        return None if self.proc is None else self.proc.returncode


class PDCluster:
    """N prefill + M decode `pdserve serve` processes and a router (ours by default)."""

    def __init__(self, backend: str | None = "tcp", prefill: int = 1, decode: int = 1,
                 model_path: str | None = None, flags: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, router: str = "pdcore",
                 prefill_flags: tuple[str, ...] = (), decode_flags: tuple[str, ...] = (),
                 policy: str = "round_robin") -> None:
        self.env = dict(env or {})
        self.policy = policy  # our router's --policy (prefix-cache tests compare policies)
        threads = server_threads(prefill + decode)  # the engines share this host's CPUs
        if threads is not None:
            self.env.setdefault("OMP_NUM_THREADS", str(threads))
        # backend None: the servers choose their default (mooncake where installed, else tcp)
        common = (*(("--disaggregation-transfer-backend", backend) if backend else ()), *flags)
        if model_path:
            common += ("--model-path", str(model_path))
        self.prefills = []
        self.bootstrap_ports = []
        for _ in range(prefill):
            bport = free_port()
            self.bootstrap_ports.append(bport)
            self.prefills.append(ServerProcess(
                *common, "--disaggregation-mode", "prefill", *prefill_flags,
                "--disaggregation-bootstrap-port", str(bport), env=self.env))
        self.decodes = [ServerProcess(*common, "--disaggregation-mode", "decode", *decode_flags,
                                      env=self.env) for _ in range(decode)]
        self.router_kind = router
        self.router: ServerProcess | None = None

    def start(self, timeout: float = 600.0) -> PDCluster:
        try:
            for s in self.prefills + self.decodes:
                s.wait_healthy(timeout)
            self.router = self._start_router()
            self.router.wait_healthy(120)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_router(self) -> ServerProcess:
        args: list[str] = ["--pd-disaggregation", "--policy", self.policy]
        for s, b in zip(self.prefills, self.bootstrap_ports):
            args += ["--prefill", s.url, str(b)]
        for s in self.decodes:
            args += ["--decode", s.url]
        if self.router_kind == "sglang":
            cmd = ("-m", "sglang_router.launch_router")
            args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        else:
            cmd = ("-m", "pdcore.router")
            args += ["--health-check-interval-secs", "1"]
        return ServerProcess(*args, command=cmd, env=self.env)

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def load(self, server: ServerProcess) -> dict[str, Any]:
        return httpx.get(server.url + "/get_load", timeout=10).json()[0]

    def wait_pages_free(self, timeout: float = 30.0) -> None:
        """Every server's KV pool back to its full free count (asserts)."""
        deadline = time.monotonic() + timeout
        while True:
            loads = [self.load(s) for s in self.prefills + self.decodes if s.alive()]
            if all(load_at_rest(x) for x in loads):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"KV pages not back to free: {loads}")
            time.sleep(0.2)

    def stop(self) -> None:
        for s in ([self.router] if self.router else []) + self.prefills + self.decodes:
            s.stop()
