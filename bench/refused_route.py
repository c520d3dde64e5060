"""Issue #45 item 6: how long a client waits for the answer to a route decode refuses, behind
the real sglang-router and behind pdserve's router.

One tiny-model P and D on loopback, D with the loopback default off
(PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL=0: the multi-host case without a secret or a
trust list), so D refuses every route with 403. Each router in turn gets `--repeat` requests
(non-streamed and streamed), each to a router started for it; printed: status, seconds to the whole answer, the first 120
characters of the body, and P's unclaimed / refused-room counters afterwards.

Run: `python bench/refused_route.py [--claim-timeout S] [--repeat N]` (the claim timeout goes
to both servers as PDSERVE_DISAGGREGATION_CLAIM_TIMEOUT; default: the servers' own, 5 s).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import httpx

from bench.common import Run, bar_groups, figure, load_note, save_figure
from pdcore.testing.processes import ServerProcess, free_port
from pdcore.testing.tiny_models import make_tiny_model

FLAGS = ("--max-total-tokens", "2048", "--page-size", "4")
BODY = {"text": "hello there", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("kv_unclaimed_rooms_total", "kv_refused_rooms_total"):
            if line.startswith(f"pdserve_scheduler_{name}"):
                out[name] = float(line.split()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--claim-timeout", type=float, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from pdcore.engine.model.tokenizer import default_model_file

    model = make_tiny_model(tempfile.mkdtemp(prefix="refused-") + "/m", hidden=64, layers=2,
                            tokenizer_from=default_model_file())
    env = {} if a.claim_timeout is None else {
        "PDSERVE_DISAGGREGATION_CLAIM_TIMEOUT": str(a.claim_timeout)}
    bport = free_port()
    p = ServerProcess("--model-path", model, "--disaggregation-mode", "prefill",
                      "--disaggregation-bootstrap-port", str(bport), *FLAGS, env=env)
    d = ServerProcess("--model-path", model, "--disaggregation-mode", "decode", *FLAGS,
                      env={**env, "PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL": "0"})
    procs = [p, d]
    results = []
    run = Run("refused_route", {"claim_timeout": a.claim_timeout, "repeat": a.repeat})
    try:
        p.wait_healthy(300)
        d.wait_healthy(300)
        for kind, cmd, extra in (
                ("sglang-router", ("-m", "sglang_router.launch_router"),
                 ("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()))),
                ("pdserve router", ("-m", "pdcore.router"), ())):
            for stream in (False, True):
                for _ in range(a.repeat):
                    # a fresh router per request: sglang-router opens its circuit after 10
                    # failed attempts (2 requests); ours has no admin key, so it cannot
                    # register the prefill address with D (D keeps refusing)
                    router = ServerProcess("--pd-disaggregation", "--prefill", p.url,
                                           str(bport), "--decode", d.url, *extra, command=cmd,
                                           admin_key=None)
                    procs.append(router)
                    router.wait_healthy(120)
                    t = time.monotonic()
                    r = httpx.post(router.url + "/generate", json={**BODY, "stream": stream},
                                   timeout=600)
                    took = time.monotonic() - t
                    results.append({"router": kind, "stream": stream, "status": r.status_code,
                                    "seconds": round(took, 2), "body": r.text[:120]})
                    print(json.dumps(results[-1]), flush=True)
                    router.stop()
        time.sleep(0.5)
        after = counters(p.url)
        print("prefill counters:", after)
        path = run.finish({"results": results, "prefill_counters": after,
                           "note": load_note(run)})
        groups = [f"{k}\n{'stream' if st else 'plain'}" for k in ("sglang-router", "pdserve router")
                  for st in (False, True)]
        worst = [max(r["seconds"] for r in results if f"{r['router']}\n"
                     f"{'stream' if r['stream'] else 'plain'}" == g) for g in groups]
        fig, axes = figure(1, width=7)
        bar_groups(axes[0], groups, {"slowest answer (s)": worst}, "seconds to the answer",
                   f"a refused route, to the client ({load_note(run)})")
        print(path, save_figure(fig, "refused_route"))
    finally:
        for s in procs:
            s.stop()


if __name__ == "__main__":
    main()
