"""Node 0's handle of a DP attention rank that runs on another node (pdcore.runtime.dp.nodes).

`RemoteEngineClient` is an `EngineClient` whose scheduler process is not its child: instead of
spawning one it binds the DP rank's two link sockets, waits (bounded by the ready timeout) for
that node's scheduler to say hello, sends it the DP rank's server arguments, and waits for its
ready message. Requests, aborts, control calls and outputs then flow exactly as for a local
scheduler. Its watchdog watches the link instead of a process: when the TCP connection drops
(the node or its scheduler died; TCP keep-alive probes catch a silent peer) every pending
request fails with 503 naming the node, and `on_dead` ends the server as a dead local scheduler
does.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdcore.runtime.dp.nodes import leader_node, link_addrs, set_keepalive
from pdcore.runtime.handle import EngineClient, EngineError, EngineState, engine_info
from pdcore.runtime.tokenizer_export import tokenizer_dir

log = logging.getLogger(__name__)


class RemoteEngineClient(EngineClient):
    def __init__(self, args: Any, **kwargs: Any) -> None:
        kwargs.pop("scheduler_target", None)  # nothing is spawned here
        super().__init__(args, **kwargs)
        self.dp_rank = args.dp_attention_rank
        self.node = leader_node(args, self.dp_rank)
        self._monitor: zmq.asyncio.Socket | None = None

    @property
    def pid(self) -> int | None:
        return None

    def where(self) -> str:
        return f"DP rank {self.dp_rank} on node {self.node}"

    async def _start(self) -> None:
        to_addr, from_addr = link_addrs(self.args, self.dp_rank)
        self._zctx = zmq.asyncio.Context()
        self._pull = self._zctx.socket(zmq.PULL)
        self._push_ctx = zmq.Context()  # sends never block the event loop (as for a local one)
        self._push = self._push_ctx.socket(zmq.PUSH)
        for s in (self._pull, self._push):
            s.setsockopt(zmq.LINGER, 0)
            set_keepalive(s)
        self._push.setsockopt(zmq.SNDHWM, 0)
        try:
            self._pull.bind(from_addr)
            self._push.bind(to_addr)
        except zmq.ZMQError as e:
            raise EngineError(f"{self.where()}: cannot bind its link {to_addr} / {from_addr} "
                              f"(ports after --dist-init-addr's must be free): {e}", 503) from e
        self._monitor = self._pull.get_monitor_socket(zmq.EVENT_ACCEPTED
                                                      | zmq.EVENT_DISCONNECTED)
        log.info("%s: waiting for its scheduler at %s / %s", self.where(), to_addr, from_addr)
        tok_task = None
        if self.tokenizer is None:
            from pdcore.engine.model.tokenizer import load_tokenizer

            tok_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, self.args, True))
        try:
            msg = await asyncio.wait_for(self._handshake(), self.ready_timeout)
        except asyncio.TimeoutError:
            raise EngineError(f"{self.where()} did not start within {self.ready_timeout:.0f}s: "
                              f"start `pdserve serve ... --node-rank {self.node}` with the same "
                              "--dist-init-addr, and see its log", 503) from None
        finally:
            if tok_task is not None and not tok_task.done():
                tok_task.cancel()
        if tok_task is not None:
            self.tokenizer = await tok_task
        self.info = engine_info(msg.get("info"))
        self.info.tokenizer_path = await asyncio.to_thread(
            tokenizer_dir, self.tokenizer, self.info.tokenizer_path
            or self.args.tokenizer_path or self.args.model_path)
        self._tasks = [asyncio.create_task(self._recv_loop(), name="pdserve-recv"),
                       asyncio.create_task(self._watchdog(), name="pdserve-link")]
        self.state = EngineState.READY
        log.info("%s ready", self.where())

    async def _handshake(self) -> dict[str, Any]:
        """hello -> the DP rank's arguments -> its ready (or start-up error) message."""
        assert self._pull is not None and self._push is not None
        sent = False
        while True:
            msg = pickle.loads(await self._pull.recv())
            if isinstance(msg, dict) and "hello" in msg:
                if not sent:  # later hellos were queued before our answer arrived
                    try:
                        self._push.send(pickle.dumps(self.args), flags=zmq.NOBLOCK)
                        sent = True
                    except zmq.Again:  # its other connection is not up yet: next hello
                        pass
                continue
            if isinstance(msg, dict) and msg.get("ok"):
                return msg
            if isinstance(msg, dict):
                raise EngineError(f"{self.where()}: scheduler failed to start: "
                                  f"{msg.get('error')}", 503)

    async def _watchdog(self) -> None:
        """Wait for the link's TCP connection to drop (zmq's monitor: accepted/disconnected)."""
        mon = self._monitor
        assert mon is not None
        while True:
            event = parse_monitor_message(await mon.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                break
        if self._stopping:
            return
        self.state = EngineState.DEAD
        self.error = (f"node {self.node} is gone (the link of its DP rank {self.dp_rank} to "
                      "node 0 closed); this server is exiting, retry on another server or after "
                      "its restart")
        log.error("%s; failing %d pending requests", self.error, len(self._reqs))
        self._fail_pending(self.error, 503)
        if self.on_dead is not None:
            self.on_dead(self.error)

    def _kill_process(self) -> None:
        """Nothing to kill here: the node's own process stops it (the DP ranks stop together)."""

    def _close_sockets(self) -> None:
        if self._pull is not None and self._monitor is not None:
            self._pull.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        super()._close_sockets()
