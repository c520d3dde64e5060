"""Wire format and socket helpers of the `tcp` data plane.

One connection carries batches one after another:

  hello  (sender -> receiver, once):  b"PDHI", version u16, 16-byte token
  hello ack (receiver -> sender):     b"PDOK" or b"PDNO" + u16 reason length + reason
  batch  (sender -> receiver):        b"PDKV", version u16, flags u16, handle u64, count u64,
                                      total bytes u64, then count dst u64, count len u64 (little
                                      endian), then the source bytes of every item in order
  ack    (receiver -> sender):        b"PDAK", handle u64, status u8 (0 ok), reason length u16,
                                      reason (utf-8)

Bulk bytes go through sendmsg / recvmsg_into with many buffers per system call, straight from
and into registered memory: Python never copies payload bytes.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Sequence

VERSION = 1
TOKEN_LEN = 16
HELLO = struct.Struct(f"<4sH{TOKEN_LEN}s")
HELLO_MAGIC = b"PDHI"
HELLO_OK = b"PDOK"
HELLO_NO = b"PDNO"
REASON_LEN = struct.Struct("<H")
BATCH = struct.Struct("<4sHHQQQ")
BATCH_MAGIC = b"PDKV"
ACK = struct.Struct("<4sQBH")
ACK_MAGIC = b"PDAK"
MAX_REASON = 2000
# Buffers per sendmsg/recvmsg call: the kernel's IOV_MAX on Linux.
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
SOCK_BUF = 8 << 20
WINDOW_BYTES = 64 << 20


class PeerClosed(ConnectionError):
    """The other side closed the connection in the middle of a message."""


def tune(sock: socket.socket) -> None:
    """Blocking mode (see arm), low latency for acks, big kernel buffers for bulk streams."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:  # capped by net.core.*mem_max; the kernel's default still works
            pass


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("@ll", sec, int((seconds - sec) * 1e6))


def arm(sock: socket.socket, deadline: float | None, sending: bool) -> None:
    """Bound the next blocking call by the batch deadline (SO_SNDTIMEO / SO_RCVTIMEO).

    Sockets stay in blocking mode (timeout None) so one sendmsg / recvmsg_into(MSG_WAITALL)
    moves a whole window inside the kernel, as a plain sendall does; Python's own socket
    timeouts would make every call non-blocking and return after each socket buffer's worth.
    """
    if deadline is None:
        tv = _timeval(0)  # 0 = wait forever (an idle connection between batches)
    else:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        tv = _timeval(max(left, 0.001))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO if sending else socket.SO_RCVTIMEO, tv)


def _advance(window: list[memoryview], done: int) -> None:
    """Drop what a system call moved from the front of the window (trim a partial buffer)."""
    k = 0
    while done:
        n = len(window[k])
        if done >= n:
            done -= n
            k += 1
        else:
            window[k] = window[k][done:]
            done = 0
    del window[:k]


def stream(sock: socket.socket, sending: bool, head: Sequence[bytes | memoryview],
           views: Sequence[memoryview], ridx: Sequence[int], offs: Sequence[int],
           *, lens: Sequence[int], deadline: float | None) -> None:
    """Send (or receive) `head` then item i = views[ridx[i]][offs[i]:offs[i]+lens[i]] for all i.

    Many buffers go to each sendmsg/recvmsg_into, but only about WINDOW_BYTES of them: the
    kernel moves at most a socket buffer per call, and Python re-reads every buffer it is given.
    Item views are made as the window advances, so the first bytes leave before the last
    view exists and the peer starts while we are still slicing.
    """
    window = [memoryview(b) for b in head if len(b)]
    wbytes = sum(len(b) for b in window)
    n, j = len(lens), 0
    while True:
        while j < n and len(window) < IOV_MAX and wbytes < WINDOW_BYTES:
            k = lens[j]
            if k:
                o = offs[j]
                window.append(views[ridx[j]][o : o + k])
                wbytes += k
            j += 1
        if not window:
            return
        arm(sock, deadline, sending)
        try:
            if sending:
                done = sock.sendmsg(window)
            else:
                done = sock.recvmsg_into(window, 0, socket.MSG_WAITALL)[0]
                if done == 0:
                    raise PeerClosed("connection closed by the peer")
        except BlockingIOError:  # SO_*TIMEO expired with nothing moved
            raise TimeoutError("timed out") from None
        wbytes -= done
        _advance(window, done)


def send_buffers(sock: socket.socket, bufs: Sequence[memoryview | bytes],
                 deadline: float | None) -> None:
    stream(sock, True, bufs, (), (), (), lens=(), deadline=deadline)


def recv_buffers(sock: socket.socket, bufs: Sequence[memoryview], deadline: float | None) -> None:
    stream(sock, False, bufs, (), (), (), lens=(), deadline=deadline)


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray(n)
    recv_buffers(sock, [memoryview(buf)], deadline)
    return bytes(buf)


def drain(sock: socket.socket, n: int, deadline: float | None) -> None:
    """Read and drop n bytes (a rejected batch's payload), keeping the connection usable."""
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n > 0:
        k = min(n, len(scratch))
        recv_buffers(sock, [scratch[:k]], deadline)
        n -= k


def encode_reason(reason: str) -> bytes:
    return reason.encode("utf-8", "replace")[:MAX_REASON]
