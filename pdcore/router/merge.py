"""Request shaping and response merging for the PD fan-out (pure functions, no I/O).

- `batch_size`, `inject_bootstrap`: which requests are batches and how the bootstrap fields are
  added (scalars for one request, equal-length lists with a fresh room per item for a batch).
- `prefill_input_logprobs`, `merge_json`, `SSEMerger`: prepend the prefill worker's
  `meta_info.input_token_logprobs` to the decode worker's, per batch index, in JSON or SSE.
- `prefill_echo_logprobs`, `merge_echo_json`: the same for `/v1/completions` with `echo` and
  `logprobs` (lm-eval's loglikelihood): P's prompt entries go before D's.
- `prefill_echo_stream`, `EchoSSEMerger`: a streamed echo: P's echo chunk's entries fill D's
  (empty) echo chunk, per choice index.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pdcore.errors import InvalidRequestError
from pdcore.route_auth import body_digest, sign_route
from pdcore.router.workers import Worker

ROOM_BITS = 63  # bootstrap_room is uniform in [0, 2**63 - 1]


def batch_size(route: str, body: dict[str, Any]) -> int | None:
    """Number of items of a batch request, or None for a single request."""
    if route == "/v1/responses":
        return None  # one input, one output
    if route == "/v1/chat/completions":
        n = body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None
    if route == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if not prompt:
                raise InvalidRequestError("prompt must not be an empty list", field="prompt")
            if isinstance(prompt[0], (str, list)):
                return len(prompt)
        return None
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        if not text:
            raise InvalidRequestError("text must not be an empty list", field="text")
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    if isinstance(ids, list) and not ids and text is None:
        raise InvalidRequestError("input_ids must not be empty", field="input_ids")
    return None


def wants_logprobs(route: str, body: dict[str, Any]) -> bool:
    if route == "/generate":
        return bool(body.get("return_logprob"))
    value = body.get("logprobs")
    if route == "/v1/completions":  # an int; 0 still asks for the sampled token's logprob
        return value is not None and value is not False
    return bool(value)


def inject_bootstrap(
    body: dict[str, Any], prefill: Worker, n: int | None, key: bytes | None = None,
    decode_id: str = "",
) -> dict[str, Any]:
    """The body with the route to `prefill` (one room per prompt), signed with `key` (the
    cluster secret's route key) when the router has one, for the decode server `decode_id` and
    this very body (route_auth: v2 signatures). A client's own route fields, signature
    included, are replaced: the route is never the client's to choose. Rooms come from
    `secrets` (a room is a capability: nobody may predict the next one)."""
    out = dict(body)
    out.pop("bootstrap_sig", None)
    host, port = prefill.bootstrap_host, prefill.bootstrap_port
    if n is None:
        out["bootstrap_host"], out["bootstrap_port"] = host, port
        out["bootstrap_room"] = secrets.randbits(ROOM_BITS)
    else:
        out["bootstrap_host"], out["bootstrap_port"] = [host] * n, [port] * n
        out["bootstrap_room"] = [secrets.randbits(ROOM_BITS) for _ in range(n)]
    if key is not None:
        digest = body_digest(out)
        rooms = out["bootstrap_room"]
        sigs = [sign_route(key, r, host, port, decode_id, digest)
                for r in (rooms if n is not None else [rooms])]
        out["bootstrap_sig"] = sigs if n is not None else sigs[0]
    return out


def _input_logprobs(obj: Any) -> list[Any] | None:
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    value = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return value if isinstance(value, list) else None


def iter_sse_data(body: bytes) -> list[Any]:
    """Parsed JSON payloads of the `data:` lines of a complete SSE body (`[DONE]` skipped)."""
    out = []
    for line in body.splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            continue
        try:
            out.append(json.loads(payload))
        except ValueError:
            continue
    return out


def prefill_input_logprobs(body: bytes, streamed: bool) -> dict[int, list[Any]]:
    """Prefill's prompt logprobs per batch index, from its JSON or (first chunks of) its SSE."""
    found: dict[int, list[Any]] = {}
    if streamed:
        for chunk in iter_sse_data(body):
            idx = chunk.get("index", 0) if isinstance(chunk, dict) else 0
            lp = _input_logprobs(chunk)
            if lp is not None and isinstance(idx, int) and idx not in found:
                found[idx] = lp
        return found
    try:
        obj = json.loads(body)
    except ValueError:
        return found
    items = obj if isinstance(obj, list) else [obj]
    for i, item in enumerate(items):
        lp = _input_logprobs(item)
        if lp is not None:
            found[i] = lp
    return found


def _prepend(obj: Any, prefix: list[Any] | None) -> bool:
    """Prepend in place when the decode object has the key as a list; True if changed."""
    if prefix is None:
        return False
    current = _input_logprobs(obj)
    if current is None:
        return False
    obj["meta_info"]["input_token_logprobs"] = prefix + current
    return True


def _decoded(decode_body: bytes, found: dict[int, Any]) -> Any:
    """Decode's answer parsed, or None when there is nothing to merge or it is not JSON."""
    if not found:
        return None
    try:
        return json.loads(decode_body)
    except ValueError:
        return None


def merge_json(decode_body: bytes, found: dict[int, list[Any]]) -> bytes | None:
    """Decode's JSON with prefill logprobs prepended; None when nothing changed."""
    obj = _decoded(decode_body, found)
    if obj is None:
        return None
    items = obj if isinstance(obj, list) else [obj]
    changed = [_prepend(item, found.get(i)) for i, item in enumerate(items)]
    return json.dumps(obj, ensure_ascii=False).encode() if any(changed) else None


_LP_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _lp_choices(obj: Any) -> dict[int, dict[str, Any]]:
    """A completions answer's (or chunk's) choices that carry logprobs, by choice index."""
    out: dict[int, dict[str, Any]] = {}
    for ch in obj.get("choices") or [] if isinstance(obj, dict) else []:
        if isinstance(ch, dict) and isinstance(ch.get("index"), int) and _has_lp(ch):
            out[ch["index"]] = ch
    return out


def prefill_echo_logprobs(body: bytes) -> dict[int, dict[str, Any]]:
    """P's `choices[i]` by choice index (its logprobs: prompt entries, then the token it
    sampled)."""
    try:
        return _lp_choices(json.loads(body))
    except ValueError:
        return {}


def _has_lp(ch: dict[str, Any]) -> bool:
    lp = ch.get("logprobs")
    return isinstance(lp, dict) and all(isinstance(lp.get(k), list) for k in _LP_KEYS) and \
        isinstance(ch.get("text"), str)


def _merge_echo(d_ch: dict[str, Any], p_ch: dict[str, Any]) -> bool:
    """D's choice (the sampled tokens, P's first included) with P's prompt entries put before
    its logprobs. P samples one token even for max_tokens 0 (the prefill always does): its
    text then ends past the echoed prompt, which is all D's text, and its last entry is
    dropped; when D sampled, P's last entry is D's first (checked)."""
    d, p = d_ch["logprobs"], p_ch["logprobs"]
    if d["tokens"]:
        if not p["tokens"] or p["tokens"][-1] != d["tokens"][0]:
            return False  # not the shape expected: leave D's answer as it is
        cut = len(p["tokens"]) - 1
    else:
        cut = len(p["tokens"]) - (1 if len(p_ch["text"]) > len(d_ch["text"]) else 0)
    for k in _LP_KEYS:
        d[k] = p[k][:max(cut, 0)] + d[k]
    return True


def merge_echo_json(decode_body: bytes, found: dict[int, dict[str, Any]]) -> bytes | None:
    """D's /v1/completions JSON with P's prompt logprobs merged in; None when nothing changed."""
    obj = _decoded(decode_body, found)
    changed = False
    for ch in obj.get("choices") or [] if isinstance(obj, dict) else []:
        p = found.get(ch.get("index")) if isinstance(ch, dict) else None
        if p is not None and _has_lp(ch):
            changed = _merge_echo(ch, p) or changed
    return json.dumps(obj, ensure_ascii=False).encode() if changed else None


def prefill_echo_stream(body: bytes) -> dict[int, dict[str, Any]]:
    """P's streamed echo: the logprobs of the first chunk of each choice index that has them
    (the echoed prompt's entries; its sampled token comes in a later chunk)."""
    found: dict[int, dict[str, Any]] = {}
    for chunk in iter_sse_data(body):
        for idx, ch in _lp_choices(chunk).items():
            found.setdefault(idx, ch["logprobs"])
    return found


class SSEMerger:
    """Incremental SSE rewriter: feed decode's bytes, get whole events with logprobs merged."""

    def __init__(self, found: dict[int, Any]) -> None:
        self._found = found
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = []
        while True:
            cut, sep = self._split_point()
            if cut < 0:
                break
            event, self._buf = self._buf[:cut], self._buf[cut + len(sep):]
            out.append(self._rewrite(event) + sep)
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return self._rewrite(rest) if rest.strip() else rest

    def _split_point(self) -> tuple[int, bytes]:
        best, best_sep = -1, b""
        for sep in (b"\n\n", b"\r\n\r\n"):
            pos = self._buf.find(sep)
            if pos >= 0 and (best < 0 or pos < best):
                best, best_sep = pos, sep
        return best, best_sep

    def _rewrite(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            if self._merge(obj):
                end = b"\r" if line.endswith(b"\r") else b""
                lines[i] = b"data: " + json.dumps(obj, ensure_ascii=False).encode() + end
        return b"\n".join(lines)

    def _merge(self, obj: Any) -> bool:
        """/generate: P's prompt logprobs before D's in the chunk's meta_info."""
        idx = obj.get("index", 0) if isinstance(obj, dict) else 0
        return isinstance(idx, int) and _prepend(obj, self._found.get(idx))


class EchoSSEMerger(SSEMerger):
    """/v1/completions with echo: D's echo chunk (the first of each index, with no entries:
    D computed no prompt logprobs) takes P's."""

    def _merge(self, obj: Any) -> bool:
        changed = False
        for ch in obj.get("choices") or [] if isinstance(obj, dict) else []:
            idx = ch.get("index") if isinstance(ch, dict) else None
            p = self._found.pop(idx, None) if isinstance(idx, int) else None
            lp = ch.get("logprobs") if p is not None else None
            if isinstance(lp, dict) and lp.get("tokens") == []:
                ch["logprobs"] = p
                changed = True
        return changed
