"""pdserve against vLLM on the same CPU, in one run: same model folder, same client, same shape.

Systems (--systems; bench/vllm_launch.py starts them):
- pdserve-unified: `pdserve serve` with its defaults (no thread variable set by hand);
- pdserve-1p1d: `pdserve up` (1 prefill + 1 decode + router over shm; `up` gives each server
  its own core);
- vllm-unified: `vllm serve`, VLLM_CPU_OMP_THREADS_BIND=--vllm-bind (both cores by default);
- vllm-1p1d: two `vllm serve` joined by NixlConnector, bound to core 0 / core 1, behind
  bench/vllm_pd_proxy.py (vLLM's kv_transfer_params protocol).
vLLM runs when --vllm-python names a Python with vllm installed (its own venv, see
shared/reference/vllm-cpu.md) and --model-path is an HF folder (`--make-model DIR` writes the
SmolLM2 float32 folder there first); otherwise the run measures pdserve alone and its JSON says
why vLLM is missing.

Lifecycle, per round (--rounds) and dtype (--dtypes): each system in turn, order alternating
between rounds, alone on the machine: start, warm up, one greedy probe (its text is compared
across systems), then per client sampling of --sampling (greedy: temperature 0; default: no
temperature sent, so the server's default 1.0; order alternating between rounds) the
closed-loop client of bench/serving.py (streamed /v1/completions of random token-id prompts,
--input-len in / --output-len out, ignore_eos, --concurrency in flight, --num-prompts), stop.
Each measurement records the load average before and after. Results are keyed by dtype for
greedy and `dtype/default` for the default sampling. Per system and key: output tok/s (median
over rounds), mean and p99 TTFT and TPOT. `acceptance_47` holds issue #47's ratios (unified
tok/s per sampling >= --tok-s-target, TTFT with --check-ttft, pdserve's sampled / greedy TPOT). `acceptance`
holds issue #21's ratios (unified float32 tok/s and TPOT, unified bf16 tok/s, 1P1D tok/s) with
their targets; `--profile` adds vLLM's own decode-step profile at batch --concurrency
(bench/vllm_profile.py: GEMM time vs step time). JSON + PNG in bench/results/vs_vllm.*.
Timings are only meaningful on an otherwise idle machine.

Full run for issue #21 (2 rounds, alternating order, float32 and bf16, all four systems, vLLM's
profile; vLLM installed in /work/venv-vllm as shared/reference/vllm-cpu.md says):
    python3 bench/vs_vllm.py --make-model /work/smollm2-hf --vllm-python \
        /work/venv-vllm/bin/python --dtypes float32,bfloat16 --rounds 2 --profile
Wall time on the idle 2-core box, about 20-25 min: 16 system starts plus one for the profile
(pdserve ~15-30 s; vLLM ~30-90 s from its torch.compile cache in ~/.cache/vllm, a few minutes
more the first time a dtype / CPU binding / role is compiled), each followed by ~20-60 s of
traffic (32 prompts x 64 tokens; vLLM 1P1D is the slowest). `--pd-dtypes float32` runs 1P1D in
float32 only (the issue's 1P1D target names no dtype) and saves ~6 min. The NIXL side-channel
ports (5600, 5601) must be free.

As an AVX2-only CPU (issue #31) on an AVX-512 host: `--cap-isa avx2` caps both systems'
libraries (see --help) and writes vs_vllm_cap_avx2.json.

A bigger model (issue #31): `--make-1b /work/llama1b-hf` writes a Llama-3.2-1B-shaped model with
random weights once (vllm_launch.LLAMA_1B_SHAPE: 1.07 B parameters, 4.3 GB float32, SmolLM2's
tokenizer) and runs the same comparison on it into vs_vllm_1b.json / .png:
    python3 bench/vs_vllm.py --make-1b /work/llama1b-hf --vllm-python \
        /work/venv-vllm/bin/python --systems pdserve-unified,vllm-unified --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from common import Run, alternating, figure, load_note, ratio, save_figure
from serving import SAMPLINGS, closed_loop, latency_stats, random_prompts
from vllm_launch import VLLM_ENV, make_hf_folder, make_llama_1b_folder, start_system

NAME = "vs_vllm"
SYSTEMS = ("pdserve-unified", "pdserve-1p1d", "vllm-unified", "vllm-1p1d")
PROBE_TOKENS = 16
# (name, pdserve system, vLLM system, dtype, metric, target, higher is better)
TARGETS = (("unified_f32_tok_s", "pdserve-unified", "vllm-unified", "float32", "tok_s", 1.2, True),
           ("unified_f32_tpot", "pdserve-unified", "vllm-unified", "float32", "mean_tpot_s", 1.0,
            False),
           ("unified_bf16_tok_s", "pdserve-unified", "vllm-unified", "bfloat16", "tok_s", 1.2,
            True),
           ("1p1d_f32_tok_s", "pdserve-1p1d", "vllm-1p1d", "float32", "tok_s", 2.0, True),
           ("1p1d_bf16_tok_s", "pdserve-1p1d", "vllm-1p1d", "bfloat16", "tok_s", 2.0, True))


def vllm_missing(args: argparse.Namespace) -> str | None:
    if not args.vllm_python:
        return "no --vllm-python given"
    r = subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True,
                       timeout=300, check=False)
    if r.returncode != 0:
        return f"{args.vllm_python} cannot import vllm"
    if not (args.model_path and Path(args.model_path, "config.json").is_file()):
        return "vLLM needs --model-path to be an HF folder"
    return None


def vocab(args: argparse.Namespace) -> int:
    from pdcore.engine.model.loader import load_config
    from pdcore.engine.model.tokenizer import resolve_model

    return int(load_config(resolve_model(args.model_path)).vocab_size)


def probe(url: str, prompt: list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def mode(dtype: str, sampling: str) -> str:
    """Result key of one dtype and client sampling: the dtype alone for greedy (issue #21's
    targets), `dtype/default` for the client's default sampling."""
    return dtype if sampling == "greedy" else f"{dtype}/{sampling}"


# prompt sets: the warm-up and probe have their own, and so has each client sampling, so that no
# measured request finds its prompt in a prefix cache filled by an earlier pass on the same
# server (pdserve's radix cache answered a repeated pass's prefills at 0.15 s TTFT instead of
# 1.2 s); every system gets the same sets
PROMPT_SEEDS = {"greedy": 0, "default": 1, "warm": 1000}


def prompt_sets(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    voc = vocab(args)
    return {k: random_prompts(args.concurrency if k == "warm" else args.num_prompts,
                              args.input_len, voc, seed=seed)
            for k, seed in PROMPT_SEEDS.items()}


def one_round(system: str, dtype: str, args: argparse.Namespace,
              prompts: dict[str, list[list[int]]], rep: int = 0) -> dict[str, dict[str, Any]]:
    """One start of `system`; each client sampling of --sampling in turn (order alternating by
    round) on that one server, each on its own prompts. Per sampling: its round's numbers (or
    the error)."""
    load_before = os.getloadavg()
    group = start_system(system, args.model_path, dtype, args.vllm_python, args.vllm_bind,
                         args.vllm_kv_gib, args.vllm_side_ports, args.max_model_len,
                         tuple(args.pdserve_flag))
    out: dict[str, dict[str, Any]] = {}
    try:
        startup = group.wait_ready(args.startup_timeout)
        asyncio.run(closed_loop(group.url, prompts["warm"], 4, args.concurrency))
        text = probe(group.url, prompts["warm"][0])
        for sampling in alternating(args.sampling, rep):
            before = os.getloadavg()
            steps0 = server_steps(group.url, system)
            results, wall = asyncio.run(closed_loop(group.url, prompts[sampling],
                                                    args.output_len, args.concurrency, sampling))
            steps = step_split(steps0, server_steps(group.url, system), wall)
            stats = latency_stats(results)
            out[sampling] = {
                "tok_s": stats["output_tokens"] / wall, "wall_s": wall, "startup_s": startup,
                "mean_ttft_s": stats["ttft_s"].get("mean"),
                "p99_ttft_s": stats["ttft_s"].get("p99"),
                "mean_tpot_s": stats["tpot_s"].get("mean"),
                "p99_tpot_s": stats["tpot_s"].get("p99"), "p99_itl_s": stats["itl_s"].get("p99"),
                "errors": stats["errors"], "error_samples": stats["error_samples"],
                "probe_text": text, "sampling": sampling, "loadavg_before": list(before),
                "loadavg_after": list(os.getloadavg()), "logs": group.logs(),
                "server_steps": steps}
    except (RuntimeError, httpx.HTTPError) as e:
        # one system failing to start or serve must not cost the other systems' numbers
        err = {"error": f"{type(e).__name__}: {e}", "loadavg_before": list(load_before),
               "loadavg_after": list(os.getloadavg()), "logs": group.logs()}
        return {sm: out.get(sm, {**err, "sampling": sm}) for sm in args.sampling}
    finally:
        group.stop()
    return out


STEP_COUNTERS = ("forward_decode_steps_total", "forward_decode_seconds_total",
                 "forward_extend_steps_total", "forward_extend_seconds_total")


def server_steps(url: str, system: str) -> dict[str, float] | None:
    """pdserve's forward-step counters from /metrics (None for other systems)."""
    if not system.startswith("pdserve-unified"):
        return None
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in STEP_COUNTERS:
            if line.startswith(f"pdserve_scheduler_{name}"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def step_split(before: dict[str, float] | None, after: dict[str, float] | None,
               wall: float) -> dict[str, float] | None:
    """Where the server's wall time went during one client run: decode and extend forwards
    (count, seconds, mean ms) and the rest (scheduling, streaming, HTTP: wall - forwards)."""
    if before is None or after is None or not after:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in STEP_COUNTERS}
    dec_n, dec_s = d["forward_decode_steps_total"], d["forward_decode_seconds_total"]
    ext_n, ext_s = d["forward_extend_steps_total"], d["forward_extend_seconds_total"]
    return {"decode_steps": dec_n, "decode_s": dec_s,
            "decode_ms": dec_s / dec_n * 1e3 if dec_n else None,
            "extend_steps": ext_n, "extend_s": ext_s,
            "extend_ms": ext_s / ext_n * 1e3 if ext_n else None,
            "outside_forward_s": wall - dec_s - ext_s}


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"failed_rounds": sum("error" in r for r in rounds)}
    rounds = [r for r in rounds if "error" not in r] or [{"tok_s": None, "mean_ttft_s": None,
                                                          "mean_tpot_s": None, **rounds[0]}]
    for k in ("tok_s", "mean_ttft_s", "mean_tpot_s", "p99_ttft_s", "p99_tpot_s"):
        vals = [r[k] for r in rounds if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    out["loadavg_1m_max"] = max(max(r["loadavg_before"][0], r["loadavg_after"][0])
                                for r in rounds)
    return out


def acceptance(med: dict[str, dict[str, Any]],
               probes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Issue #21's ratios: pdserve / vLLM (for TPOT lower is better, so met means <= target).
    A ratio of systems whose greedy probes differ compares different work: never met."""
    out = {}
    for name, ours, theirs, dtype, metric, target, higher in TARGETS:
        a = med.get(dtype, {}).get(ours, {}).get(metric)
        b = med.get(dtype, {}).get(theirs, {}).get(metric)
        if a is None or b is None:
            continue
        r = ratio(a, b)
        same = (probes or {}).get(dtype, {}).get("all_equal", True)
        out[name] = {"pdserve": a, "vllm": b, "ratio": r, "target": target,
                     "met": same and (r >= target if higher else r <= target)}
        if not same:
            out[name]["why_not"] = "the systems' greedy probe texts differ"
    return out


def acceptance_47(med: dict[str, dict[str, Any]], args: argparse.Namespace,
                  probes: dict[str, Any]) -> dict[str, Any]:
    """Issue #47's ratios, pdserve unified over vLLM unified in the first dtype, per client
    sampling: output tok/s (>= --tok-s-target), mean TTFT (<= 1, with --check-ttft); and
    pdserve's TPOT sampled over greedy (<= 1.05; the issue names batch 8, i.e. --concurrency 8)."""
    out: dict[str, Any] = {}
    d = args.dtypes[0]
    for sm in args.sampling:
        a = med.get(mode(d, sm), {}).get("pdserve-unified", {})
        b = med.get(mode(d, sm), {}).get("vllm-unified", {})
        same = probes.get(mode(d, sm), {}).get("all_equal", True)
        checks = [("tok_s", "tok_s", args.tok_s_target, True)]
        if args.check_ttft:
            checks.append(("ttft", "mean_ttft_s", 1.0, False))
        for name, metric, target, higher in checks:
            if a.get(metric) is None or b.get(metric) is None:
                continue
            r = ratio(a[metric], b[metric])
            out[f"unified_{name}_{sm}"] = {
                "pdserve": a[metric], "vllm": b[metric], "ratio": r, "target": target,
                "met": same and (r >= target if higher else r <= target)}
    g = med.get(mode(d, "greedy"), {}).get("pdserve-unified", {}).get("mean_tpot_s")
    t = med.get(mode(d, "default"), {}).get("pdserve-unified", {}).get("mean_tpot_s")
    if g and t:
        out["pdserve_tpot_sampled_over_greedy"] = {
            "sampled": t, "greedy": g, "ratio": ratio(t, g), "target": 1.05,
            "met": ratio(t, g) <= 1.05, "batch": args.concurrency}
    return out


def probes_agree(rounds: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per dtype: the greedy probe text of each system (first round) and whether they agree."""
    out = {}
    for dtype, by_sys in rounds.items():
        texts = {s: ok[0]["probe_text"] for s, r in by_sys.items()
                 if (ok := [x for x in r if "probe_text" in x])}
        out[dtype] = {"texts": texts, "all_equal": len(set(texts.values())) <= 1}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="HF folder (vLLM needs one)")
    ap.add_argument("--make-model", type=Path, default=None,
                    help="first write the SmolLM2 float32 HF folder here (if missing)")
    ap.add_argument("--make-1b", type=Path, default=None,
                    help="write a Llama-3.2-1B-shaped random float32 model to this folder (once) "
                         "and serve it (vllm_launch.LLAMA_1B_SHAPE); results go to "
                         "vs_vllm_1b.json unless --tag says otherwise")
    ap.add_argument("--tag", default=None, help="results file vs_vllm_<tag>.json / .png")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    ap.add_argument("--vllm-bind", default="0-1",
                    help="VLLM_CPU_OMP_THREADS_BIND for unified vLLM (1P1D binds 0 / 1)")
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-side-ports", default="5600,5601",
                    help="NIXL side-channel ports of vLLM's prefill,decode servers (fixed: "
                         "vLLM's compile cache key includes them)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--dtypes", default=None, help="comma list of float32,bfloat16")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="one dtype (when --dtypes is not given)")
    ap.add_argument("--pd-dtypes", default=None,
                    help="dtypes the 1P1D systems run in (default: all of --dtypes)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--sampling", default="greedy,default",
                    help="comma list of client samplings, each measured on the same server "
                         "start: greedy (temperature 0) and/or default (no temperature sent: "
                         "the server's default, 1.0)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="vLLM's --max-model-len (default: input + output rounded up to 256, "
                         "at least 2048)")
    ap.add_argument("--pdserve-flag", action="append", default=[],
                    help="a `pdserve serve` flag for pdserve's systems (repeat; e.g. "
                         "--pdserve-flag=--quantization --pdserve-flag=w8a8_int8)")
    ap.add_argument("--make-w8a8", type=Path, default=None,
                    help="write --model-path (a float HF folder) quantized to "
                         "compressed-tensors W8A8 int8 here (once), serve "
                         "it: vLLM from its config, pdserve with --quantization w8a8_int8 "
                         "(issue #48); results go to vs_vllm_w8a8.json unless --tag says")
    ap.add_argument("--tok-s-target", type=float, default=1.3,
                    help="issue #47's pdserve / vLLM unified output tok/s target (1.3 at "
                         "128/64 and 512/128; 1.2 for the long contexts)")
    ap.add_argument("--check-ttft", action="store_true",
                    help="also hold pdserve's mean TTFT to <= vLLM's (issue #47's long "
                         "contexts)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile vLLM's decode step at batch --concurrency (float32)")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--cap-isa", choices=["avx2"], default=None,
                    help="run every system as an AVX2-only CPU would, as far as its libraries "
                    "can be capped: pdserve by PDCORE_CPU_ISA (its native kernels, torch and "
                    "oneDNN), vLLM by ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA (torch and "
                    "oneDNN; its own C++ kernels keep the ISA they were built for)")
    args = ap.parse_args(argv)
    if args.cap_isa:
        from pdcore.runtime_env import ISA_ENV, ISA_ENVS

        os.environ.update({ISA_ENV: args.cap_isa, **ISA_ENVS[args.cap_isa]})  # children inherit
        # measured here (vLLM 0.32, torch 2.13): with VLLM_USE_AOT_COMPILE=0 a vLLM whose ATen
        # and oneDNN are capped to AVX2 answers token 0 for every position (empty text, fresh
        # compile cache or not); its default AOT compile serves the right text, so capped runs
        # keep that default (each start compiles: slower start-up, same serving)
        VLLM_ENV.pop("VLLM_USE_AOT_COMPILE", None)
        args.tag = args.tag or f"cap_{args.cap_isa}"
    args.sampling = [x for x in args.sampling.split(",") if x]
    if not args.sampling or set(args.sampling) - set(SAMPLINGS):
        ap.error(f"--sampling: want a comma list of {', '.join(SAMPLINGS)}, got "
                 f"{','.join(args.sampling) or 'nothing'}")
    need = args.input_len + args.output_len + 16
    args.max_model_len = args.max_model_len or max(2048, -(-need // 256) * 256)
    if args.max_model_len < need:
        ap.error(f"--max-model-len {args.max_model_len} is below input + output ({need})")
    args.dtypes = [d for d in (args.dtypes or args.dtype).split(",") if d]
    args.pd_dtypes = [d for d in (args.pd_dtypes or ",".join(args.dtypes)).split(",") if d]
    bad = sorted({d for d in args.dtypes + args.pd_dtypes} - {"float32", "bfloat16"})
    if bad:
        ap.error(f"--dtypes: unknown {bad}; use float32 and/or bfloat16")
    try:
        a, b = (int(p) for p in args.vllm_side_ports.split(","))
    except ValueError:
        ap.error(f"--vllm-side-ports: want two ports like 5600,5601, got {args.vllm_side_ports!r}")
    args.vllm_side_ports = (a, b)
    args.systems = [s for s in args.systems.split(",") if s]
    if unknown := [s for s in args.systems if s not in SYSTEMS]:
        ap.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    if sum(x is not None for x in (args.make_model, args.make_1b, args.make_w8a8)) > 1:
        ap.error("--make-model, --make-1b and --make-w8a8 each make the model served; give one")
    if args.make_model:
        make_hf_folder(args.make_model)
        args.model_path = args.model_path or str(args.make_model)
    if args.make_1b:
        make_llama_1b_folder(args.make_1b)
        args.model_path = args.model_path or str(args.make_1b)
        args.tag = args.tag or "1b"
    if args.make_w8a8:
        from pdcore.testing.quant_models import make_w8a8_model

        src = args.model_path
        if not (src and Path(src, "config.json").is_file()):
            ap.error("--make-w8a8 quantizes --model-path: give the float HF folder")
        if not (args.make_w8a8 / "config.json").is_file():
            tmp = args.make_w8a8.with_name(args.make_w8a8.name + ".tmp")
            make_w8a8_model(src, str(tmp))
            os.rename(tmp, args.make_w8a8)
        args.model_path = str(args.make_w8a8)
        args.pdserve_flag = [*args.pdserve_flag, "--quantization", "w8a8_int8"]
        args.tag = args.tag or "w8a8"
    args.name = f"{NAME}_{args.tag}" if args.tag else NAME
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    run = Run(args.name, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    systems, skipped = list(args.systems), {}
    missing = vllm_missing(args) if any(s.startswith("vllm") for s in systems) else None
    if missing:
        skipped.update({s: missing for s in systems if s.startswith("vllm")})
        systems = [s for s in systems if not s.startswith("vllm")]
    prompts = prompt_sets(args)
    sys_of = {d: [s for s in systems if "1p1d" not in s or d in args.pd_dtypes]
              for d in args.dtypes}
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {
        mode(d, sm): {s: [] for s in sys_of[d]} for d in args.dtypes for sm in args.sampling}
    t0 = time.monotonic()
    for rep in range(args.rounds):
        for dtype in args.dtypes:
            for s in alternating(sys_of[dtype], rep):
                for sm, r in one_round(s, dtype, args, prompts, rep).items():
                    rounds[mode(dtype, sm)][s].append(r)
                    if "error" in r:
                        print(f"round {rep} {mode(dtype, sm)} {s}: FAILED {r['error']}",
                              flush=True)
                        continue
                    print(f"round {rep} {mode(dtype, sm)} {s}: {r['tok_s']:.1f} tok/s, TTFT "
                          f"{r['mean_ttft_s'] or 0:.2f} s, TPOT "
                          f"{(r['mean_tpot_s'] or 0) * 1000:.0f} ms, start "
                          f"{r['startup_s']:.0f} s, load {r['loadavg_before'][0]:.1f}->"
                          f"{r['loadavg_after'][0]:.1f}, {time.monotonic() - t0:.0f} s in",
                          flush=True)
    med = {d: {s: medians(v) for s, v in by_sys.items()} for d, by_sys in rounds.items()}
    profile = None
    if args.profile and "vllm-unified" in systems:
        from vllm_profile import profile_decode

        profile = profile_decode(args, prompts["greedy"])
    data = {"systems": systems, "dtypes": args.dtypes, "skipped": skipped, "rounds": rounds,
            "median": med, "acceptance": acceptance(med, probes_agree(rounds)),
            "acceptance_47": acceptance_47(med, args, probes_agree(rounds)),
            "probes": probes_agree(rounds),
            "vllm_profile": profile, "vllm_measured": any(s.startswith("vllm") for s in systems)}
    path = run.finish(data, args.out_dir)
    note = load_note(run)
    plot(data, args, note, run.machine_start)
    report(data, note, path)
    return data


def report(data: dict[str, Any], note: str, path: Path) -> None:
    if data["skipped"]:
        print("pdserve alone: vLLM not measured (" + "; ".join(
            f"{k}: {v}" for k, v in data["skipped"].items()) + ")")
    for d, by_sys in data["median"].items():
        for s, m in by_sys.items():
            print(f"  {d:8s} {s:16s} {m['tok_s'] or 0:7.1f} tok/s  TTFT {m['mean_ttft_s'] or 0:.2f} s"
                  f"  TPOT {(m['mean_tpot_s'] or 0) * 1000:.0f} ms  (load <= "
                  f"{m['loadavg_1m_max']:.1f})")
    for k, a in data["acceptance"].items():
        print(f"ACCEPT {k}: {a['ratio']:.2f}x (target {'>=' if 'tpot' not in k else '<='} "
              f"{a['target']}) {'met' if a['met'] else 'NOT met'}")
    for k, a in data["acceptance_47"].items():
        lower = "tpot" in k or "ttft" in k
        print(f"ACCEPT #47 {k}: {a['ratio']:.2f}x (target {'<=' if lower else '>='} "
              f"{a['target']}) {'met' if a['met'] else 'NOT met'}")
    if data["vllm_profile"]:
        p = data["vllm_profile"]
        print(f"vLLM decode step at batch {p.get('batch')}: {p.get('summary')}")
    for d, p in data["probes"].items():
        print(f"greedy probe {d}: {'all systems agree' if p['all_equal'] else p['texts']}")
    print(f"({note}) -> {path}")


def plot(data: dict[str, Any], args: argparse.Namespace, note: str,
         machine: dict[str, Any]) -> None:
    fig, (a, b) = figure(2, 5.5, 3.8)
    names = [f"{s}\n{d}" for d, by_sys in data["median"].items() for s in by_sys]
    meds = [m for by_sys in data["median"].values() for m in by_sys.values()]
    colors = ["C1" if n.startswith("vllm") else "C0" for n in names]
    a.bar(names, [m["tok_s"] or 0 for m in meds], color=colors)
    a.set_ylabel("output tok/s (median over rounds)")
    b.bar(names, [(m["mean_tpot_s"] or 0) * 1000 for m in meds], color=colors)
    b.set_ylabel("mean TPOT (ms)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=6, rotation=20)
    acc = ", ".join(f"{k} {v['ratio']:.2f}x" for k, v in
                    {**data["acceptance"], **data["acceptance_47"]}.items())
    cpu = machine.get("cpu", "")
    flags = "+".join(machine.get("cpu_flags", []))
    fig.suptitle(f"{args.name}: {args.input_len} in / {args.output_len} out, concurrency "
                 f"{args.concurrency}; {note}\n{cpu} ({flags}); {acc}", fontsize=8)
    save_figure(fig, args.name, args.out_dir)


if __name__ == "__main__":
    main()
