"""The scheduler process: owns the model and the KV pool; talks to the HTTP process over zmq.

1. with --tp-size > 1, spawn this node's other TP ranks and join their group as rank 0
   (pdcore.runtime.ranks); build the engine (model shard, KV pool, scheduler) and, in PD
   modes, attach the role extension (pdcore.runtime.roles); all ranks agree that they started;
2. report readiness (or the start-up error) on `ready_conn`;
3. loop: drain incoming GenerateReq / AbortReq / ControlReq; control calls are answered here;
   requests and aborts go through the Lockstep, which hands them to every rank and runs one
   scheduler step when there is work; push the step's TokenOuts back (one list a step); block
   on the socket (bounded) when idle;
4. on shutdown (parent gone, SIGTERM) tell the other ranks to stop, close the extension and
   the pool.

Failure containment (pdcore.runtime.lifeline): a failing request fails alone (Lockstep); the
process gets SIGTERM when the HTTP process dies (PR_SET_PDEATHSIG) and a thread also watches the
parent while a step runs; a step longer than --watchdog-timeout ends the process with
EXIT_WATCHDOG, which the HTTP process reports before it exits too.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback
from typing import Any

import zmq

from pdcore.config import ServerArgs
from pdcore.messages.io import ControlKind, ControlReq, ControlResp
from pdcore.engine.sched.scheduler import DecodeLog
from pdcore.engine.sched.stats import StatsReport
from pdcore.runtime.cpu_team import CpuTeam
from pdcore.runtime.grammar_gate import GrammarGate
from pdcore.runtime.group import agree_started
from pdcore.runtime.lifeline import (
    ParentWatch,
    StepWatchdog,
    die_with_parent,
    remove_ipc_sockets,
    when_parent_lost,
)
from pdcore.runtime.lockstep import Lockstep
from pdcore.runtime.ranks import RankGroup
from pdcore.runtime.roles import attach_role
from pdcore.engine.kv.giveback import IdleTimer
from pdcore.env import ENV

log = logging.getLogger("pdcore.scheduler")

IDLE_POLL_MS = 50
GRAMMAR_POLL_MS = 5  # a grammar compiling: look again soon
PD_WAIT_MS, PD_WAIT_TP_MS = 1, 4


class SchedulerLoop:
    def __init__(self, engine: Any, recv: zmq.Socket, send: zmq.Socket,
                 watchdog_timeout: float = 0.0, decode_log_interval: int = 40) -> None:
        self.engine = engine
        self.recv, self.send = recv, send
        self.profiler: Any = None
        self.stop = False
        self.busy = False  # the last loop had work: going idle trims the heap once
        # the free KV pages go back once the engine has been idle this long (engine/kv/giveback)
        self.idle = IdleTimer(ENV.pdserve_kv_giveback_idle_s)
        self.lockstep = Lockstep(engine)
        self.sched = self.lockstep.sched  # the scheduler's runtime surface (RuntimeAPI)
        self.inbox: list[Any] = []  # requests and aborts for the next lockstep iteration
        # constrained requests wait for their grammar off the scheduler's thread
        self.grammar = GrammarGate(self.sched.grammar_backend)
        self.watchdog = StepWatchdog(watchdog_timeout)
        self.decode_log = DecodeLog(decode_log_interval)  # --decode-log-interval
        import torch

        # the OpenMP team off cores a busy neighbour takes (built here: this thread is its master)
        self.team = CpuTeam.start(engine.args.device, torch.get_num_threads(),
                                  torch.set_num_threads)

    def handle(self, msg: Any) -> None:
        if not isinstance(msg, ControlReq):
            self.inbox.append(msg)
        else:
            try:
                data = self.control(msg)
                self.send.send(pickle.dumps(ControlResp(msg.call_id, True, data)))
            except Exception as e:  # noqa: BLE001 - answered to the caller
                log.warning("control %s failed: %s", msg.kind, e)
                self.send.send(pickle.dumps(ControlResp(msg.call_id, False, error=str(e))))

    def control(self, msg: ControlReq) -> dict[str, Any] | StatsReport:
        s = self.sched
        if msg.kind in (ControlKind.GET_LOAD, ControlKind.STATS):
            report = s.stats()
            dp = self.lockstep.dp  # DP attention: forwards run only for the other DP ranks
            if dp is not None:
                report.add_named(dp.stats())
            report.add_named(self.team.stats())
            return report if msg.kind == ControlKind.STATS else report.as_dict()
        if msg.kind == ControlKind.FLUSH_CACHE:
            return s.flush_cache()
        if msg.kind == ControlKind.START_PROFILE:
            import torch.profiler as tp

            if self.profiler is not None:
                raise RuntimeError("profiling already started")
            out = msg.args.get("output_dir") or self.engine.args.profile_output_dir or "/tmp"
            os.makedirs(out, exist_ok=True)
            self.profiler = tp.profile(activities=[tp.ProfilerActivity.CPU],
                                       on_trace_ready=tp.tensorboard_trace_handler(out))
            self.profiler.__enter__()
            return {"output_dir": out}
        if msg.kind == ControlKind.STOP_PROFILE:
            if self.profiler is None:
                raise RuntimeError("profiling was not started")
            self.profiler.__exit__(None, None, None)
            self.profiler = None
            return {"stopped": True}
        raise ValueError(f"unknown control call {msg.kind!r}")

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv, zmq.POLLIN)
        parent = ParentWatch(self.request_stop, "scheduler").start()
        self.watchdog.start()
        try:
            self._loop(poller)
        finally:
            self.watchdog.close()
            parent.close()

    def request_stop(self) -> None:
        self.stop = True

    def _loop(self, poller: zmq.Poller) -> None:
        while not self.stop:
            if self.lockstep.peers_busy:  # DP attention: another DP rank waits on this one
                timeout = 0
            elif not self.sched.has_work() and not self.grammar.pending:
                timeout = IDLE_POLL_MS
                if self.busy:  # what the steps freed would stay resident until reused
                    self.busy = False
                    self.lockstep.go_idle()
                    self.idle.idle(time.monotonic())
                gap = self.idle.due(time.monotonic())
                if gap is not None:  # idle long enough: the free KV pages go back too
                    self.lockstep.give_back(gap)
            elif self.sched.step_due():
                timeout = 0
            elif self.grammar.pending:
                timeout = GRAMMAR_POLL_MS
            else:  # only PD queues waiting on the network: do not spin (with TP every
                # iteration costs collectives on every rank, so wait a little longer)
                timeout = PD_WAIT_MS if self.sched.tp_group.size == 1 else PD_WAIT_TP_MS
            if timeout != IDLE_POLL_MS:
                self.busy = True
                self.idle.busy()
            if poller.poll(timeout):
                while True:
                    try:
                        raw = self.recv.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(pickle.loads(raw))
            msgs, ended = self.grammar.admit(self.inbox)
            self.inbox = []
            if ended:
                self.send.send(pickle.dumps(ended))
            self.watchdog.begin(f"{len(msgs)} new messages, {self.sched.num_running} running, "
                                f"{self.sched.num_waiting} waiting requests")
            outs = self.lockstep.lead(msgs)
            self.stop = self.stop or self.lockstep.stopped  # DP attention: a DP rank stopped
            self.watchdog.end()
            self.sched.log_decode(self.decode_log)
            self.team.tick(timeout != IDLE_POLL_MS)
            if outs:  # a step's TokenOuts in one message: one pickle and one send on this
                # thread between steps, one wake-up of the HTTP process (not one per request)
                self.send.send(pickle.dumps(outs))
            if self.profiler is not None:
                self.profiler.step()
        self.lockstep.lead([], stop=True)  # the other TP ranks leave their loops too


def run_scheduler_process(args: ServerArgs, recv_addr: str, send_addr: str, ready_conn: Any) -> None:
    die_with_parent()  # SIGTERM (a clean stop) when the HTTP process dies, even by SIGKILL
    # the sockets go at once when the HTTP process is gone: a stop slower than ParentWatch's
    # grace ends in a hard exit that skips the `finally` below
    when_parent_lost(lambda: remove_ipc_sockets(recv_addr, send_addr))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s [scheduler] %(name)s: %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.setsockopt(zmq.LINGER, 1000)
    send.connect(send_addr)
    try:
        serve_scheduler(args, ctx, recv, send, ready_conn)
    finally:
        remove_ipc_sockets(recv_addr, send_addr)


def serve_scheduler(args: ServerArgs, ctx: zmq.Context, recv: zmq.Socket, send: zmq.Socket,
                    ready_conn: Any) -> bool:
    """Start the engine, report on `ready_conn` (anything with `send(dict)`), serve until
    stopped (a DP rank on another node comes here too: pdcore.runtime.dp.nodes); False when
    the start failed."""
    ranks = RankGroup(args)
    engine = None
    try:
        from pdcore.engine.build import build_engine

        t0 = time.monotonic()
        if args.dp_size > 1 and args.tp_size == 1 and args.device == "cpu":
            from pdcore.engine.model.layers import share_host_threads

            share_host_threads(args.dp_size)  # DP replicas on one host share its cores
        tp = ranks.start()
        error = None
        try:
            engine = build_engine(args, tp)
            attach_role(engine)
        except Exception as e:  # noqa: BLE001 - reported to every rank and the HTTP process
            log.error("scheduler failed to start: %s\n%s", e, traceback.format_exc())
            error = f"{type(e).__name__}: {e}"
        error = agree_started(tp, error) if tp.size > 1 else error
        if error:
            raise RuntimeError(error)
        log.info("engine ready in %.1fs (TP %d)", time.monotonic() - t0, tp.size)
    except Exception as e:  # noqa: BLE001 - any start-up failure goes to the HTTP process
        msg = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        ready_conn.send({"ok": False, "error": msg})
        if engine is not None:
            engine.close()
        ranks.close()
        recv.close(0)
        send.close()  # its linger delivers the error over a link to another node
        ctx.term()
        return False
    ready_conn.send({"ok": True, "info": engine.info})
    loop = SchedulerLoop(engine, recv, send, args.watchdog_timeout, args.decode_log_interval)

    def _term(*_: Any) -> None:
        loop.stop = True

    signal.signal(signal.SIGTERM, _term)
    try:
        loop.run()
    finally:
        engine.close()
        ranks.close()
        recv.close(0)
        send.close(0)
        ctx.term()
    return True
