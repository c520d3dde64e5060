"""Real server processes on loopback for end-to-end tests: one server, or a whole PD cluster
(N prefill + M decode + router) with kill / restart helpers for fault tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdcore.config import ADMIN_KEY_ENV, CLUSTER_SECRET_ENV, HOST_SERVERS_ENV
from pdcore.env import ENV, Env, child_environ
from pdcore.runtime.lifeline import popen_session
from pdcore.runtime_env import server_threads
from pdcore.testing.pages import load_at_rest
from pdcore.testing.ports import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
KEEP_LOGS_ENV = Env.pdcore_keep_test_logs.name  # 1: a stopped server's temp folder and log stay
# the admin key every test server and router gets unless a test says otherwise (admin routes
# are off without one): tests that flush caches or start profiles send ADMIN_HEADERS
TEST_ADMIN_KEY = "pdserve-test-admin-key"
ADMIN_HEADERS = {"authorization": f"Bearer {TEST_ADMIN_KEY}"}


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


class ServerProcess:
    """`python -m pdcore serve <flags>` (or another module) on 127.0.0.1:<port>, in its own
    session (so its process group is the server's whole tree, killed as one on stop) and
    killed by the kernel when the test process dies. The death signal follows the thread that
    started the server: start servers from the main thread or a thread that outlives them.

    Its log lies in a temp folder of its own that is also the server's TMPDIR (IPC sockets,
    exported tokenizer; an env TMPDIR of the test's own wins): at stop the log is read into
    memory and the folder removed, so a test run leaves nothing behind even when the server
    was SIGKILLed (PDCORE_KEEP_TEST_LOGS=1 keeps it).

    It gets `admin_key` as $PDSERVE_ADMIN_API_KEY (default TEST_ADMIN_KEY; None: no admin key,
    the admin routes are off); `admin_headers` carries it."""

    def __init__(self, *flags: str, port: int | None = None, env: dict[str, str] | None = None,
                 command: tuple[str, ...] = ("-m", "pdcore", "serve"),
                 admin_key: str | None = TEST_ADMIN_KEY) -> None:
        self.flags, self.command, self.extra_env = flags, command, env or {}
        self.admin_key = admin_key
        self.admin_headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="pdserve-test-"))
        self.log_path = self.tmp_dir / "server.log"
        self._earlier_log = ""  # what stopped runs logged (their file is gone)
        self.proc: subprocess.Popen | None = None
        self.start()

    def loads(self) -> list[dict[str, Any]]:
        """Its /get_load: one entry per DP rank."""
        r = httpx.get(self.url + "/get_load", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def start(self) -> ServerProcess:
        env = child_environ({"TMPDIR": str(self.tmp_dir), **self.extra_env})
        env.pop(ADMIN_KEY_ENV, None)
        if self.admin_key:
            env[ADMIN_KEY_ENV] = self.admin_key
        self.tmp_dir.mkdir(exist_ok=True)  # again after a stop
        cwd = None
        if (REPO_ROOT / "pyproject.toml").is_file():  # a checkout, not an installed package
            env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT),
                                                 *filter(None, [env.get("PYTHONPATH")])])
            cwd = str(REPO_ROOT)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # the preexec_fn only calls prctl, getppid and _exit: safe in a threaded parent; the
        # server's session gets this process's nice (a nice test or bench reaches it only so)
        self.proc = popen_session(
            [sys.executable, *self.command, "--host", "127.0.0.1", "--port", str(self.port),
             *self.flags], signal.SIGKILL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            cwd=cwd)
        return self

    def log(self) -> str:
        try:
            return self._earlier_log + self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return self._earlier_log

    def _close_log(self) -> None:
        self._log.close()
        if ENV.pdcore_keep_test_logs:
            return
        self._earlier_log = self.log()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

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
        self._close_log()

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
        self._close_log()
        return None if self.proc is None else self.proc.returncode


def trust_prefill(decode_url: str, *bootstrap_ports: int, host: str = "127.0.0.1") -> None:
    """Tell a decode server (started by hand, no router in front) to accept routes to these
    prefill bootstrap ports, as `pdserve router` does for its workers."""
    r = httpx.post(decode_url + "/disaggregation/trusted_prefill", timeout=10,
                   json={"add": [f"{host}:{p}" for p in bootstrap_ports]},
                   headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text


class PDCluster:
    """N prefill + M decode `pdserve serve` processes and a router (ours by default)."""

    def __init__(self, backend: str | None = "tcp", prefill: int = 1, decode: int = 1,
                 model_path: str | None = None, flags: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, *, router: str = "pdcore",
                 prefill_flags: tuple[str, ...] = (), decode_flags: tuple[str, ...] = (),
                 policy: str = "round_robin", secret: str | None = None,
                 router_flags: tuple[str, ...] = (),
                 prefill_command: tuple[str, ...] = ("-m", "pdcore", "serve"),
                 api_key: str | None = None) -> None:
        """Route trust (pdcore.route_auth) as a deployment would set it up: with `secret` every
        process shares it (our router signs routes); without, our router registers the prefill
        addresses with the decode servers, and behind sglang-router (which does neither) the
        decode servers get --disaggregation-trusted-prefill. `prefill_command` runs the prefill
        servers (a test hook such as pdcore.testing.held_transfer). `api_key`: every server and
        the router take it (`headers` carry it for the helpers' own calls)."""
        self.env = dict(env or {})
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if api_key:
            flags, router_flags = (*flags, "--api-key", api_key), (*router_flags, "--api-key",
                                                                    api_key)
        if secret:
            self.env[CLUSTER_SECRET_ENV] = secret
        self.policy = policy  # our router's --policy (prefix-cache tests compare policies)
        self.router_flags = router_flags  # more flags for the router
        threads = server_threads(prefill + decode)  # the engines share this host's CPUs
        if threads is not None:
            self.env.setdefault("OMP_NUM_THREADS", str(threads))
        # and its memory, as `pdserve up` shares it: without a pool size in the flags, a cluster
        # of N servers takes the KV memory of one (several suites run side by side in CI)
        sized = any(f.startswith(("--max-total-tokens", "--mem-fraction-static"))
                    for f in (*flags, *prefill_flags, *decode_flags))
        if not sized and prefill + decode > 1:
            self.env.setdefault(HOST_SERVERS_ENV, str(prefill + decode))
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
                "--disaggregation-bootstrap-port", str(bport), env=self.env,
                command=prefill_command))
        if router == "sglang" and not secret:
            decode_flags = (*decode_flags, "--disaggregation-trusted-prefill",
                            ",".join(f"127.0.0.1:{b}" for b in self.bootstrap_ports))
        self.decodes = [ServerProcess(*common, "--disaggregation-mode", "decode", *decode_flags,
                                      env=self.env) for _ in range(decode)]
        self.secret = secret
        self.router_kind = router
        self.router: ServerProcess | None = None

    def start(self, timeout: float = 600.0) -> PDCluster:
        try:
            for s in self.prefills + self.decodes:
                s.wait_healthy(timeout)
            self.router = self._start_router()
            self.router.wait_healthy(120)
            if self.router_kind != "sglang" and not self.secret:
                self.wait_trusted()
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
        return ServerProcess(*args, *self.router_flags, command=cmd, env=self.env)

    def wait_trusted(self, timeout: float = 60.0) -> None:
        """Until every decode server accepts routes to every prefill server (our router
        registers them a moment after it starts)."""
        want = {f"127.0.0.1:{b}" for b in self.bootstrap_ports}
        deadline = time.monotonic() + timeout
        for d in self.decodes:
            while True:
                r = httpx.get(d.url + "/disaggregation/trusted_prefill", headers=self.headers,
                              timeout=10)
                if r.status_code == 200 and want <= set(r.json()["trusted"]):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"decode {d.url} still does not trust {want}: {r.text}")
                time.sleep(0.1)

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def load(self, server: ServerProcess) -> dict[str, Any]:
        return httpx.get(server.url + "/get_load", headers=self.headers, timeout=10).json()[0]

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
