"""Heterogeneous TP: KV transfer throughput and TTFT of pd-staging vs the per-head slice path vs
equal TP, at concurrency 1, 8 and 32, in one run. Writes bench/results/hetero_tp.{json,png}.

Systems (the prefill side always runs TP 2):
  equal    P TP 2 -> D TP 2: whole page runs (what staging aims to match)
  slice    P TP 2 -> D TP 1: the core's per-head slice path, one copy per layer x K/V x token
  staging  P TP 2 -> D TP 1: pd-staging, gather -> one write per chunk -> scatter

1. transfer: real prefill and decode KV managers of every rank (tcp backend, loopback, no
   model) with SmolLM2-135M's KV geometry (30 layers, 3 KV heads of 64, fp32, page 16). C rooms
   of --tokens tokens are handed to P at once (two chunks each); we time until every D rank
   reported Success: KV GB/s (model KV bytes landed / wall time) and per-room transfer time.
   Rounds alternate the order of the systems so a drifting machine load biases none of them.
2. ttft: real servers (P TP 2; D TP 2 or 1) with a random model of SmolLM2-135M's KV shape; C
   streaming requests of --tokens prompt tokens sent at once to P and D (as the router does);
   TTFT = time to D's first token.

Run: python bench/hetero_tp.py [--tokens 256] [--rounds 3] [--skip-ttft]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdcore.config import DisaggEnv, ServerArgs
from pdcore.disagg.aux import AuxBuffers, AuxRow
from pdcore.disagg.decode import DecodeKVManager
from pdcore.disagg.prefill import PrefillKVManager
from pdcore.disagg.states import KVPoll
from pdcore.engine.model.layers import kv_head_span
from pdcore.interfaces.memory import Buffer, MemoryPool
from pdcore.interfaces.planner import KVLayout
from pdcore.interfaces.transfer import MemoryRegion

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 30, 3, 64, 16  # SmolLM2-135M
SYSTEMS = {"equal": (2, 2, False), "slice": (2, 1, False), "staging": (2, 1, True)}
CONCURRENCY = (1, 8, 32)
BASE_ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120",
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
            "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": "16",
            "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "512"}


# -- part 1: transfer ----------------------------------------------------------------------------
class _Pool(MemoryPool):
    name = "bench"

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor] = []

    def allocate(self, label: str, shape: Any, dtype: torch.dtype) -> Buffer:
        t = torch.zeros(tuple(shape), dtype=dtype)
        self.bufs.append(t)
        return Buffer(t, MemoryRegion(t.data_ptr(), t.numel() * t.element_size(), name=label))

    def close(self) -> None:
        self.bufs.clear()


class _Rank:
    def __init__(self, rank: int, tp: int, pages: int) -> None:
        self.pool = _Pool()
        _, heads = kv_head_span(KV_HEADS, rank, tp)
        shape = (pages, PAGE, heads, HEAD_DIM)
        k = [self.pool.allocate(f"k{i}", shape, torch.float32) for i in range(LAYERS)]
        v = [self.pool.allocate(f"v{i}", shape, torch.float32) for i in range(LAYERS)]
        for b in k + v:  # not zeros: pages really move
            b.tensor.normal_()
        self.aux = AuxBuffers(self.pool, 128)
        self.layers = [(a.tensor, b.tensor) for a, b in zip(k, v)]
        self.regions = [b.region for b in k + v]
        self.layout = KVLayout(LAYERS, PAGE, heads, HEAD_DIM, 4,
                               tuple(b.region.addr for b in k), tuple(b.region.addr for b in v),
                               pages, rank, tp, KV_HEADS, "float32")


class TransferSystem:
    """Every rank of one P and one D instance, KV managers only."""

    def __init__(self, name: str, pages: int) -> None:
        p_tp, d_tp, staging = SYSTEMS[name]
        env = DisaggEnv.from_env({**BASE_ENV, "SGLANG_DISAGG_STAGING_BUFFER": "1" if staging
                                  else "0"})
        port = _free_port()
        self.name, self.pages = name, pages
        self.pr = [_Rank(r, p_tp, pages) for r in range(p_tp)]
        self.dr = [_Rank(r, d_tp, pages) for r in range(d_tp)]
        self.ps = [PrefillKVManager(_args("prefill", port), env, k.layout, k.regions, k.aux, "tcp",
                                    tp_rank=r, tp_size=p_tp, kv_tensors=k.layers, pool=k.pool)
                   for r, k in enumerate(self.pr)]
        self.ds = [DecodeKVManager(_args("decode", 1), env, k.layout, k.regions, k.aux, "tcp",
                                   tp_rank=r, tp_size=d_tp, kv_tensors=k.layers, pool=k.pool)
                   for r, k in enumerate(self.dr)]
        for m in self.ps + self.ds:
            m.start()
        self.port = port

    def run(self, rooms: int, pages_per_room: int) -> dict[str, Any]:
        ids = [random.randrange(1 << 60) for _ in range(rooms)]
        slots: dict[int, tuple[list[int], list[int]]] = {}  # room -> (D aux slots, P aux slots)
        for room in ids:
            for p in self.ps:
                p.add(room)
            for d in self.ds:
                d.add(room, "127.0.0.1", self.port)
        _wait(lambda: all(d.poll(r) == KVPoll.WaitingForInput for d in self.ds for r in ids))
        for i, room in enumerate(ids):
            pages = np.arange(i * pages_per_room, (i + 1) * pages_per_room)
            ds_slots = [k.aux.alloc() for k in self.dr]
            for d, s in zip(self.ds, ds_slots):
                d.send_transfer_info(room, pages[::-1].copy(), s)  # reversed: no page runs
            ps_slots = [k.aux.alloc() for k in self.pr]
            for k, s in zip(self.pr, ps_slots):
                k.aux.write(s, AuxRow(room=room, first_token_id=1))
            slots[room] = (ds_slots, ps_slots)
        _wait(lambda: all(p.poll(r) == KVPoll.WaitingForInput for p in self.ps for r in ids))
        half = pages_per_room // 2
        done: dict[int, float] = {}
        t0 = time.perf_counter()
        for i, room in enumerate(ids):
            src = np.arange(i * pages_per_room, (i + 1) * pages_per_room)
            for p, ps in zip(self.ps, slots[room][1]):
                p.send(room, src[:half], 0, False, None)
                p.send(room, src[half:], half, True, ps)
        while len(done) < len(ids):
            for r in ids:
                if r not in done:
                    states = [d.poll(r) for d in self.ds]
                    if KVPoll.Failed in states:
                        raise RuntimeError(f"{self.name}: room failed: "
                                           f"{[d.failure_reason(r) for d in self.ds]}")
                    if all(s == KVPoll.Success for s in states):
                        done[r] = time.perf_counter() - t0
            time.sleep(0.0005)
        wall = max(done.values())
        for room in ids:
            for m in self.ps + self.ds:
                m.release(room)
            for kd, ds in zip(self.dr, slots[room][0]):
                kd.aux.free(ds)
            for kp, ps in zip(self.pr, slots[room][1]):
                kp.aux.free(ps)
        kv_bytes = rooms * pages_per_room * PAGE * 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
        return {"wall_s": wall, "gbps": kv_bytes / wall / 1e9,
                "room_s_p50": statistics.median(done.values()), "kv_bytes": kv_bytes}

    def close(self) -> None:
        for m in self.ds + self.ps:
            m.close()


def _args(role: str, port: int) -> ServerArgs:
    # the ranks of one decode server share its server id (P binds a room to one decode server)
    extra = {"server_id": "bench-decode"} if role == "decode" else {}
    return ServerArgs(host="127.0.0.1", disaggregation_mode=role,
                      disaggregation_bootstrap_port=port, **extra)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark setup did not converge")
        time.sleep(0.002)


def bench_transfer(tokens: int, rounds: int) -> dict[str, Any]:
    per_room = tokens // PAGE
    systems = {n: TransferSystem(n, per_room * max(CONCURRENCY)) for n in SYSTEMS}
    out: dict[str, dict[str, list[dict[str, Any]]]] = {n: {str(c): [] for c in CONCURRENCY}
                                                       for n in SYSTEMS}
    try:
        for n in SYSTEMS:  # warm-up: connections, first-touch of every page
            systems[n].run(max(CONCURRENCY), per_room)
        for rnd in range(rounds):
            order = list(SYSTEMS) if rnd % 2 == 0 else list(reversed(SYSTEMS))
            for c in CONCURRENCY:
                for n in order:
                    r = systems[n].run(c, per_room)
                    out[n][str(c)].append(r)
                    print(f"transfer round {rnd} {n:8s} c={c:2d}: {r['gbps']:.3f} GB/s, "
                          f"wall {r['wall_s'] * 1e3:.1f} ms", flush=True)
    finally:
        for s in systems.values():
            s.close()
    return {n: {c: {"gbps": statistics.median(x["gbps"] for x in runs),
                    "room_ms_p50": 1e3 * statistics.median(x["room_s_p50"] for x in runs),
                    "runs": runs} for c, runs in per_c.items()} for n, per_c in out.items()}


# -- part 2: TTFT through real servers ----------------------------------------------------------
def bench_ttft(tokens: int, rounds: int) -> dict[str, Any]:
    import httpx

    from pdcore.engine.model.tokenizer import default_model_file
    from pdcore.testing.processes import ServerProcess
    from pdcore.testing.tiny_models import make_tiny_model

    # SmolLM2-135M's KV geometry (30 layers, 3 KV heads of 64) with a narrow body (hidden 192,
    # no GQA): the KV to move is the real one while the CPU compute stays small enough that
    # TTFT shows the transfer, not only the prefill of 2 shared cores
    model = make_tiny_model(tempfile.mkdtemp(prefix="hetero-tp-") + "/m", hidden=192,
                            layers=LAYERS, heads=KV_HEADS, kv_heads=KV_HEADS, max_positions=8192,
                            tokenizer_from=default_model_file(), seed=1)
    flags = ("--model-path", model, "--max-total-tokens", str(tokens * 40 + 4096), "--page-size",
             str(PAGE), "--chunked-prefill-size", "8192", "--max-prefill-tokens", "8192",
             "--disaggregation-transfer-backend", "tcp")
    env_s = {**BASE_ENV, "SGLANG_DISAGG_STAGING_BUFFER": "1"}
    boot = {"p2": _free_port(), "p2s": _free_port()}
    # requests name P's bootstrap by hand (no router): decode trusts those addresses
    dflags = (*flags, "--disaggregation-trusted-prefill",
              ",".join(f"127.0.0.1:{b}" for b in boot.values()))
    servers = {
        "p2": ServerProcess(*flags, "--disaggregation-mode", "prefill", "--tp-size", "2",
                            "--disaggregation-bootstrap-port", str(boot["p2"]), env=BASE_ENV),
        "p2s": ServerProcess(*flags, "--disaggregation-mode", "prefill", "--tp-size", "2",
                             "--disaggregation-bootstrap-port", str(boot["p2s"]), env=env_s),
        "d2": ServerProcess(*dflags, "--disaggregation-mode", "decode", "--tp-size", "2",
                            env=BASE_ENV),
        "d1": ServerProcess(*dflags, "--disaggregation-mode", "decode", env=BASE_ENV),
        "d1s": ServerProcess(*dflags, "--disaggregation-mode", "decode", env=env_s),
    }
    pairs = {"equal": ("p2", "d2"), "slice": ("p2", "d1"), "staging": ("p2s", "d1s")}
    g = torch.Generator().manual_seed(0)

    def one(p: str, d: str, ids: list[int], out: list[float]) -> None:
        body = {"input_ids": ids, "stream": True, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": boot[p], "bootstrap_room": secrets.randbits(62),
                "sampling_params": {"max_new_tokens": 2, "temperature": 0.0,
                                    "ignore_eos": True}}
        t0 = time.perf_counter()
        threading.Thread(target=lambda: httpx.post(servers[p].url + "/generate", json=body,
                                                   timeout=600), daemon=True).start()
        with httpx.stream("POST", servers[d].url + "/generate", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if "error" in line:
                        raise RuntimeError(line)
                    out.append(time.perf_counter() - t0)
                    break

    results: dict[str, dict[str, list[float]]] = {n: {str(c): [] for c in CONCURRENCY}
                                                  for n in pairs}
    try:
        for s in servers.values():
            s.wait_healthy(900)
        for n, (p, d) in pairs.items():  # warm-up
            one(p, d, torch.randint(100, 40000, (tokens,), generator=g).tolist(), [])
        for rnd in range(rounds):
            order = list(pairs) if rnd % 2 == 0 else list(reversed(pairs))
            for c in CONCURRENCY:
                for n in order:
                    p, d = pairs[n]
                    ttfts: list[float] = []
                    threads = [threading.Thread(target=one, args=(
                        p, d, torch.randint(100, 40000, (tokens,), generator=g).tolist(),
                        ttfts)) for _ in range(c)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join(900)
                    if len(ttfts) != c:
                        raise RuntimeError(f"{n} c={c}: {c - len(ttfts)} requests failed")
                    results[n][str(c)].extend(ttfts)
                    print(f"ttft round {rnd} {n:8s} c={c:2d}: mean "
                          f"{1e3 * statistics.fmean(ttfts):.0f} ms", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return {n: {c: {"ttft_ms_mean": 1e3 * statistics.fmean(v),
                    "ttft_ms_p50": 1e3 * statistics.median(v), "n": len(v)}
                for c, v in per_c.items()} for n, per_c in results.items()}


# -- report --------------------------------------------------------------------------------------
def ratios(res: dict[str, Any], key: str, higher_better: bool) -> dict[str, Any]:
    out = {}
    for c in map(str, CONCURRENCY):
        s, sl, eq = (res[n][c][key] for n in ("staging", "slice", "equal"))
        out[c] = ({"staging_over_slice": s / sl, "staging_over_equal": s / eq} if higher_better
                  else {"slice_over_staging": sl / s, "staging_over_equal": s / eq})
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("transfer", "gbps", "KV transfer GB/s (higher is better)")]
    if "ttft" in result:
        parts.append(("ttft", "ttft_ms_mean", "TTFT ms, mean (lower is better)"))
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.2), squeeze=False)
    for ax, (part, key, title) in zip(axes[0], parts):
        x = np.arange(len(CONCURRENCY))
        for i, n in enumerate(SYSTEMS):
            vals = [result[part][n][str(c)][key] for c in CONCURRENCY]
            ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=n)
        ax.set_xticks(x, [f"c={c}" for c in CONCURRENCY])
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"P TP2 -> D TP1 (slice, staging) vs P TP2 -> D TP2 (equal); "
                 f"{result['tokens']} tokens/request, tcp, {os.cpu_count()} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hetero_tp"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "tokens": a.tokens, "rounds": a.rounds, "concurrency": list(CONCURRENCY),
        "kv_geometry": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                        "page_size": PAGE, "dtype": "float32"},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "loadavg": os.getloadavg()},
    }
    result["transfer"] = bench_transfer(a.tokens, a.rounds)
    result["transfer_ratios"] = ratios(result["transfer"], "gbps", True)
    if not a.skip_ttft:
        result["ttft"] = bench_ttft(a.tokens, a.rounds)
        result["ttft_ratios"] = ratios(result["ttft"], "ttft_ms_mean", False)
    result["machine"]["loadavg_end"] = os.getloadavg()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k.endswith("ratios")}, indent=1))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
