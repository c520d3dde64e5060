"""The scheduler process: owns the model and the KV pool; talks to the HTTP process over zmq.

1. build the engine (model, KV pool, scheduler) and, in PD modes, the disaggregation extension;
2. report readiness (or the start-up error) on `ready_conn`;
3. loop: drain incoming GenerateReq / AbortReq / ControlReq; run one scheduler step when there
   is work; push TokenOut / ControlResp back; block on the socket (bounded) when idle;
4. on shutdown (parent gone, SIGTERM) close the extension and the pool.
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
from pdcore.engine.io_struct import AbortReq, ControlReq, ControlResp, GenerateReq
from pdcore.engine.request import Req

log = logging.getLogger("pdcore.scheduler")

IDLE_POLL_MS = 50


def _attach_extension(engine: Any) -> None:
    mode = engine.args.disaggregation_mode
    if mode == "null":
        return
    from pdcore.disagg.scheduling import attach

    attach(engine)


class SchedulerLoop:
    def __init__(self, engine: Any, recv: zmq.Socket, send: zmq.Socket) -> None:
        self.engine, self.sched = engine, engine.scheduler
        self.recv, self.send = recv, send
        self.profiler: Any = None
        self.stop = False

    def handle(self, msg: Any) -> None:
        if isinstance(msg, GenerateReq):
            self.sched.add(Req.from_generate(msg))
        elif isinstance(msg, AbortReq):
            self.sched.abort(msg.rid, msg.reason)
        elif isinstance(msg, ControlReq):
            try:
                data = self.control(msg)
                self.send.send(pickle.dumps(ControlResp(msg.call_id, True, data)))
            except Exception as e:
                log.warning("control %s failed: %s", msg.kind, e)
                self.send.send(pickle.dumps(ControlResp(msg.call_id, False, error=str(e))))

    def control(self, msg: ControlReq) -> dict[str, Any]:
        s = self.sched
        if msg.kind in ("get_load", "stats"):
            return s.stats()
        if msg.kind == "flush_cache":
            return {"flushed": True}  # no prefix cache to flush yet
        if msg.kind == "start_profile":
            import torch.profiler as tp

            if self.profiler is not None:
                raise RuntimeError("profiling already started")
            out = msg.args.get("output_dir") or self.engine.args.profile_output_dir or "/tmp"
            os.makedirs(out, exist_ok=True)
            self.profiler = tp.profile(activities=[tp.ProfilerActivity.CPU],
                                       on_trace_ready=tp.tensorboard_trace_handler(out))
            self.profiler.__enter__()
            return {"output_dir": out}
        if msg.kind == "stop_profile":
            if self.profiler is None:
                raise RuntimeError("profiling was not started")
            self.profiler.__exit__(None, None, None)
            self.profiler = None
            return {"stopped": True}
        raise ValueError(f"unknown control call {msg.kind!r}")

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv, zmq.POLLIN)
        parent = os.getppid()
        while not self.stop:
            if not self.sched.has_work():
                timeout = IDLE_POLL_MS
            else:  # only PD queues waiting on the network: do not spin
                timeout = 0 if self.sched.last_ran or self.sched.outbox else 1
            if poller.poll(timeout):
                while True:
                    try:
                        raw = self.recv.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(pickle.loads(raw))
            if self.sched.has_work():
                for out in self.sched.step():
                    self.send.send(pickle.dumps(out))
            elif os.getppid() != parent:
                log.warning("parent process exited; scheduler stopping")
                break
            if self.profiler is not None:
                self.profiler.step()


def run_scheduler_process(args: ServerArgs, recv_addr: str, send_addr: str, ready_conn: Any) -> None:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s [scheduler] %(name)s: %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.setsockopt(zmq.LINGER, 1000)
    send.connect(send_addr)
    engine = None
    try:
        from pdcore.engine.llm_engine import build_engine

        t0 = time.monotonic()
        engine = build_engine(args)
        _attach_extension(engine)
        log.info("engine ready in %.1fs", time.monotonic() - t0)
    except Exception as e:
        log.error("scheduler failed to start: %s\n%s", e, traceback.format_exc())
        ready_conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    ready_conn.send({"ok": True, "info": engine.info})
    loop = SchedulerLoop(engine, recv, send)

    def _term(*_: Any) -> None:
        loop.stop = True

    signal.signal(signal.SIGTERM, _term)
    try:
        loop.run()
    finally:
        engine.close()
        recv.close(0)
        send.close(0)
        ctx.term()
