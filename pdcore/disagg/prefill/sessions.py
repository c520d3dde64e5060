"""P's table of decode sessions: one per D rank that registered (its Register validated by
sessions.parse_register), why a refused registration was refused, and the checks every
TransferInfo from a session passes before its pages are used.

The table shares the KV manager's lock: a TransferInfo is checked and attached to its room in
one critical section, so a session dropped after a failed write never gains a room afterwards.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from pdcore.disagg import wire
from pdcore.disagg.sessions import DecodeSession
from pdcore.errors import ProtocolError, TransferError
from pdcore.interfaces.transfer import TransferEngine


def check_prefix(msg: wire.TransferInfo, num_pages: int) -> str:
    """D's cached prefix: fewer pages than it reserved (the last prompt position is always
    sent), with a digest exactly when there is a prefix."""
    if not 0 <= msg.prefix_pages < max(num_pages, 1):
        return (f"TransferInfo.prefix_pages {msg.prefix_pages} is not in [0, {num_pages}) "
                f"(decode must leave at least one of its {num_pages} pages to transfer)")
    if (msg.prefix_pages > 0) != bool(msg.prefix_digest) or len(msg.prefix_digest) > 128:
        return (f"TransferInfo.prefix_digest {msg.prefix_digest[:40]!r} does not fit "
                f"prefix_pages {msg.prefix_pages}")
    return ""


class SessionTable:
    def __init__(self, backend: TransferEngine, lock: threading.RLock) -> None:
        self._backend, self._lock = backend, lock
        self._sessions: dict[str, DecodeSession] = {}
        self._rejected: dict[str, str] = {}  # session -> why its registration was refused

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def refuse(self, key: str, why: str) -> None:
        with self._lock:
            self._rejected[key] = why

    def register(self, sess: DecodeSession) -> bool:
        """Keep `sess`; False when the same D registered again (it lost and found us): the
        session it had, with its peer connection, is kept and cleared of its failure."""
        msg = sess.reg
        with self._lock:
            old = self._sessions.get(sess.key)
            if old is not None and old.reg.endpoint == msg.endpoint and old.layout == sess.layout:
                old.failed, old.reg = "", msg
                return False
            self._sessions[sess.key] = sess
            self._rejected.pop(sess.key, None)
        if old is not None and old.peer is not None:
            self._backend.disconnect(old.peer)
        return True

    def check(self, msg: wire.TransferInfo) -> tuple[str, str, np.ndarray]:
        """(wire code, why msg is refused or '', its destination pages)."""
        code, why = "", ""
        with self._lock:
            sess = self._sessions.get(msg.session)
            if sess is None:
                why = self._rejected.get(msg.session, "")
                if not why:
                    code = wire.UNKNOWN_SESSION
                    why = (f"decode session {msg.session} is not registered here (prefill "
                           f"restarted?); decode re-registers on its next request")
        pages = np.zeros(0, dtype=np.int64)
        if not why:
            try:
                pages = msg.pages()
            except ProtocolError as e:
                why = str(e)
        if not why and sess is not None:
            why = (sess.check_pages(pages) or sess.check_aux_slot(msg.aux_slot)
                   or sess.check_grant(msg.staging_offset, msg.staging_len))
        if not why and msg.required < 1:
            why = f"required TransferInfo count {msg.required} < 1"
        if not why:
            why = check_prefix(msg, len(pages))
        return code, why, pages

    def get(self, key: str) -> DecodeSession:
        """The live session `key`; TransferError when it is gone or failed."""
        with self._lock:
            sess = self._sessions.get(key)
        if sess is None or sess.failed:  # a failed session is dropped from the table at once
            raise TransferError(f"decode session {key} is gone (it re-registered or was dropped)")
        return sess

    def drop(self, sess: DecodeSession, why: str) -> None:
        """Mark `sess` failed and forget it (unless it was replaced already)."""
        with self._lock:
            if not sess.failed:
                sess.failed, sess.failed_at = why, time.monotonic()
            dropped = self._sessions.get(sess.key) is sess
            if dropped:
                del self._sessions[sess.key]
        if dropped and sess.peer is not None:
            self._backend.disconnect(sess.peer)
