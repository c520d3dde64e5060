"""Request migration (#49 item 1): what a migrated stream costs its client.

A 1P2D tcp cluster behind pdserve's router (--migration-stall-secs 1, --health-check-timeout-secs
1). Each round streams a greedy /generate request undisturbed (the reference), then twice more
with a fault on the decode server serving it once `--at` events came: `kill` (kill -9 of its
process group; it is restarted afterwards), `sigstop` (frozen; thawed afterwards) and `drain`
(SIGTERM: it drains, its --drain-timeout of 1 s passes mid-stream, it exits and is restarted
afterwards). Measured
per run, from the client's side: TTFT, the inter-event gaps (median: the ITL; max: the hole the
fault made), whether the text is the reference's; and from the router's
`pdrouter_migration_resume_seconds`: the break -> the resumed leg's first event (its TTFT: the
resume request, P's prefill of prompt + streamed tokens, the KV transfer, D's first token).
Writes bench/results/migration.json and .png, with the CPU, its flags and the load.

    python bench/migration.py                         # SmolLM2 (the default model), 3 rounds
    python bench/migration.py --model-path /tmp/tiny --rounds 1 --tokens 64   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure, summary  # noqa: E402

from pdcore.testing.processes import PDCluster  # noqa: E402

FLAGS = ("--max-total-tokens", "8192", "--page-size", "16")
DECODE_FLAGS = ("--drain-timeout", "1")
FAULTS = ("kill", "sigstop", "drain")
ROUTER_FLAGS = ("--migration-stall-secs", "1", "--health-check-timeout-secs", "1")


def serving_decode(c: PDCluster) -> Any:
    workers = httpx.get(c.url + "/workers", timeout=5).json()["workers"]
    busy = [w["url"] for w in workers if w["worker_type"] == "decode" and w["in_flight"]]
    return next((d for d in c.decodes if d.url in busy), None)


def wait_rotation(c: PDCluster, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while any(not w["healthy"] for w in
              httpx.get(c.url + "/workers", timeout=5).json()["workers"]):
        if time.monotonic() > deadline:
            raise TimeoutError("workers not back in rotation")
        time.sleep(0.2)


def hit_serving_decode(c: PDCluster, fault: str) -> Any:
    """Every decode server frozen (the fault lands mid-stream), the serving one hit, the others
    thawed (the serving one too unless the fault is the freeze)."""
    for d in c.decodes:
        os.killpg(d.proc.pid, signal.SIGSTOP)
    hit = serving_decode(c)
    if hit is not None and fault == "kill":
        hit.kill()
    elif hit is not None and fault == "drain":
        hit.proc.send_signal(signal.SIGTERM)
    for d in c.decodes:
        if d.alive() and not (d is hit and fault == "sigstop"):
            os.killpg(d.proc.pid, signal.SIGCONT)
    return hit


def resume_hist(c: PDCluster) -> tuple[float, float]:
    s = n = 0.0
    for line in httpx.get(c.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdrouter_migration_resume_seconds_sum"):
            s = float(line.split()[-1])
        elif line.startswith("pdrouter_migration_resume_seconds_count"):
            n = float(line.split()[-1])
    return s, n


def stream(c: PDCluster, body: dict[str, Any], at: int = 0, fault: str = "") -> dict[str, Any]:
    """One stream's timings; `fault` hits its decode server at event `at`."""
    t0 = time.monotonic()
    times, last, hit, errors = [], None, None, 0
    with httpx.stream("POST", c.url + "/generate", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                errors += 1
                continue
            times.append(time.monotonic() - t0)
            last = event
            if fault and len(times) == at:
                hit = hit_serving_decode(c, fault)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": times[0] if times else None, "itl_median_s": summary(gaps)["p50"]
            if gaps else None, "max_gap_s": max(gaps) if gaps else None,
            "events": len(times), "errors": errors, "text": (last or {}).get("text"),
            "ids": (last or {}).get("output_ids"), "hit": hit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-path", default=None, help="default: the default model (SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--at", type=int, default=8, help="the event the fault comes at")
    a = ap.parse_args()
    run = Run("migration", {"model_path": a.model_path or "default", "rounds": a.rounds,
                            "tokens": a.tokens, "at": a.at, "cluster": "1P2D tcp",
                            "router_flags": ROUTER_FLAGS, "server_flags": FLAGS,
                            "decode_flags": DECODE_FLAGS})
    c = PDCluster("tcp", prefill=1, decode=2, model_path=a.model_path, flags=FLAGS,
                  decode_flags=DECODE_FLAGS, router_flags=ROUTER_FLAGS).start()
    rows: list[dict[str, Any]] = []
    try:
        for r in range(a.rounds):
            body = {"text": f"Round {r}: the history of the printing press, in detail.",
                    "stream": True, "sampling_params": {"max_new_tokens": a.tokens,
                                                        "temperature": 0, "ignore_eos": True}}
            ref = stream(c, body)
            rows.append({"round": r, "fault": "none", **{k: v for k, v in ref.items()
                                                         if k not in ("text", "ids", "hit")}})
            for fault in FAULTS:
                before = resume_hist(c)
                got = stream(c, body, a.at, fault)
                after = resume_hist(c)
                d = got.pop("hit")
                if d is not None and fault == "sigstop":
                    os.killpg(d.proc.pid, signal.SIGCONT)
                elif d is not None:
                    d.proc.wait(60)  # killed, or drained and exited
                    d.kill()  # (closes its log)
                    d.start().wait_healthy(600)
                wait_rotation(c)
                moved = after[1] - before[1]
                row = {"round": r, "fault": fault, "hit": d is not None,
                       "same_text": got.pop("text") == ref["text"],
                       "same_ids": got.pop("ids") == ref["ids"],
                       "resumed_leg_ttft_s": (after[0] - before[0]) / moved if moved else None,
                       **got}
                rows.append(row)
                print(json.dumps(row), flush=True)
            c.wait_pages_free(60)
        data = {"rows": rows, "note": load_note(run), "summary": {
            fault: {k: summary([x[k] for x in rows if x["fault"] == fault and x.get(k)
                               is not None])
                    for k in ("ttft_s", "itl_median_s", "max_gap_s", "resumed_leg_ttft_s")
                    if any(x.get(k) is not None for x in rows if x["fault"] == fault)}
            for fault in ("none", *FAULTS)},
            "all_same_text": all(x["same_text"] for x in rows if x["fault"] != "none")}
        path = run.finish(data)
        fig, axes = figure(1, width=10)
        ax = axes[0]
        labels, values = [], []
        for fault, key, label in (("none", "ttft_s", "TTFT\nundisturbed"),
                                  ("kill", "resumed_leg_ttft_s", "resumed leg\nTTFT (kill)"),
                                  ("sigstop", "resumed_leg_ttft_s", "resumed leg\nTTFT (stop)"),
                                  ("drain", "resumed_leg_ttft_s", "resumed leg\nTTFT (drain)"),
                                  ("none", "max_gap_s", "max gap\nundisturbed"),
                                  ("kill", "max_gap_s", "client gap\n(kill -9)"),
                                  ("sigstop", "max_gap_s", "client gap\n(SIGSTOP)"),
                                  ("drain", "max_gap_s", "client gap\n(drain 1 s)")):
            s = data["summary"][fault].get(key)
            labels.append(label)
            values.append(s["p50"] if s else 0.0)
        ax.bar(range(len(values)), values)
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.set_ylabel("seconds (median over rounds)")
        ax.set_title(f"migrated streams, {a.tokens} tokens, fault at event {a.at}\n"
                     f"({load_note(run)})", fontsize=9)
        print(path, save_figure(fig, "migration"))
    finally:
        c.stop()


if __name__ == "__main__":
    main()
