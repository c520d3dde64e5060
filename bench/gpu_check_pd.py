"""PD part of bench/gpu_check.py (its section 2): a prefill and a decode server per transfer
backend, EAGLE on both, paired by hand as the router does; see that module's doc."""

from __future__ import annotations

import os
import threading
from itertools import count
from pathlib import Path
from typing import Any

from gpu_check_engine import PD_NEW, SPEC_ENV, Report, _now, _tb, engine_args, prompts, run_engine

_rooms = count(4000, 7)


def _pair(p_url: str, bport: int, d_url: str, ids: list[int], new: int) -> tuple[Any, Any]:
    """The router's fan-out by hand: (D's response, P's response or error)."""
    import httpx

    body = {"input_ids": ids, "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
            "bootstrap_room": next(_rooms),
            "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}
    got: list[Any] = []

    def prefill() -> None:
        try:
            got.append(httpx.post(p_url + "/generate", json=body, timeout=60))
        except httpx.HTTPError as e:
            got.append(e)

    t = threading.Thread(target=prefill, daemon=True)
    t.start()
    r = httpx.post(d_url + "/generate", json=body, timeout=60)
    t.join(60)
    return r, (got[0] if got else None)


def _load(url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(url + "/get_load", timeout=10).json()[0]


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after.get(key, 0) or 0) - int(before.get(key, 0) or 0)


def pd_section(rep: Report, models: dict[str, str], device: str, backends: list[str],
               log_dir: Path | None) -> None:
    """`log_dir`: where each server's log goes (None: nowhere)."""
    import httpx

    from pdcore.messages.io import SamplingParams
    from pdcore.testing.ports import free_port
    from pdcore.testing.processes import ServerProcess, trust_prefill

    res: dict[str, Any] = rep.data.setdefault("pd", {})
    ps = prompts()[:4]
    os.environ.update(SPEC_ENV)
    try:  # the unified engine's greedy output, the layout the servers run
        args = engine_args(models["target"], models["head"], "none", device, "float32", 4, 16)
        unified = run_engine(args, ps, True, SamplingParams(max_new_tokens=PD_NEW,
                                                            temperature=0.0, ignore_eos=True))
        ref = [o["output_ids"] for o in unified["outs"][: len(ps)]]
        res["unified_output_ids"] = ref
    except Exception:  # noqa: BLE001 - reported in the JSON
        res["unified"] = {"exception": _tb()}
        rep.fail("pd: the unified reference engine raised")
        return
    common = ("--model-path", models["target"], "--device", device, "--dtype", "float32",
              "--max-total-tokens", "2048", "--page-size", "4", "--chunked-prefill-size", "16",
              "--grammar-backend", "none", "--speculative-algorithm", "EAGLE",
              "--speculative-draft-model-path", models["head"], "--speculative-num-steps", "3")
    env = {**SPEC_ENV, "OMP_NUM_THREADS": "1"}
    servers: dict[str, Any] = {}
    for b in backends:  # every pair starts at once: the start-ups overlap
        bport = free_port()
        servers[b] = (bport, ServerProcess(
            *common, "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", b,
            "--disaggregation-bootstrap-port", str(bport), env=env),
            ServerProcess(*common, "--disaggregation-mode", "decode",
                          "--disaggregation-transfer-backend", b, env=env))
    try:
        for b, (bport, p, d) in servers.items():
            cell: dict[str, Any] = res.setdefault(b, {})
            t0 = _now()
            started = True
            for role, s in (("prefill", p), ("decode", d)):
                try:
                    s.wait_healthy(150)
                except Exception as e:  # noqa: BLE001 - reported with the log
                    started = False
                    cell[f"{role}_start_error"] = str(e)[-3000:]
            cell["start_s"] = round(_now() - t0, 1)
            if not started:
                logs = "\n".join(f"{role}: {s.log()[-2500:]}" for role, s in
                                 (("prefill", p), ("decode", d)))
                refused = "cannot use cuda memory" in logs
                cell["refused_device_memory"] = refused
                if refused and b == "tcp" and device != "cpu":
                    rep.note(f"pd {b}: servers with --device {device} refuse to start: the tcp "
                             "backend moves host memory only (expected; see pd.tcp)")
                else:
                    rep.fail(f"pd {b}: a server did not start (see pd.{b})")
                continue
            moves = b != "fake"  # fake moves no data: D's K/V stay zeros, only the aux row
            trust_prefill(d.url, bport)
            before_d, before_p = _load(d.url), _load(p.url)
            rows = []
            for i, (ids, want) in enumerate(zip(ps, ref)):
                row: dict[str, Any] = {"prompt": i}
                try:
                    r3, pr3 = _pair(p.url, bport, d.url, ids, 3)
                    row["first_step_status"] = r3.status_code
                    if r3.status_code == 200:
                        body = r3.json()
                        row["first_step_output"] = body["output_ids"]
                        row["spec_verify_ct"] = body["meta_info"].get("spec_verify_ct")
                        row["first_token_equal"] = body["output_ids"][:1] == want[:1]
                    else:
                        row["first_step_error"] = r3.text[:800]
                    row["prefill_status_3"] = getattr(pr3, "status_code", repr(pr3))
                    r, pr = _pair(p.url, bport, d.url, ids, PD_NEW)
                    row["status"] = r.status_code
                    row["prefill_status"] = getattr(pr, "status_code", repr(pr))
                    if r.status_code == 200:
                        out = r.json()["output_ids"]
                        row["equal_unified"] = out == want
                        row["tokens_equal_prefix"] = next(
                            (j for j, (u, v) in enumerate(zip(out, want)) if u != v), len(out))
                        if not row["equal_unified"]:
                            row["output_ids"] = out
                    else:
                        row["error"] = r.text[:800]
                except Exception:  # noqa: BLE001 - reported in the JSON
                    row["exception"] = _tb()
                    rows.append(row)
                    break  # a hung pair would hold every later one as long
                rows.append(row)
            after_d, after_p = _load(d.url), _load(p.url)
            cell["requests"] = rows
            cell["decode"] = {k: _delta(after_d, before_d, k) for k in (
                "spec_verifies_total", "spec_draft_failures_total",
                "disagg_chain_starts_received_total", "disagg_chain_starts_dropped_total")}
            cell["prefill"] = {k: _delta(after_p, before_p, k) for k in (
                "spec_draft_passes_total", "spec_verifies_total",
                "disagg_chain_starts_sent_total", "disagg_chain_starts_missing_total",
                "kv_bytes")}
            cell["backend_moves_data"] = moves
            n = 2 * len(ps)
            dd, pp = cell["decode"], cell["prefill"]
            checks = {
                "every_request_200": all(r.get("status") == 200 and
                                         r.get("first_step_status") == 200 for r in rows),
                "first_step_drafted": all((r.get("spec_verify_ct") or 0) >= 1 for r in rows),
                "first_token_equal": all(r.get("first_token_equal") for r in rows),
                "chain_starts_received_all": dd["disagg_chain_starts_received_total"] == n,
                "no_chain_start_dropped": dd["disagg_chain_starts_dropped_total"] == 0,
                "prefill_sent_all": pp["disagg_chain_starts_sent_total"] >= n
                and pp["disagg_chain_starts_missing_total"] == 0,
                "no_draft_failures": dd["spec_draft_failures_total"] == 0,
            }
            if moves:
                checks["output_equal_unified"] = all(r.get("equal_unified") for r in rows)
            cell["checks"] = checks
            for k, ok in checks.items():
                if not ok:
                    rep.fail(f"pd {b}: {k} failed (see pd.{b})")
            try:
                httpx.get(d.url + "/health", timeout=5)
            except httpx.HTTPError:
                rep.fail(f"pd {b}: decode server unhealthy after the requests")
            rep.dump()
    finally:
        for b, (_, p, d) in servers.items():
            for role, s in (("prefill", p), ("decode", d)):
                s.stop()
                if log_dir is not None:
                    try:
                        (log_dir / f"pd_{b}_{role}.log").write_text(s.log()[-200_000:])
                    except OSError:
                        pass
        rep.dump()


# -- the code before a fix ------------------------------------------------------------------------
