"""Control-plane messages between decode (D) and prefill (P) KV managers.

Every message is a msgspec Struct encoded as a msgpack map with a type tag `t` and the protocol
version `v`. With a cluster secret (`--disaggregation-auth-token`) a message travels as two zmq
frames, the payload and its HMAC-SHA256 under `route_auth.control_key(secret)`: the secret
itself never leaves the process, and the MAC is checked before a byte of the payload is
parsed, so a foreign or hostile sender can never make a manager act. Version 2 peers put the
secret itself in the payload's `token` field; `decode` still reads that field to refuse such a
peer in words it understands (only when it proves the same secret).

D -> P: Hello (once per P rank per P instance, with a cluster secret: P must answer it with a
MAC over D's nonce before D reveals anything), Register (once per P rank per P instance),
Claim (per room, on admission), TransferInfo (per room), Abort.
P -> D: HelloAck, Claimed (P has the room: D may reserve its pages), Status (per room:
Success / Failed, optional aux row payload), AbortAck.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from pdcore.disagg.states import KVPoll
from pdcore.errors import ProtocolError
from pdcore.interfaces.planner import KVLayout
from pdcore.messages.bootstrap import BootstrapInfo
from pdcore.route_auth import control_key
from pdcore.route_refusal import ROUTE_REFUSED as _ROUTE_REFUSED

# 2: TransferInfo carries the prompt prefix decode already holds (prefix_pages, prefix_digest)
# 3: messages are MACed (never the secret itself); Hello/HelloAck; the model fingerprint
# 4: TransferInfo names the decode server (decode_id) and digests its whole prompt: P binds a
#    room to the first decode server that claims it and sends nothing unless the prompts match
PROTOCOL_VERSION = 4
NO_AUX_SLOT = -1


class _Msg(msgspec.Struct, tag_field="t", kw_only=True):
    v: int = PROTOCOL_VERSION
    token: str = ""  # version 2 carried the secret here; version 3 leaves it empty


class Hello(_Msg, tag="hello"):
    """D rank -> P rank before Register: P proves it holds the cluster secret by answering
    with a MACed HelloAck that echoes `nonce` (fresh per attempt, so no old answer replays)."""

    nonce: str
    session: str
    ctrl_addr: str


class HelloAck(_Msg, tag="hello_ack"):
    nonce: str
    rank: int


class Register(_Msg, tag="register"):
    """D rank -> P rank: how to reach D's memory. Re-sent after a P restart."""

    session: str  # unique per D manager instance (a restarted D has a new one)
    ctrl_addr: str  # tcp://ip:port of D's PULL socket
    backend: str  # D's transfer backend name; P must use the same
    endpoint: bytes  # backend endpoint / metadata blob
    layout: dict[str, Any]  # KVLayout.to_dict()
    regions: list[dict[str, Any]]  # D's KV MemoryRegion.to_dict()s
    aux_region: dict[str, Any]
    aux_row_bytes: int
    aux_slots: int
    rank: int
    tp_size: int
    page_size: int
    dtype: str
    staging_region: dict[str, Any] | None = None  # D's staging ring (MemoryRegion.to_dict())
    model_fingerprint: str = ""  # engine.fingerprint of D's model; P refuses another model
    # the draft head's chain start in D's aux rows (aux.py): its vector's size and dtype;
    # 0 / "": no draft head, no chain start part
    chain_hidden: int = 0
    chain_dtype: str = ""
    chain_head: str = ""  # which draft head (fingerprint.draft_identity); "": none or unsaid


class Claim(_Msg, tag="claim"):
    """D rank -> P rank when D admits a request: this decode server takes the room. P binds
    the room to it and answers Claimed once P has the request itself; D reserves no page
    before that (a request sent to D alone never holds D's pool)."""

    room: int
    session: str
    ctrl_addr: str
    rank: int
    decode_id: str


class Claimed(_Msg, tag="claimed"):
    """P rank -> D rank: P has the room's request and it is bound to this decode server."""

    room: int
    rank: int


class TransferInfo(_Msg, tag="transfer_info"):
    """D rank -> P rank: the pages and aux slot D reserved for a room."""

    room: int
    session: str
    ctrl_addr: str
    rank: int
    dst_pages: bytes  # little-endian int32 page indices
    aux_slot: int = NO_AUX_SLOT
    required: int = 1  # TransferInfos this P rank needs for the room (D TP > P TP)
    staging_offset: int = -1  # grant in D's staging ring for this room (-1: none)
    staging_len: int = 0  # the grant covers pages [prefix_pages, len(dst_pages))
    # leading destination pages D already holds (its prefix cache) and the digest of their
    # tokens (prefix_digest()); P writes none of them, and only if the digest is its prompt's
    prefix_pages: int = 0
    prefix_digest: str = ""
    # the decode server (all its ranks: its server id) and the digest of its whole prompt
    # (prefix_digest() of every prompt token id): a room is bound to one decode server, and P
    # refuses to prefill for a decode server whose prompt is not its own
    decode_id: str = ""
    prompt_digest: str = ""

    def pages(self) -> np.ndarray:
        if len(self.dst_pages) % 4:
            raise ProtocolError("TransferInfo.dst_pages is not a whole number of int32 values")
        return np.frombuffer(self.dst_pages, dtype="<i4").astype(np.int64)


class Abort(_Msg, tag="abort"):
    room: int
    session: str
    ctrl_addr: str
    reason: str = ""
    code: str = ""  # PAIRING_REFUSED: D will not pair with this P (the reason says why)


class Status(_Msg, tag="status"):
    """P rank -> D rank. `aux` carries the aux row when the backend moves no data."""

    room: int
    state: int  # KVPoll value
    rank: int
    reason: str = ""
    code: str = ""  # machine-readable cause, e.g. UNKNOWN_SESSION
    aux: bytes = b""
    staged: bool = False  # Success: the KV went into D's staging grant (D must scatter it)


class AbortAck(_Msg, tag="abort_ack"):
    room: int
    rank: int


Message = Hello | HelloAck | Register | Claim | Claimed | TransferInfo | Abort | Status | AbortAck
UNKNOWN_SESSION = "unknown_session"  # Status.code: P does not know D's session (P restarted)
# Status.code: a transfer into D's session failed and P dropped the session; D registers again
SESSION_FAILED = "session_failed"
DECODE_ABORT = "decode_abort"  # not sent: P's record that D aborted the room
# not sent: P's record that no decode server claimed the room in time (D refused the route)
UNCLAIMED = "unclaimed"
# Status.code: P dropped the room's early messages (claim, pages): too many rooms whose request
# P has not got (a flood of claims for rooms that never come); D fails the room (502)
PENDING_EVICTED = "pending_evicted"
# the codes that put the blame for a failed room on decode (P answers 502, not 500)
DECODE_FAULTS = frozenset({UNKNOWN_SESSION, SESSION_FAILED, DECODE_ABORT, UNCLAIMED})
PREFILL_FAULT = "prefill_fault"  # not sent: D's record that its prefill peer failed the room
PREFILL_RESTARTED = "prefill_restarted"  # not sent: ... because that prefill instance restarted
VERSION_MISMATCH = "version_mismatch"  # Status.code: the peer speaks another protocol version
# Status.code / Abort.code: one side refused to pair with the other (model, page size, layout)
PAIRING_REFUSED = "pairing_refused"
# Status.code: the room is bound to another decode server (a copied route): nothing moves
ROOM_CLAIMED = "room_claimed"
# Status.code: decode's prompt is not the prompt prefill has for the room: nothing moves
PROMPT_MISMATCH = "prompt_mismatch"
# not sent: P's record that decode refused the room's route (its notice, route_refusal.py): 403
ROUTE_REFUSED = _ROUTE_REFUSED
# the codes that mean the request (its copied route or its prompt) is at fault: 409, not 5xx
CLIENT_FAULTS = frozenset({ROOM_CLAIMED, PROMPT_MISMATCH})


class _Header(msgspec.Struct):
    t: str = ""
    v: int = -1
    token: str = ""


class _Reply(msgspec.Struct):
    """The fields a refusal of a foreign-version message needs (every version has them)."""

    room: int = -1
    session: str = ""
    ctrl_addr: str = ""


class VersionMismatch(ProtocolError):
    """A well-formed message of another protocol version (an older or newer peer): the
    receiver answers it in the sender's version when it can (see refusal())."""

    def __init__(self, message: str, kind: str, version: int, reply: _Reply) -> None:
        super().__init__(message)
        self.kind, self.version = kind, version
        self.room, self.session, self.ctrl_addr = reply.room, reply.session, reply.ctrl_addr


_encoder = msgspec.msgpack.Encoder()
_header = msgspec.msgpack.Decoder(_Header)
_full = msgspec.msgpack.Decoder(Message)
_reply = msgspec.msgpack.Decoder(_Reply)


def prefix_digest(tokens: Sequence[int]) -> str:
    """Digest of a prompt prefix's token ids: D's cached pages are reused only when P's own
    prompt gives the same digest (the bytes are then the KV of the same tokens)."""
    data = np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def encode_pages(pages: np.ndarray) -> bytes:
    arr = np.asarray(pages)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("page indices must be in [0, 2^31)")
    return arr.astype("<i4", copy=False).tobytes()


@functools.lru_cache(maxsize=8)
def _key(token: str) -> bytes:
    return control_key(token)


def _mac(token: str, payload: bytes) -> bytes:
    return hmac.new(_key(token), payload, hashlib.sha256).digest()


def encode(msg: Message, token: str | None = None) -> list[bytes]:
    """The zmq frames of msg: [payload] without a secret, [payload, MAC] with one."""
    payload = _encoder.encode(msg)
    return [payload, _mac(token, payload)] if token else [payload]


def decode(frames: list[bytes], token: str | None = None) -> Message:
    """Parse one message. ProtocolError on garbage, another version, or a wrong MAC."""
    if not frames or len(frames) > 2:
        raise ProtocolError(f"control message of {len(frames)} frames (1 or 2 expected)")
    data, mac = frames[0], frames[1] if len(frames) == 2 else b""
    if token and mac and not hmac.compare_digest(mac, _mac(token, data)):  # before parsing
        raise ProtocolError("control message with a wrong MAC: the sender does not hold this "
                            "server's --disaggregation-auth-token")
    try:
        head = _header.decode(data)
    except (msgspec.DecodeError, TypeError) as e:
        raise ProtocolError(f"malformed control message ({e})") from None
    if head.v != PROTOCOL_VERSION:
        why = (f"control message {head.t!r} speaks PD protocol version {head.v}, this server "
               f"speaks {PROTOCOL_VERSION}; run the same pdserve version on prefill and decode")
        # a version 2 peer proves the secret by sending it; never answer one that does not
        legacy_ok = not token or hmac.compare_digest(head.token.encode(), token.encode())
        if not (legacy_ok or mac):
            raise ProtocolError(why)
        try:
            reply = _reply.decode(data)
        except (msgspec.DecodeError, TypeError):
            reply = _Reply()
        raise VersionMismatch(why, head.t, head.v, reply)
    if token and not mac:
        raise ProtocolError(f"control message {head.t!r} carries no MAC; give both servers the "
                            "same --disaggregation-auth-token")
    if mac and not token:
        raise ProtocolError(f"control message {head.t!r} is MACed but this server has no "
                            "--disaggregation-auth-token; give both servers the same one")
    try:
        return _full.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed control message {head.t!r}: {e}") from None


def refusal(err: VersionMismatch, rank: int, token: str | None = None) -> list[bytes] | None:
    """The frames of a Status(Failed) for the room of a foreign-version message, in the sender's
    version so another peer can read why (Status has the same fields in versions 1 to 3): a
    version 2 peer gets the secret it proved it holds in `token`, a later one a MAC; None when
    the message names no room."""
    if err.room < 0:
        return None
    legacy = err.version < 3
    payload = _encoder.encode(Status(v=err.version, token=token or "" if legacy else "",
                                     room=err.room, state=int(KVPoll.Failed), rank=rank,
                                     reason=str(err), code=VERSION_MISMATCH))
    return [payload, _mac(token, payload)] if token and not legacy else [payload]


def check_pairing(role: str, peer: BootstrapInfo, local: KVLayout, fingerprint: str,
                  chain: dict[str, Any] | None = None) -> None:
    """What must match before KV crosses, from the peer's bootstrap info or registration: the
    model (fingerprint: config and weight files), page size, KV dtype and KV layout, and the
    draft head's chain start in the aux rows (`chain`: this server's AuxBuffers.chain_info()).
    ProtocolError names the first mismatch and what to fix; fields the peer does not send
    (an older peer, a unit test) are not compared."""
    check_compatible(role, peer.page_size, peer.kv_cache_dtype, local)
    theirs = peer.model_fingerprint
    if theirs and fingerprint and theirs != fingerprint:
        raise ProtocolError(
            f"{role} serves another model (fingerprint {theirs}, this server's {fingerprint}: "
            "config.json or weight files differ); start prefill and decode with the same "
            "--model-path (and --load-format / --random-seed)")
    check_draft(role, peer, local)
    if chain is not None:
        check_chain(role, peer, chain)
    for key, theirs_, mine in (("num_layers", peer.num_layers, local.num_layers),
                               ("head_dim", peer.head_dim, local.head_dim),
                               ("total_kv_heads", peer.total_kv_heads, local.model_kv_heads),
                               ("is_mla", peer.is_mla, local.is_mla)):
        if theirs_ is not None and theirs_ != mine:
            raise ProtocolError(f"{role} KV layout has {key}={theirs_}, this server's "
                                f"{mine}: the two servers run different models")


def check_draft(role: str, peer: BootstrapInfo, local: KVLayout) -> None:
    """Both servers run a draft head whose K/V travel with the target's (EAGLE or NEXTN: one
    more KV layer, `KVLayout.draft_layers`; NEXTN's one more MLA latent layer), or neither
    does: a decode server with a head needs the draft context prefill computes, and a prefill
    server with one sends a layer decode has no room for. A peer that sends a layer count but
    no draft count runs no head (an older peer)."""
    theirs = peer.draft_layers
    if theirs is None and peer.num_layers is not None:
        theirs = 0
    if theirs is None or theirs == local.draft_layers:
        return

    def runs(n: int) -> str:
        return (f"runs a speculative draft head whose KV travels with the target's ({n} draft "
                "layer)" if n else "runs no draft head (no KV of one to send or receive)")

    raise ProtocolError(
        f"{role} {runs(theirs)}, this server {runs(local.draft_layers)}: start prefill and "
        "decode with the same --speculative-algorithm (EAGLE with the same "
        "--speculative-draft-model-path, or NEXTN), or neither with a draft head (NGRAM on "
        "decode alone needs nothing from prefill)")


def check_chain(role: str, peer: BootstrapInfo, local: dict[str, Any]) -> None:
    """A draft head's chain start (the first draft token and the head's output vector, D's
    first drafts) rides in the aux rows: both sides' must have the same vector size and dtype,
    or both none. A peer that sends no chain geometry (an older peer) is not compared: the aux
    row size check refuses one whose rows differ."""
    if peer.chain_hidden is None:
        return
    theirs = (peer.chain_hidden, peer.chain_dtype or "")
    mine = (int(local["chain_hidden"]), str(local["chain_dtype"]))
    if theirs == mine:
        theirs_head = peer.chain_head or ""
        check_chain_head(role, theirs_head, str(local.get("chain_head") or ""))
        return

    def says(h: int, dtype: str) -> str:
        return (f"a speculative chain start of {h} x {dtype}" if h else
                "no speculative chain start (no draft head)")

    raise ProtocolError(
        f"{role} carries {says(*theirs)} in its aux rows, this server {says(*mine)}: start "
        "prefill and decode with the same --speculative-algorithm, --model-path and --dtype "
        "(the draft head's output vector crosses beside the first token)")


def check_chain_head(role: str, theirs: str, mine: str) -> None:
    """Same vector geometry, another head (EAGLE on one side, EAGLE3 on the other, or two
    EAGLE heads with other weights): D's head would draft from a vector it never learned from.
    A peer that names no head (an older peer) is not compared; the name is the peer's, so it
    is shown cut short."""
    if not theirs or not mine or theirs == mine:
        return
    raise ProtocolError(
        f"{role} runs the draft head {theirs[:64]!r}, this server {mine!r}: the chain start "
        "it hands over is that head's output vector; start prefill and decode with the same "
        "--speculative-algorithm and --speculative-draft-model-path")


def check_compatible(role: str, peer_page_size: int, peer_dtype: str, local: KVLayout) -> None:
    """Page size and KV dtype must match on both sides (the pages are copied byte for byte)."""
    if peer_page_size != local.page_size:
        raise ProtocolError(
            f"{role} page size {peer_page_size} != local page size {local.page_size}; start "
            f"prefill and decode with the same --page-size")
    if str(peer_dtype) != str(local.dtype):
        raise ProtocolError(
            f"{role} KV dtype {peer_dtype} != local KV dtype {local.dtype}; start prefill and "
            f"decode with the same --kv-cache-dtype (auto follows --dtype)")
