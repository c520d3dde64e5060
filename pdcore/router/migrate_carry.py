"""What a migrated stream's later legs need rewritten so that the client sees one stream
(router/migrate.py feeds them every leg's whole events, id comments already stripped).

- `LogprobCarry`, native `/generate` with logprobs: each event's `output_*logprobs` lists run
  from the first output token, a resumed leg's from its own first token: the lists the client
  already has go before them. (OpenAI chunks carry only their own tokens' logprobs, and the
  first leg's prompt logprobs are merge.SSEMerger's, which serves every leg.)
- `ResponsesCarry`, `/v1/responses`: the events number themselves (`sequence_number`) and
  name the response and its output items by id. A resumed server builds the output so far
  again, silently, under ids of its own: its events get the next sequence numbers, the first
  leg's response id and created_at, and the first leg's item id for each output index it
  already had (a new item keeps its new id).
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]"


class Carry:
    """Rewrites each `data:` JSON object of whole events with `_obj` (True: changed)."""

    def new_leg(self) -> None:
        raise NotImplementedError

    def _obj(self, obj: dict[str, Any]) -> bool:
        raise NotImplementedError

    def feed(self, events: bytes) -> bytes:
        return b"".join(self._event(e) + b"\n\n" for e in events.split(b"\n\n")[:-1])

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:") or line.strip() == DONE:
                continue
            try:
                obj = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(obj, dict) and self._obj(obj):
                lines[i] = b"data: " + json.dumps(obj, ensure_ascii=False).encode()
        return b"\n".join(lines)


class LogprobCarry(Carry):
    """Native /generate with logprobs (module doc)."""

    def __init__(self) -> None:
        self._kept: dict[str, list[Any]] = {}  # the last forwarded event's lists
        self._prefix: dict[str, list[Any]] = {}  # what the current leg's lists follow

    def new_leg(self) -> None:
        self._prefix = {k: list(v) for k, v in self._kept.items()}

    def _obj(self, obj: dict[str, Any]) -> bool:
        meta = obj.get("meta_info")
        if not isinstance(meta, dict):
            return False
        for key, value in meta.items():
            if key.startswith("output_") and key.endswith("logprobs") and isinstance(value, list):
                meta[key] = self._prefix.get(key, []) + value
                self._kept[key] = meta[key]
        return bool(self._prefix)


class ResponsesCarry(Carry):
    """/v1/responses (module doc)."""

    def __init__(self) -> None:
        self.seq = 0  # the next sequence number the client gets
        self.response: dict[str, Any] | None = None  # the first leg's response object
        self._items: dict[int, str] = {}  # output index -> the first leg's item id
        self._resumed = False

    def new_leg(self) -> None:
        self._resumed = True

    def _item(self, idx: Any, item: Any) -> None:
        if not isinstance(item, dict) or not isinstance(idx, int):
            return
        if self._resumed and idx in self._items:
            item["id"] = self._items[idx]
        elif isinstance(item.get("id"), str):
            self._items.setdefault(idx, item["id"])

    def _obj(self, obj: dict[str, Any]) -> bool:
        if self._resumed:
            obj["sequence_number"] = self.seq
        self.seq = (obj["sequence_number"] if isinstance(obj.get("sequence_number"), int)
                    else self.seq) + 1
        resp = obj.get("response")
        if isinstance(resp, dict):
            if self.response is None:
                self.response = dict(resp)
            elif self._resumed:
                resp["id"] = self.response.get("id")
                resp["created_at"] = self.response.get("created_at")
            for k, item in enumerate(resp.get("output") or []):
                self._item(k, item)
        idx = obj.get("output_index")
        if "item" in obj:
            self._item(idx, obj["item"])
        if self._resumed and isinstance(idx, int) and idx in self._items and "item_id" in obj:
            obj["item_id"] = self._items[idx]
        return self._resumed

    def failed(self, message: str) -> bytes:
        """The end of a stream no server could take over: Responses' error events."""
        err = {"code": "server_error", "message": message}
        resp = {**(self.response or {}), "status": "failed", "error": err}
        out = b""
        for kind, data in (("error", {**err, "param": None}), ("response.failed",
                                                               {"response": resp})):
            payload = {"type": kind, "sequence_number": self.seq, **data}
            self.seq += 1
            out += (f"event: {kind}\ndata: " + json.dumps(payload, ensure_ascii=False) +
                    "\n\n").encode()
        return out
