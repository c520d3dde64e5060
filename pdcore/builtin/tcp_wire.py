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


class PeerClosed(ConnectionError):
    """The other side closed the connection in the middle of a message."""


def tune(sock: socket.socket) -> None:
    """Low latency for acks, big kernel buffers for bulk streams."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:  # capped by net.core.*mem_max; the kernel's default still works
            pass


def _set_deadline(sock: socket.socket, deadline: float | None) -> None:
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)


def send_buffers(sock: socket.socket, bufs: Sequence[memoryview | bytes],
                 deadline: float | None) -> None:
    """Send every buffer in order, up to IOV_MAX per system call, resuming partial sends."""
    pending = [memoryview(b) for b in bufs if len(b)]
    i = 0
    while i < len(pending):
        _set_deadline(sock, deadline)
        chunk = pending[i : i + IOV_MAX]
        sent = sock.sendmsg(chunk)
        # Skip the buffers that went out whole; trim the one that went out in part.
        while sent and i < len(pending):
            n = len(pending[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                pending[i] = pending[i][sent:]
                sent = 0


def recv_buffers(sock: socket.socket, bufs: Sequence[memoryview], deadline: float | None) -> None:
    """Fill every buffer in order, up to IOV_MAX per system call."""
    pending = [b for b in bufs if len(b)]
    i = 0
    while i < len(pending):
        _set_deadline(sock, deadline)
        got = sock.recvmsg_into(pending[i : i + IOV_MAX])[0]
        if got == 0:
            raise PeerClosed("connection closed by the peer")
        while got and i < len(pending):
            n = len(pending[i])
            if got >= n:
                got -= n
                i += 1
            else:
                pending[i] = pending[i][got:]
                got = 0


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray(n)
    recv_buffers(sock, [memoryview(buf)], deadline)
    return bytes(buf)


def drain(sock: socket.socket, n: int, deadline: float | None) -> None:
    """Read and drop n bytes (a rejected batch's payload), keeping the connection usable."""
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n > 0:
        _set_deadline(sock, deadline)
        got = sock.recv_into(scratch, min(n, len(scratch)))
        if got == 0:
            raise PeerClosed("connection closed by the peer")
        n -= got


def encode_reason(reason: str) -> bytes:
    return reason.encode("utf-8", "replace")[:MAX_REASON]
