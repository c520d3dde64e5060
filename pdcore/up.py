"""`pdserve up`: a whole PD deployment on this machine, as child processes.

1. pick ports (prefill i: port_base+i with bootstrap port bootstrap_base+i; decode j:
   port_base+100+j; router: --port), check every one is free (a busy one exits 2 naming up's
   flag for it, before any model loads) and pick the backend (`shm` when every server is
   local and the backend was not given, else `tcp`);
2. start N prefill and M decode `pdserve serve` processes, then wait until each answers
   /health (a child that exits first stops everything, naming it); unless the user sized the
   KV pools, the N + M servers split the KV budget one server would take (share_kv_budget);
3. start the router in front of them and wait for its /health (--routers N: plan_routers);
4. print the URL, an example and where the cluster's admin key is (drawn per cluster unless
   given, handed to every child in its environment, written 0600 to
   `<state dir>/admin_api_key`, never printed; removed at stop); then supervise: a child
   that exits is restarted (its process group killed first) after a back-off of 1 s, 2 s,
   4 s ... capped at RESTART_MAX_S, reset once it stayed up RESTART_RESET_S; meanwhile the
   router probes it and keeps it out of rotation until its /health answers again
   (pdcore.router.health);
5. SIGHUP: a rolling restart (`rolling_restart`): each server in turn gets SIGTERM, which
   drains it (pdcore.server.drain: 503 to new requests, which the router retries on another
   server and takes it out of rotation; in-flight requests and transfers finish), is started
   again once it exited, and the next one waits until its /health is 200 and the router has
   it back in rotation. A signal, not a command or an HTTP call: it is the usual "reload"
   (`kill -HUP`, systemd's ExecReload), needs no credential beyond being this user, and
   `up` has no control port to protect. With one server of a role, requests that arrive
   while it restarts find none (503): give each role two servers for zero failures;
6. Ctrl-C / SIGTERM stops all children (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from pdcore.config import (
    ADMIN_KEY_ENV,
    CLUSTER_SECRET_ENV,
    HOST_SERVERS_ENV,
    admin_api_key,
    cluster_secret,
)
from pdcore.edge.ports import check_port_free
from pdcore.env import ENV, child_environ
from pdcore.env import check as check_env
from pdcore.errors import ConfigError
from pdcore.runtime.lifeline import popen_session
from pdcore.runtime_env import disjoint_cpus, server_threads

GRACE_S = 10.0
ROTATION_WAIT_S = 30.0  # a restarted server must be back in the router's rotation by then
RESTART_FIRST_S, RESTART_MAX_S, RESTART_RESET_S = 1.0, 30.0, 60.0


@dataclass
class Child:
    name: str
    url: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0
    backoff: float = RESTART_FIRST_S  # the wait before its next restart
    restart_at: float | None = None  # set while it is dead and waiting for its restart
    restarts: int = 0
    placement: str = ""  # where its compute threads run, as `up` prints it


@dataclass
class UpConfig:
    prefill: int = 1
    decode: int = 1
    backend: str | None = None
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    server_port_base: int = 30000
    bootstrap_port_base: int = 8998
    policy: str = "round_robin"
    startup_timeout: float = 600.0
    serve_args: list[str] = field(default_factory=list)
    cpus: list[str] = field(default_factory=list)  # optional taskset cpu lists per server
    state_dir: str | None = None  # where the drawn admin key is written (default: state_dir())
    routers: int = 1  # routers on port, port + 1, ... over the same servers (router/fleet.py)


ADMIN_KEY_FILE = "admin_api_key"


def state_dir(cfg: UpConfig) -> str:
    """This run's folder: --state-dir, else $XDG_RUNTIME_DIR/pdserve/up-<router port> (a
    per-user tmpfs), else $XDG_STATE_HOME (~/.local/state)/pdserve/up-<router port>."""
    if cfg.state_dir:
        return cfg.state_dir
    base = ENV.xdg_runtime_dir
    if not base or not os.path.isdir(base):
        base = ENV.xdg_state_home or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "pdserve", f"up-{cfg.port}")


def given_admin_key(cfg: UpConfig) -> str | None:
    """The user's admin key (--admin-api-key among the serve flags, $PDSERVE_ADMIN_API_KEY or
    its _FILE), or None: `up` draws one."""
    return admin_api_key(_flag_value(cfg.serve_args, "--admin-api-key"))


def write_admin_key(folder: str, key: str) -> str:
    """`key` into `folder`/admin_api_key, readable by this user only (folder 0700, file 0600,
    created so: never world-readable for a moment); its path."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    path = os.path.join(folder, ADMIN_KEY_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key.encode() + b"\n")
    finally:
        os.close(fd)
    return path


def choose_backend(cfg: UpConfig) -> tuple[str, str]:
    """(backend, why). shm is the same-host default; every server of `up` is local."""
    if cfg.backend:
        return cfg.backend, "chosen with --backend"
    from pdcore.plugins.host import transfer_backends

    reg = transfer_backends()
    if "shm" in reg and reg.get("shm").available()[0]:
        return "shm", ("every server is on this host: KV is copied straight into the peer's "
                       "memory; PDCORE_SHM_MODE chooses how")
    return "tcp", "shm is not available here"


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value given to `flag` in `argv` (`--flag V` or `--flag=V`; the last one wins)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value


def plan(cfg: UpConfig, backend: str) -> tuple[list[Child], Child]:
    if cfg.prefill < 1 or cfg.decode < 1:
        raise ConfigError("--prefill and --decode must each be >= 1")
    if cfg.routers < 1:
        raise ConfigError("--routers must be >= 1")
    py = [sys.executable, "-m", "pdcore", "serve"]
    common = ["--host", cfg.host, "--disaggregation-transfer-backend", backend, *cfg.serve_args]
    # the cluster's own secret: its control plane refuses everyone else and the router signs
    # its routes with it; handed over in the environment (argv is world-readable)
    # (the user's, from the flag, the environment or its file, else a new one)
    secret = (cluster_secret(_flag_value(cfg.serve_args, "--disaggregation-auth-token"))
              or secrets.token_hex(16))
    # and its admin key (the admin routes of every server and of the router; the router's
    # own admin calls to the servers carry it): the user's, else a new one
    secret_env = {CLUSTER_SECRET_ENV: secret,
                  ADMIN_KEY_ENV: given_admin_key(cfg) or secrets.token_hex(32)}
    if cfg.model_path:
        common += ["--model-path", cfg.model_path]
    servers = []
    for i in range(cfg.prefill):
        port = cfg.server_port_base + i
        servers.append(Child(f"prefill-{i}", f"http://{cfg.host}:{port}", py + common + [
            "--port", str(port), "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", str(cfg.bootstrap_port_base + i)],
            env=dict(secret_env)))
    for j in range(cfg.decode):
        port = cfg.server_port_base + 100 + j
        servers.append(Child(f"decode-{j}", f"http://{cfg.host}:{port}", py + common + [
            "--port", str(port), "--disaggregation-mode", "decode"], env=dict(secret_env)))
    place_servers(cfg, servers)
    share_kv_budget(cfg, servers)
    router = [sys.executable, "-m", "pdcore.router", "--pd-disaggregation", "--host", cfg.host,
              "--port", str(cfg.port), "--policy", cfg.policy]
    for i in range(cfg.prefill):
        router += ["--prefill", servers[i].url, str(cfg.bootstrap_port_base + i)]
    for s in servers[cfg.prefill:]:
        router += ["--decode", s.url]
    key = _flag_value(cfg.serve_args, "--api-key")
    if key is not None:  # the servers want the key: the router asks for it and sends it on
        router += ["--api-key", key]
    return servers, Child("router", f"http://{cfg.host}:{cfg.port}", router, env=secret_env)


def plan_routers(cfg: UpConfig, first: Child) -> list[Child]:
    """--routers N: `first` and copies on --port + 1, ..., each told the others (--peer-routers):
    every one serves any request (the same servers and cluster secret to sign routes with)."""
    if cfg.routers == 1:
        return [first]
    urls = [f"http://{cfg.host}:{cfg.port + k}" for k in range(cfg.routers)]
    at = first.argv.index("--port")
    out = []
    for k, url in enumerate(urls):
        argv = [*first.argv[:at + 1], str(cfg.port + k), *first.argv[at + 2:],
                "--peer-routers", *(u for u in urls if u != url)]
        out.append(Child(first.name if k == 0 else f"router-{k}", url, argv, env=dict(first.env)))
    return out


def share_kv_budget(cfg: UpConfig, servers: list[Child]) -> None:
    """Every server one share of the KV budget one server alone would take on this host (each
    still holds its own weights): a server sizes its pool from the machine's total memory, so N
    of them started side by side would each take the whole budget (2P2D of SmolLM2 on 24 GiB:
    four 1.8 GiB pools, 11 GB resident in all). A user's --max-total-tokens or
    --mem-fraction-static sizes each server as given."""
    if any(_flag_value(cfg.serve_args, f) is not None
           for f in ("--max-total-tokens", "--mem-fraction-static")):
        return
    for child in servers:
        child.env[HOST_SERVERS_ENV] = str(len(servers))


def place_servers(cfg: UpConfig, servers: list[Child]) -> None:
    """Each server its own CPUs when there are enough (bound threads, bounded spin), else all
    share them (a thread share each, not bound, passive wait); `placement` says which."""
    given = _flag_value(cfg.serve_args, "--cpu-omp-threads-bind")
    lists = None if given else disjoint_cpus(len(servers))
    threads = server_threads(len(servers))
    for k, child in enumerate(servers):
        if k < len(cfg.cpus) and cfg.cpus[k]:
            child.argv = ["taskset", "-c", cfg.cpus[k], *child.argv]
            child.placement = f"CPUs {cfg.cpus[k]} (--cpus), bound, bounded spin"
        elif given:
            child.placement = f"--cpu-omp-threads-bind {given} (given)"
        elif lists is not None:
            child.argv += ["--cpu-omp-threads-bind", lists[k]]
            child.placement = f"CPUs {lists[k]} of its own, bound, bounded spin"
        else:
            child.argv += ["--cpu-omp-threads-bind", "nobind"]
            if threads is not None:
                child.env["OMP_NUM_THREADS"] = str(threads)
            child.placement = (f"shares the CPUs with {len(servers) - 1} other servers "
                               f"({threads or 'your'} OpenMP threads, passive wait)")


class Deployment:
    def __init__(self, cfg: UpConfig, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.log = log or (lambda msg: print(msg, flush=True))
        self.backend, self.why = choose_backend(cfg)
        self.servers, first = plan(cfg, self.backend)
        self.routers = plan_routers(cfg, first)
        self.router = self.routers[0]  # the address `up` prints first
        self.children: list[Child] = []
        self.admin_key_file: str | None = None  # set when `up` drew the key and wrote it
        self.restart_requested = False  # SIGHUP: a rolling restart at the next supervise step

    def admin_key_note(self) -> str:
        """Where the admin key is, for the operator (never the key itself)."""
        if self.admin_key_file is None:
            return ("admin key: the one you gave (--admin-api-key / $PDSERVE_ADMIN_API_KEY); "
                    "admin routes: POST /workers, /flush_cache, profiling")
        return (f"admin key (POST /workers, /flush_cache, profiling): in {self.admin_key_file} "
                f"(mode 0600, removed at stop); send -H \"Authorization: Bearer "
                f"$(cat {self.admin_key_file})\"")

    def _spawn(self, child: Child) -> None:
        env = child_environ(child.env) if child.env else None
        # SIGTERM when `up` dies, even by SIGKILL: each server then stops its own tree
        child.proc = popen_session(child.argv, env=env)  # at up's nice (lifeline.carry_nice)
        child.started_at = time.monotonic()
        if child not in self.children:
            self.children.append(child)

    def _wait_healthy(self, children: list[Child], deadline: float) -> None:
        pending = list(children)
        with httpx.Client(timeout=2.0) as http:
            while pending:
                for c in list(pending):
                    if c.proc.poll() is not None:
                        raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} "
                                           f"during start-up")
                    try:
                        if http.get(c.url + "/health").status_code == 200:
                            pending.remove(c)
                            self.log(f"  {c.name} ready at {c.url}")
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(f"timed out waiting for {', '.join(c.name for c in pending)}")
                time.sleep(0.5)

    def start(self) -> None:
        self.log(f"pdserve up: {self.cfg.prefill} prefill + {self.cfg.decode} decode, "
                 f"backend {self.backend} ({self.why})")
        for s in self.servers:
            self.log(f"  {s.name}: {s.placement}")
        if given_admin_key(self.cfg) is None:
            self.admin_key_file = write_admin_key(state_dir(self.cfg),
                                                  self.router.env[ADMIN_KEY_ENV])
        deadline = time.monotonic() + self.cfg.startup_timeout
        for s in self.servers:
            self._spawn(s)
        self._wait_healthy(self.servers, deadline)
        for r in self.routers:
            self._spawn(r)
        self._wait_healthy(self.routers, deadline)

    def supervise(self, until: Callable[[], bool] = lambda: False, poll_s: float = 0.2) -> None:
        """Restart children that exit, with back-off, until `until()` is true; a rolling
        restart when one was asked for (SIGHUP)."""
        while not until():
            if self.restart_requested:
                self.restart_requested = False
                self.rolling_restart()
            self.supervise_once(time.monotonic())
            time.sleep(poll_s)

    def rolling_restart(self) -> bool:
        """Drain and restart every server in turn (module doc, step 5); True when each came
        back healthy and in the router's rotation."""
        self.log(f"pdserve up: rolling restart of {len(self.servers)} servers")
        t0 = time.monotonic()
        for c in self.servers:
            try:
                self._restart_one(c)
            except RuntimeError as e:  # the supervisor restarts it with back-off
                self.log(f"pdserve up: rolling restart stopped at {c.name}: {e}")
                return False
        self.log(f"pdserve up: rolling restart done in {time.monotonic() - t0:.1f}s")
        return True

    def _restart_one(self, c: Child) -> None:
        wait_s = drain_wait_s(self.cfg)
        if c.proc is not None and c.proc.poll() is None:
            self.log(f"pdserve up: draining {c.name} (SIGTERM; up to {wait_s:g}s)")
            try:
                os.kill(c.proc.pid, signal.SIGTERM)
                rc = c.proc.wait(wait_s)
                self.log(f"pdserve up: {c.name} drained, exit code {rc}")
            except subprocess.TimeoutExpired:
                self.log(f"pdserve up: {c.name} still running after {wait_s:g}s: killed")
            except ProcessLookupError:
                pass
            _kill_group(c.proc.pid)
            c.proc.wait(5)
        c.restart_at = None
        c.restarts += 1
        self._spawn(c)
        deadline = time.monotonic() + self.cfg.startup_timeout
        self._wait_healthy([c], deadline)
        self._wait_in_rotation(c, min(deadline, time.monotonic() + ROTATION_WAIT_S))

    def _wait_in_rotation(self, c: Child, deadline: float) -> None:
        """Until every router lists `c` as available (each probes a worker it took out)."""
        key = _flag_value(self.cfg.serve_args, "--api-key")
        headers = {"authorization": f"Bearer {key}"} if key else {}
        waiting = list(self.routers)
        with httpx.Client(timeout=2.0, headers=headers) as http:
            while waiting and time.monotonic() < deadline:
                waiting = [r for r in waiting if not _lists_available(http, r.url, c.url)]
                time.sleep(0.2 if waiting else 0)
        self.log(f"  {c.name} back in the router's rotation" if not waiting else
                 f"pdserve up: {', '.join(r.name for r in waiting)} has not taken {c.name} "
                 "back yet; going on")

    def supervise_once(self, now: float) -> None:
        for c in self.children:
            if c.restart_at is None and c.proc is not None and c.proc.poll() is not None:
                if now - c.started_at >= RESTART_RESET_S:
                    c.backoff = RESTART_FIRST_S  # it ran long enough: a new failure streak
                c.restart_at = now + c.backoff
                self.log(f"pdserve up: {c.name} exited with code {c.proc.returncode}; "
                         f"restarting in {c.backoff:g}s")
                c.backoff = min(c.backoff * 2, RESTART_MAX_S)
                _kill_group(c.proc.pid)  # whatever of its tree is left
            elif c.restart_at is not None and now >= c.restart_at:
                c.restart_at = None
                c.restarts += 1
                self._spawn(c)
                self.log(f"pdserve up: {c.name} restarted (pid {c.proc.pid}, restart "
                         f"{c.restarts}); the router takes it back once /health answers")

    def stop(self) -> None:
        if self.admin_key_file is not None:
            try:
                os.unlink(self.admin_key_file)
            except FileNotFoundError:
                pass
        for c in reversed(self.children):
            if c.proc and c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + GRACE_S
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.proc.wait(5)


def _lists_available(http: httpx.Client, router: str, url: str) -> bool:
    try:
        listed = http.get(router + "/workers").json().get("workers", [])
        return any(w.get("url") == url and w.get("available") for w in listed)
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def drain_wait_s(cfg: UpConfig) -> float:
    """How long a draining server may take to exit: its drain timeout (--drain-timeout among
    the serve flags, else $PDSERVE_DRAIN_TIMEOUT_S) plus its shutdown."""
    given = _flag_value(cfg.serve_args, "--drain-timeout")
    try:
        drain = float(given) if given is not None else float(ENV.pdserve_drain_timeout_s)
    except ValueError:
        drain = float(ENV.pdserve_drain_timeout_s)
    return drain + GRACE_S


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def check_ports(cfg: UpConfig) -> None:
    """Every port `up` will listen on (servers, bootstraps, router) is free on --host, before
    anything loads; a busy one is a ConfigError naming `up`'s own flag for it."""
    wanted: list[tuple[int, str, str]] = [(cfg.port, "--port", "the router")]
    wanted += [(cfg.port + k, "--port", f"router-{k} (--port + {k})")
               for k in range(1, cfg.routers)]
    for i in range(cfg.prefill):
        wanted.append((cfg.server_port_base + i, "--server-port-base", f"prefill-{i}"))
        wanted.append((cfg.bootstrap_port_base + i, "--bootstrap-port-base",
                       f"prefill-{i}'s bootstrap server"))
    for j in range(cfg.decode):
        wanted.append((cfg.server_port_base + 100 + j, "--server-port-base",
                       f"decode-{j} (--server-port-base + 100 + {j})"))
    seen: dict[int, str] = {}
    for port, flag, who in wanted:
        if not 0 < port < 65536:
            raise ConfigError(f"{flag}: port {port} for {who} is out of range 1..65535")
        if port in seen:
            raise ConfigError(f"{flag}: port {port} for {who} is also {seen[port]}'s; pick "
                              "ports that do not overlap")
        seen[port] = who
        try:
            check_port_free(cfg.host, port, flag)
        except ConfigError as e:
            raise ConfigError(f"{who}: {e}") from None


def run_up(cfg: UpConfig) -> int:
    check_env()  # the servers and the router would each refuse it later
    check_ports(cfg)  # before anything loads: a busy router port used to cost two model loads
    dep = Deployment(cfg)

    def _term(*_: object) -> None:
        raise KeyboardInterrupt

    def _hup(*_: object) -> None:
        dep.restart_requested = True

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _hup)
    try:
        dep.start()
        url = dep.router.url
        print(f"\npdserve up: ready at {url} (send requests here; the servers' own ports "
              f"answer only the router)\n  live cluster page: {url}/dashboard\n"
              f"  try: curl {url}/v1/chat/completions -H "
              "'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", "
              "\"content\": \"Hello\"}], \"max_tokens\": 32}'\n"
              f"  {dep.admin_key_note()}\n  (Ctrl-C stops everything; kill -HUP {os.getpid()}"
              " drains and restarts each server in turn)",
              flush=True)
        if len(dep.routers) > 1:
            print(f"  {len(dep.routers)} routers, each serving any request (one address for "
                  "all: docs/router.md): " + ", ".join(r.url for r in dep.routers), flush=True)
        dep.supervise()
        return 0
    except KeyboardInterrupt:
        print("pdserve up: stopping (interrupted)", flush=True)
        return 0
    except RuntimeError as e:
        print(f"pdserve up: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        dep.stop()
