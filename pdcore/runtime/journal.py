"""What the HTTP process records of each request for the operator's flags (SGLang's names):

- `--log-requests` with `--log-requests-level` 0..3: one line per finished request (0: rid,
  token counts, latency, outcome; 1: + its sampling parameters; 2: + the first 512 prompt
  and output token ids; 3: + all of them);
- `--show-time-cost`: one line per request with its time to first token and decode time;
- `--crash-dump-folder`: the requests that arrived in the last CRASH_DUMP_WINDOW_S seconds
  (ids, sampling, whether they finished), written as one JSON file when the engine dies.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from typing import Any

from pdcore.messages.io import GenerateReq

log = logging.getLogger("pdcore.runtime.handle")

CRASH_DUMP_WINDOW_S = 300.0  # SGLang dumps the last 5 minutes of requests
LEVEL2_IDS = 512


def _ids(ids: list[int], level: int) -> str:
    return str(ids if level >= 3 else ids[:LEVEL2_IDS])


class RequestJournal:
    def __init__(self, args: Any) -> None:
        self.log_requests = bool(getattr(args, "log_requests", False))
        self.level = int(getattr(args, "log_requests_level", 0) or 0)
        self.time_cost = bool(getattr(args, "show_time_cost", False))
        self.dump_folder = getattr(args, "crash_dump_folder", None)
        self.recent: collections.deque[dict[str, Any]] = collections.deque()
        self.by_rid: dict[str, dict[str, Any]] = {}

    def start(self, req: GenerateReq) -> None:
        if not self.dump_folder:
            return
        now = time.time()
        while self.recent and now - self.recent[0]["arrival"] > CRASH_DUMP_WINDOW_S:
            self.by_rid.pop(self.recent.popleft()["rid"], None)
        entry = {"rid": req.rid, "arrival": now, "input_ids": list(req.input_ids),
                 "sampling": dataclasses.asdict(req.sampling), "finished": None}
        self.recent.append(entry)
        self.by_rid[req.rid] = entry

    def end(self, req: GenerateReq, output_ids: list[int], started: float,
            first_at: float | None, outcome: str) -> None:
        now = time.monotonic()
        if req.rid in self.by_rid:
            self.by_rid[req.rid]["finished"] = outcome
        if self.log_requests:
            line = (f"request {req.rid}: {len(req.input_ids)} prompt tokens, {len(output_ids)} "
                    f"output tokens, {(now - started) * 1000:.1f} ms, {outcome}")
            if self.level >= 1:
                line += f"; sampling {dataclasses.asdict(req.sampling)}"
            if self.level >= 2:
                line += (f"; prompt ids {_ids(list(req.input_ids), self.level)}; output ids "
                         f"{_ids(output_ids, self.level)}")
            log.info("%s", line)
        if self.time_cost:
            ttft = (first_at - started) * 1000 if first_at is not None else float("nan")
            decode = (now - first_at) * 1000 if first_at is not None else 0.0
            rate = (len(output_ids) - 1) / (now - first_at) if first_at is not None \
                and now > first_at and len(output_ids) > 1 else 0.0
            log.info("time cost %s: first token %.1f ms, decode %.1f ms for %d tokens "
                     "(%.1f tokens/s), total %.1f ms", req.rid, ttft, decode,
                     max(0, len(output_ids) - 1), rate, (now - started) * 1000)

    def dump(self, reason: str) -> str | None:
        """Write the recent requests to --crash-dump-folder; the file's path, or None."""
        if not self.dump_folder:
            return None
        try:
            os.makedirs(self.dump_folder, exist_ok=True)
            path = os.path.join(self.dump_folder, time.strftime("crash_dump_%Y%m%d-%H%M%S")
                                + f"-{os.getpid()}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"reason": reason, "time": time.time(),
                           "window_s": CRASH_DUMP_WINDOW_S, "requests": list(self.recent)},
                          f, default=repr)
        except OSError as e:
            log.error("--crash-dump-folder %s: cannot write the crash dump: %s",
                      self.dump_folder, e)
            return None
        log.error("crash dump of %d recent requests written to %s", len(self.recent), path)
        return path
