"""The engine handle: the client of one scheduler process, living in the HTTP process. The
server holds one (`pdcore.runtime.make_engine` picks it: this one, or the DP replicas' handle of
pdcore.runtime.dp.client over several of them) and sees the engine only through it: start,
generate, abort, control calls (stats, load, cache flush, profiling), shutdown.

Lifecycle:
1. `start()` binds a PULL socket (scheduler -> us) on an ipc:// path in a private temp dir,
   spawns the scheduler process ('spawn' context) with both addresses and a ready pipe, and
   connects a PUSH socket (us -> scheduler); the tokenizer loads meanwhile in a thread;
2. waits, off the event loop, for the scheduler's ready message, its death, or the timeout;
3. runs a receive loop routing TokenOut to per-request queues and ControlResp to waiting calls,
   and a watchdog that, once the scheduler dies, fails every pending request (HTTP 503 saying
   why) and calls `on_dead` (the runner then exits the server non-zero: a server without an
   engine must not linger answering 503, a supervisor restarts it);
4. `generate()` registers a queue, sends GenerateReq and yields TokenOut until finished; leaving
   early (stop string, client gone, timeout, error) sends AbortReq so the scheduler frees pages;
   a decode server's parallel samples go in sample 0's message (`forks`), each sample's own
   generate() then only takes the queue registered for it;
5. `shutdown()` cancels the loops, terminates (then kills) the scheduler, removes the temp dir.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import enum
import logging
import multiprocessing
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from pdcore.config import ServerArgs
from pdcore.env import ENV
from pdcore.messages.info import EngineInfo
from pdcore.messages.io import (
    AbortReq,
    ControlKind,
    ControlReq,
    ControlResp,
    GenerateReq,
    TokenOut,
)
from pdcore.messages.stats import StatsReport
from pdcore.errors import ERROR_ORIGIN_HEADER, PDError
from pdcore.runtime.journal import RequestJournal
from pdcore.runtime.lifeline import (IPC_DIR_PREFIX, describe_exit, interrupts_ignored_by_children,
                                     no_resource_tracker)
from pdcore.runtime.tokenizer_export import tokenizer_dir
from pdcore.runtime_env import Placement, choose_placement, spawning_with, trim_heap

log = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 900.0  # model loading (GGUF dequantisation) can take minutes
DEFAULT_REQUEST_TIMEOUT_S = 3600.0
WATCHDOG_INTERVAL_S = 0.2

SchedulerTarget = Callable[[ServerArgs, str, str, Any], None]


class EngineState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"  # never became ready
    DEAD = "dead"  # was ready, then the scheduler process died
    STOPPED = "stopped"


class EngineError(PDError):
    """A request could not be served; `status` is the HTTP status to answer with.
    `client_caused`: the client's own doing although the status does not say so (the 504 of the
    request's own `timeout`); the answer then carries ERROR_ORIGIN_HEADER (`headers`)."""

    def __init__(self, message: str, status: int = 500, client_caused: bool = False,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.client_caused = client_caused
        self.code = code  # the named reason (messages/codes.ErrorCode), the error body's code

    @property
    def headers(self) -> dict[str, str]:
        """Headers of the HTTP answer: the router neither retries nor counts against this
        server an answer marked as the client's doing."""
        return {ERROR_ORIGIN_HEADER: "client"} if self.client_caused else {}


def _placement(args: ServerArgs) -> Placement | None:
    if args.device != "cpu":
        return None
    return choose_placement(args.cpu_omp_threads_bind, args.dp_size * args.tp_size)


def run_scheduler(args: ServerArgs, recv_addr: str, send_addr: str, ready_conn: Any) -> None:
    """The scheduler process's entry point (the default target). The spawned child imports the
    engine here; a target of pdcore.runtime.scheduler_process itself would have to be imported
    by the HTTP process to be handed to multiprocessing, and with it torch and the whole engine
    (~200 MiB resident and ~1.5 CPU-seconds per start in a process that runs no tensor op)."""
    from pdcore.runtime.scheduler_process import run_scheduler_process

    run_scheduler_process(args, recv_addr, send_addr, ready_conn)


def _default_target() -> SchedulerTarget:
    return run_scheduler


def wait_ready(proc: Any, reader: Any, timeout: float,
               stopping: Callable[[], bool]) -> dict[str, Any]:
    """The scheduler process's start-up message ({"ok": True, ...}) read from `reader`; an
    EngineError (503) when it reports a failure, exits, or stays silent past `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if stopping():
            raise EngineError("server is shutting down", 503)
        alive = proc.is_alive()  # checked before polling: a last message is never missed
        if reader.poll(0.1):
            try:
                msg = reader.recv()
            except EOFError:
                msg = None
            if isinstance(msg, dict) and msg.get("ok"):
                return msg
            if isinstance(msg, dict):
                raise EngineError(f"scheduler failed to start: {msg.get('error')}", 503)
        if not alive:
            proc.join(1)
            raise EngineError(
                f"scheduler process exited with code {proc.exitcode} during start-up "
                "(see its log above)", 503)
        if time.monotonic() > deadline:
            raise EngineError(
                f"scheduler not ready after {timeout:.0f}s (model loading too slow or stuck); "
                "check the log above", 503)


class EngineClient:
    def __init__(self, args: ServerArgs, *, scheduler_target: SchedulerTarget | None = None,
                 tokenizer: Any = None, ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.info = EngineInfo()  # the scheduler's, once it is ready
        self.state = EngineState.STARTING
        self.error = ""  # why the engine is FAILED / DEAD
        self.ready_timeout = ready_timeout
        self.request_timeout = request_timeout
        self._target = scheduler_target
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._ipc_dir: str | None = None
        self._zctx: zmq.asyncio.Context | None = None
        self._push_ctx: zmq.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._push: zmq.Socket | None = None
        self._reqs: dict[str, asyncio.Queue[TokenOut | None]] = {}
        self._carried: dict[str, asyncio.Queue[TokenOut | None]] = {}  # open_queues
        self.journal = RequestJournal(args)  # --log-requests, --show-time-cost, crash dumps
        self._calls: dict[str, asyncio.Future[ControlResp]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.on_dead: Callable[[str], None] | None = None  # called once the scheduler died
        self._stall_s = ENV.pdserve_test_stall_after_send_s  # fault tests only (pdcore.env)

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> None:
        """Spawn the scheduler and wait until it is ready; raises EngineError on failure."""
        try:
            await self._start()
        except BaseException as e:
            self.state = EngineState.FAILED
            self.error = str(e) if isinstance(e, PDError) else f"{type(e).__name__}: {e}"
            self._kill_process()
            self._close_sockets()
            if isinstance(e, EngineError):
                raise
            if isinstance(e, Exception):
                raise EngineError(self.error, 503) from e
            raise

    async def _start(self) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        recv_addr = f"ipc://{self._ipc_dir}/to_scheduler"
        send_addr = f"ipc://{self._ipc_dir}/from_scheduler"
        self._zctx = zmq.asyncio.Context()
        self._pull = self._zctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(send_addr)
        self._push_ctx = zmq.Context()
        self._push = self._push_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a slow scheduler
        self._push.connect(recv_addr)

        mp = multiprocessing.get_context("spawn")
        reader, writer = mp.Pipe(duplex=False)
        target = self._target or _default_target()
        # Not a daemon: a TP scheduler starts its own rank processes. atexit kills it instead.
        self._proc = mp.Process(target=target, args=(self.args, recv_addr, send_addr, writer),
                                name="pdserve-scheduler", daemon=False)
        placement = _placement(self.args)
        no_resource_tracker()
        with spawning_with(placement) if placement else contextlib.nullcontext(), \
                interrupts_ignored_by_children():  # Ctrl-C is the HTTP process's to handle
            self._proc.start()  # OpenMP reads the placement when the child starts torch
        if placement:
            log.info("engine CPU placement: %s", placement.describe())
        atexit.register(self._kill_process)
        writer.close()
        log.info("scheduler process started (pid %s)", self._proc.pid)

        tok_task = None
        if self.tokenizer is None:
            from pdcore.engine.model.tokenizer import load_tokenizer

            tok_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, self.args, True))
        try:
            msg = await asyncio.to_thread(wait_ready, self._proc, reader, self.ready_timeout,
                                          lambda: self._stopping)
        except BaseException:
            if tok_task is not None:
                tok_task.cancel()
            raise
        finally:
            reader.close()
        if tok_task is not None:
            self.tokenizer = await tok_task
        self.info = engine_info(msg.get("info"))
        if placement:
            self.info.cpu_placement = placement.describe()
        self.info.tokenizer_path = await asyncio.to_thread(
            tokenizer_dir, self.tokenizer, self.info.tokenizer_path
            or self.info.model_path or self.args.tokenizer_path or self.args.model_path)
        # loading the tokenizer (on a worker thread, hence in its own malloc arena) parses
        # tokenizer.json into objects it then frees: ~30 MiB of this process that glibc would
        # keep resident for reuse
        trim_heap()
        self._tasks = [asyncio.create_task(self._recv_loop(), name="pdserve-recv"),
                       asyncio.create_task(self._watchdog(), name="pdserve-watchdog")]
        self.state = EngineState.READY

    async def shutdown(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks = []
        if self.state not in (EngineState.FAILED, EngineState.DEAD):
            self.state = EngineState.STOPPED
        self._fail_pending("server is shutting down", 503)
        await asyncio.to_thread(self._kill_process)
        self._close_sockets()

    def _kill_process(self) -> None:
        proc = self._proc
        if proc is None or proc.pid is None:
            return
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        with contextlib.suppress(Exception):
            atexit.unregister(self._kill_process)

    def _close_sockets(self) -> None:
        for s in (self._pull, self._push):
            if s is not None:
                s.close(linger=0)
        for c in (self._zctx, self._push_ctx):
            if c is not None:
                c.term()
        self._pull = self._push = None
        self._zctx = self._push_ctx = None
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    # ---- background tasks ------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self._pull is not None
        while True:
            obj = await self._pull.recv_pyobj()
            if isinstance(obj, (list, TokenOut)):  # a step's TokenOuts come as one list
                for out in obj if isinstance(obj, list) else [obj]:
                    if (q := self._reqs.get(out.rid)) is not None:  # else: aborted / done here
                        q.put_nowait(out)
            elif isinstance(obj, ControlResp):
                fut = self._calls.get(obj.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(obj)
            else:
                log.warning("ignoring unexpected message from scheduler: %r", type(obj))

    async def _watchdog(self) -> None:
        proc = self._proc
        assert proc is not None
        while proc.is_alive():
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        if self._stopping:
            return
        self.state = EngineState.DEAD
        self.error = (f"the engine's scheduler process died ({describe_exit(proc.exitcode)}); "
                      "this server is exiting, retry on another server or after its restart")
        log.error("%s; failing %d pending requests", self.error, len(self._reqs))
        self.journal.dump(self.error)
        self._fail_pending(self.error, 503)
        if self.on_dead is not None:
            self.on_dead(self.error)

    def _fail_pending(self, message: str, status: int) -> None:
        for rid, q in list(self._reqs.items()):
            q.put_nowait(TokenOut(rid=rid, new_token_ids=[], finished=True,
                                  finish_reason={"type": "abort", "message": message},
                                  error=message, error_status=status))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineError(message, status))

    # ---- requests --------------------------------------------------------------------------
    def require_ready(self) -> None:
        if self.state is EngineState.READY:
            return
        if self.state is EngineState.STARTING:
            raise EngineError("server is starting; retry when /health returns 200", 503)
        raise EngineError(f"engine unavailable: {self.error or self.state.value}", 503)

    def _send(self, obj: Any) -> None:
        if self._push is None:
            raise EngineError("engine is not running", 503)
        self._push.send_pyobj(obj, flags=zmq.NOBLOCK)
        if self._stall_s and isinstance(obj, GenerateReq):
            time.sleep(self._stall_s)  # blocks the event loop: nothing else is sent meanwhile

    def abort(self, rid: str, reason: str = "aborted") -> None:
        """Ask the scheduler to drop `rid` and free its pages (no-op when not running)."""
        self._reqs.pop(rid, None)
        self._carried.pop(rid, None)
        if self.state is EngineState.READY and self._push is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._send(AbortReq(rid=rid, reason=reason))

    async def generate(self, req: GenerateReq, timeout: float | None = None
                       ) -> AsyncIterator[TokenOut]:
        """Yield the scheduler's messages for `req` until finished. Use under
        `contextlib.aclosing` so that leaving early aborts the request at once. `timeout`: the
        request's own (its client's; the 504 when it passes is marked so), None: the server's.
        Parallel samples on a decode server (`req.forks`): sample 0's call sends them all in
        one message; each sample's own call (made right after) yields its messages."""
        self.require_ready()
        q = open_queues(self._reqs, self._carried, req)
        # The deadline puts None in the queue. Not asyncio.wait_for: on Python < 3.12 it can
        # swallow a cancellation that races with a token arriving, and then a disconnected
        # client's request would keep running.
        timer = asyncio.get_running_loop().call_later(
            timeout or self.request_timeout, q.put_nowait, None)
        done, out_ids, first_at, sent = False, [], None, False
        started, outcome = time.monotonic(), "aborted"
        self.journal.start(req)
        try:
            if req.route is None or req.route.fork_of is None:  # else sample 0 sent it
                for r in (req, *req.forks):
                    r.arrival_time = r.arrival_time or time.time()
                self._send(req)
                sent = True
            while True:
                out = await q.get()
                if out is None:
                    outcome = "timed out"
                    if timeout:  # the client's own `timeout`: its choice, not this server's fault
                        raise EngineError(f"request {req.rid} timed out: its timeout of "
                                          f"{timeout:g} s passed", 504, client_caused=True)
                    raise EngineError(f"request {req.rid} timed out", 504)
                if out.error:
                    done, outcome = out.finished, f"error: {out.error}"
                    raise EngineError(out.error, out.error_status or 500,
                                      code=out.error_code)
                done = out.finished
                out_ids += out.new_token_ids
                first_at = first_at or (time.monotonic() if out.new_token_ids else None)
                if done:
                    outcome = f"finished ({(out.finish_reason or {}).get('type')})"
                yield out
                if done:
                    return
        finally:
            timer.cancel()
            for rid in forget_carried(self._reqs, self._carried, req):
                if sent:  # its scheduler request would decode for no one
                    self.abort(rid)
            self.journal.end(req, out_ids, started, first_at, outcome)
            if done:
                self._reqs.pop(req.rid, None)
            else:
                self.abort(req.rid)

    async def control(self, kind: ControlKind, args: dict[str, Any] | None = None,
                      timeout: float = 10.0) -> dict[str, Any]:
        """One ControlReq round trip (flush_cache, get_load, start/stop_profile)."""
        return dict(await self._call(kind, args, timeout))

    async def stats(self, timeout: float = 10.0) -> StatsReport:
        """The scheduler's StatsReport (messages/stats.py; built in engine/sched/stats.py)."""
        report = await self._call(ControlKind.STATS, None, timeout)
        if not isinstance(report, StatsReport):
            raise EngineError(f"scheduler answered stats with {type(report).__name__}", 500)
        return report

    async def _call(self, kind: ControlKind, args: dict[str, Any] | None,
                    timeout: float) -> Any:
        self.require_ready()
        call_id = uuid.uuid4().hex
        fut: asyncio.Future[ControlResp] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(ControlReq(call_id=call_id, kind=kind, args=dict(args or {})))
            await asyncio.wait({fut}, timeout=timeout)  # unlike wait_for, never eats a cancel
        finally:
            self._calls.pop(call_id, None)
        if not fut.done():
            fut.cancel()
            raise EngineError(f"scheduler did not answer {kind!r} within {timeout:.0f}s", 504)
        resp = fut.result()
        if not resp.ok:
            raise EngineError(resp.error or f"{kind} failed", 500)
        return resp.data


Queues = dict[str, "asyncio.Queue[TokenOut | None]"]


def open_queues(reqs: Queues, carried: Queues, req: GenerateReq) -> asyncio.Queue[TokenOut | None]:
    """Register the queues of `req` and of the parallel samples it carries (`forks`) before
    anything is sent; a carried sample's queue waits in `carried` for its own generate() call.
    A parallel sample (`route.fork_of`) is never sent alone: it takes its queue from there."""
    fork_of = req.route.fork_of if req.route is not None else None
    if fork_of is not None:
        q = carried.pop(req.rid, None)
        if q is None:
            raise EngineError(f"parallel sample {req.rid} was not sent with sample {fork_of!r} "
                              "of its prompt (that one never reached the scheduler)", 500)
        return q
    for rid in (req.rid, *(f.rid for f in req.forks)):
        if rid in reqs:
            raise EngineError(f"rid {rid!r} is already in flight; use a unique rid", 400)
    q: asyncio.Queue[TokenOut | None] = asyncio.Queue()
    reqs[req.rid] = q
    for f in req.forks:
        reqs[f.rid] = carried[f.rid] = asyncio.Queue()
    return q


def forget_carried(reqs: Queues, carried: Queues, req: GenerateReq) -> list[str]:
    """Sample 0 ended: the samples it carried whose generate() never took their queue (none in
    practice: their tasks start right after its own) are forgotten; their rids."""
    gone = [f.rid for f in req.forks if carried.pop(f.rid, None) is not None]
    for rid in gone:
        reqs.pop(rid, None)
    return gone


def engine_info(value: object) -> EngineInfo:
    """The EngineInfo a scheduler's ready message carries (a dict of its fields from a test's
    stand-in scheduler)."""
    if isinstance(value, EngineInfo):
        return value
    if isinstance(value, dict):
        return EngineInfo.from_dict(value)
    raise EngineError(f"scheduler sent no engine info ({type(value).__name__})", 503)


def new_rid() -> str:
    return uuid.uuid4().hex
