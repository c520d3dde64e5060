"""A userspace TCP fault proxy for tests and benches (#49 item 4; the kernel here has no netem).

`FaultProxy(listen_host, listen_port, target_host, target_port).start()` forwards every
connection to the target, in an asyncio loop on a thread of its own (started from a thread
inside a network namespace, it listens and connects in that namespace: pdcore.testing.netns).
What it does to the traffic can change at any time:
- `latency_s = (lo, hi)`: each chunk, either way, is held a uniform random time in [lo, hi]
  before it is passed on (order kept per direction);
- `loss`: the probability that a chunk is lost: TCP hides a lost segment by sending it again
  after its retransmission timeout, so a lost chunk is held `rto_s` (a uniform random time in
  (lo, hi), default 0.2-0.4 s) more; a userspace proxy cannot drop bytes from inside a stream;
- `break_p`: the probability that a new connection is broken: reset (RST) after a random
  1..`break_after_bytes` bytes passed (a link so lossy the transport gives up);
- `reset_all()`: reset every open connection now;
- `refuse = True`: new connections are reset at once.
Counters: `connections`, `broken` (by `break_p`, `reset_all` or `refuse`), `lost` (chunks held
by `loss`), `bytes_up`/`bytes_down`.
Only the addresses it was given are contacted.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading


class FaultProxy:
    def __init__(self, listen_host: str, listen_port: int, target_host: str, target_port: int,
                 *, seed: int | None = None) -> None:
        self.listen = (listen_host, listen_port)
        self.target = (target_host, target_port)
        self.latency_s: tuple[float, float] = (0.0, 0.0)
        self.loss = 0.0
        self.rto_s: tuple[float, float] = (0.2, 0.4)
        self.break_p = 0.0
        self.break_after_bytes = 64 * 1024
        self.refuse = False
        self.connections = self.broken = self.lost = self.bytes_up = self.bytes_down = 0
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 10.0) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name=f"fault-proxy-{self.listen[1]}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"fault proxy on {self.listen} did not start")
        if self._error is not None:
            raise RuntimeError(f"fault proxy on {self.listen}: {self._error}")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._serve, *self.listen, reuse_address=True))
        except OSError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        async def _close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._open):
                _abort(w)
            loop.set_exception_handler(lambda *_: None)  # the cancelled connections' noise
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(_close(), loop)
        if self._thread is not None:
            self._thread.join(10)

    def counters(self) -> dict[str, int]:
        return {"connections": self.connections, "broken": self.broken, "lost": self.lost,
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down}

    def reset_all(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            def _reset() -> None:
                for w in list(self._open):
                    self.broken += 1
                    _abort(w)
            loop.call_soon_threadsafe(_reset)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.refuse:
            self.broken += 1
            _abort(writer)
            return
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(*self.target), 10)
        except (OSError, asyncio.TimeoutError):
            _abort(writer)
            return
        self._open |= {writer, up_w}
        budget = (self._rng.randint(1, self.break_after_bytes)
                  if self._rng.random() < self.break_p else None)
        state = {"budget": budget}
        try:
            await asyncio.gather(self._pipe(reader, up_w, True, state, writer),
                                 self._pipe(up_r, writer, False, state, up_w))
        finally:
            self._open -= {writer, up_w}
            for w in (writer, up_w):
                w.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool,
                    state: dict[str, int | None], other: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                lo, hi = self.latency_s
                delay = self._rng.uniform(lo, hi) if hi > 0 else 0.0
                if self.loss and self._rng.random() < self.loss:
                    self.lost += 1
                    delay += self._rng.uniform(*self.rto_s)
                if delay:
                    await asyncio.sleep(delay)
                budget = state["budget"]
                if budget is not None:
                    if len(data) >= budget:  # the loss strikes inside this chunk
                        dst.write(data[:budget])
                        self.broken += 1
                        _abort(dst)
                        _abort(other)
                        return
                    state["budget"] = budget - len(data)
                dst.write(data)
                await dst.drain()
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
        except (OSError, asyncio.IncompleteReadError):
            _abort(dst)
            _abort(other)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), not FIN: the peer sees a reset connection."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
