"""memfabric-hybrid's own words for a failure, read from the log it prints.

memfabric's calls return bare codes (-1, -2000), and `get_last_err_msg()` stays empty for most
start-up failures (for example when `TransferEngine.initialize` is refused by its driver check);
the cause is only in the lines its logger prints to stdout, on the calling thread, before the
call returns:

    2026-11-30 06:48:42.971728 ERROR [23113-23113][HYBM hybm_entry.cpp:97 hybm_init] the ...

`captured_stdout()` points file descriptor 1 at a temporary file for the length of one call,
then writes everything back to the real stdout (nothing is hidden) and returns the text;
`errors()` picks that thread's ERROR lines.

Why not memfabric's `set_extern_logger` (a Python callback): with one installed, memfabric 1.3
aborts the process at exit ("terminate called without an active exception") whenever one of its
threads logs while the interpreter shuts down, e.g. a config store that had a client (seen on
every try; never without the callback). Its Python API cannot remove a callback again.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_LINE = re.compile(r"(?P<level>TRACE|DEBUG|INFO|WARN|ERROR)\s+\[(?P<pid>\d+)-(?P<tid>\d+)\]"
                   r"\[(?P<module>\w+) [^\]]*?(?P<func>\w+)\] (?P<text>.*)$")
_capture_lock = threading.Lock()  # fd 1 is process-wide: one capture at a time


@dataclass(frozen=True, slots=True)
class Line:
    level: str
    module: str  # HYBM, SMEM, ADAPTER, AccLink, ...
    func: str
    text: str
    tid: int  # OS thread id (threading.get_native_id())

    @property
    def message(self) -> str:
        return f"{self.func}: {self.text}"


def parse(output: str) -> list[Line]:
    lines = []
    for raw in output.splitlines():
        m = _LINE.search(raw)
        if m:
            lines.append(Line(m["level"], m["module"], m["func"], m["text"].strip(),
                              int(m["tid"])))
    return lines


def errors(output: str, tid: int | None = None, limit: int = 4) -> list[str]:
    """Distinct ERROR messages in `output` (of thread `tid` when given), the last `limit`:
    memfabric logs the cause first, then each layer's consequence, ending with the binding's
    ADAPTER line, which is left out (it only repeats the return code)."""
    out: list[str] = []
    for ln in parse(output):
        if ln.level != "ERROR" or ln.module == "ADAPTER" or (tid is not None and ln.tid != tid):
            continue
        if ln.message not in out:
            out.append(ln.message)
    return out[-limit:]


class Captured:
    text: str = ""


@contextmanager
def captured_stdout() -> Iterator[Captured]:
    """Capture what is written to file descriptor 1 inside the block (then replay it there)."""
    result = Captured()
    with _capture_lock, tempfile.TemporaryFile() as tmp:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(tmp.fileno(), 1)
            try:
                yield result
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
        finally:
            os.close(saved)
        tmp.seek(0)
        data = tmp.read()
        view = memoryview(data)
        while view:
            view = view[os.write(1, view):]
        result.text = data.decode("utf-8", errors="replace")


def describe_failure(call: str, rc: object, errors: list[str], last_err: str = "") -> str:
    """"memfabric <call> returned <rc>: <library text>"."""
    parts = list(errors)
    if last_err and not any(last_err in p for p in parts):
        parts.append(last_err)
    text = "; ".join(parts) if parts else "memfabric gave no error text; see its log lines"
    return f"memfabric {call} returned {rc}: {text}"
