"""The W8A8 and packed-GGUF decode steps at batch B x ctx C taken apart, against what each must
read (#48): per system, wall-clock ms on the engine's threads (medians over --iters, the systems
alternating), in process:

- body GEMMs by kind (qkv, o_proj, gate_up, down: every layer's weight on B random rows, back to
  back, as bench/w8a8_step.py) and the lm_head (what the engine calls, in its stored dtype);
- attention: the native decode attention alone over L layers' K/V of B sequences x C tokens
  (distinct buffers per layer, the decode view's float32 layout);
- layers: the native decode forward without logits over consecutive decode batches growing
  from C tokens; "norms, rope, K/V stores" = layers - body GEMMs - attention;
- forward (with the final norm and logits), the sampler greedy and at temperature 1, and the
  engine step (TPOT) of B prompts of C tokens through LLMEngine; "Python (begin, scheduler)" =
  TPOT - forward - greedy sampler.

Bytes each step must read: the body weights, the lm_head, the K/V (L x B x C x kv_heads x
head_dim x 2 x 4 bytes), the embedding's B rows (negligible); each divided by the read
bandwidth measured in the run (bench/quant_speed._bandwidth) is that piece's floor.

Systems: `w8a8` (--w8a8-path, PDCORE_W8A8_LM_HEAD as set), `gguf_packed` (the default GGUF,
PDCORE_GGUF_PACKED=1), `gguf_float32` (the same file de-quantized). Run:
`python bench/quant_step_profile.py [--batch 8] [--ctx 512] [--tag T]`; JSON in
bench/results/quant_step_profile[_T].json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Run, alternating, load_note
from quant_speed import _bandwidth
from w8a8_step import KINDS, Parts, _wall_ms

NAME = "quant_step_profile"
SYSTEMS = {"w8a8": {}, "gguf_packed": {"PDCORE_GGUF_PACKED": "1"},
           "gguf_float32": {"PDCORE_GGUF_PACKED": "0"}}


def _nbytes(t: Any) -> int:
    """Bytes a weight holds: a packed GGUF weight's rows once (its type dimension has stride 0),
    an Int8Weight's tensors, else the tensor's."""
    from pdcore.engine.model import gguf_packed

    if not isinstance(t, torch.Tensor):
        return sum(_nbytes(x) for x in t.tensors())
    if gguf_packed.is_packed(t):
        t = gguf_packed.rows_of(t)
    return t.numel() * t.element_size()


def _attention(eng: Any, batch: int, ctx: int) -> tuple[Any, int]:
    """The native decode attention over every layer's K/V (B x ctx), and the K/V bytes."""
    from pdcore.engine import native

    model = eng.engine.model
    a = model.layers[0].self_attn
    kvh, hd, heads = a.num_kv_heads, a.head_dim, a.num_heads
    op = native.op("decode_attention")
    g = torch.Generator().manual_seed(1)
    kv = [(torch.randn(batch, kvh, ctx, hd, generator=g), torch.randn(batch, kvh, ctx, hd,
                                                                        generator=g))
          for _ in model.layers]
    q = torch.randn(batch, kvh, heads // kvh, hd, generator=g)
    nbytes = sum(k.numel() * 4 * 2 for k, _ in kv)
    return (lambda: [op(q, k, v, None, float(a.scale)) for k, v in kv]), nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--w8a8-path", default="/work/smollm2-w8a8")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--tag", default=None, help="results in quant_step_profile_<tag>.json")
    a = ap.parse_args()
    from pdcore.config import ServerArgs
    from pdcore.runtime.llm_engine import LLMEngine

    systems = a.systems.split(",")
    name = f"{NAME}_{a.tag}" if a.tag else NAME
    run = Run(name, vars(a))
    engines, parts, attn, meta = {}, {}, {}, {}
    try:
        for s in systems:
            saved = {k: os.environ.get(k) for k in SYSTEMS[s]}
            os.environ.update(SYSTEMS[s])
            try:
                engines[s] = LLMEngine(ServerArgs(
                    model_path=a.w8a8_path if s == "w8a8" else None,
                    max_total_tokens=a.batch * (a.ctx + a.steps + a.new + 128),
                    # the prompts cached: the TPOT's two generate calls skip their prefills
                    disable_radix_cache=False, log_level="warning"))
            finally:
                for k, v in saved.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
            p = parts[s] = Parts(engines[s], a.batch, a.ctx, a.steps)
            p.prompts = [[(7 * i + 31 * j) % 5000 + 100 for j in range(a.ctx - a.new)]
                         for i in range(a.batch)]
            fn, kv_bytes = _attention(engines[s], a.batch, a.ctx)
            p.fns["attention"] = (fn, 1)
            model = engines[s].engine.model
            head = model.lm_head_packed if model.lm_head_packed is not None else model.lm_head
            kinds = {"qkv": [x.self_attn.qkv for x in model.layers],
                     "o_proj": [x.self_attn.o_proj for x in model.layers],
                     "gate_up": [x.mlp.gate_up for x in model.layers],
                     "down": [x.mlp.down for x in model.layers]}
            p.kind_bytes = {k: sum(_nbytes(m.int8 if m.int8 is not None else m.packed
                                           if m.packed is not None else m.weight) for m in ms)
                            for k, ms in kinds.items()}
            p.head_bytes = _nbytes(head)
            meta[s] = {"kv_bytes": kv_bytes, "body_bytes": p.kind_bytes,
                       "lm_head_bytes": p.head_bytes,
                       "lm_head_dtype": str(getattr(head, "dtype", type(head).__name__)),
                       "lm_head_shape": list(getattr(head, "shape", [])),
                       "native_loop": model.native is not None}
        samples: dict[str, dict[str, list[float]]] = {s: {} for s in systems}
        bandwidth = []
        for r in range(a.iters):
            bandwidth.append(_bandwidth())
            for s in alternating(systems, r):
                parts[s].once(samples[s], a.new)
    finally:
        for e in engines.values():
            e.close()
    bw = statistics.median(bandwidth)
    result: dict[str, Any] = {"bandwidth_gb_s": bw / 1e9,
                              "bandwidth_gb_s_rounds": [b / 1e9 for b in bandwidth],
                              "systems": {}}
    for s in systems:
        m = {k: statistics.median(v) for k, v in samples[s].items()}
        info = meta[s]
        body = sum(info["body_bytes"].values())
        m["body_gemms"] = sum(m[f"gemm_{k}"] for k in KINDS)
        m["norms_rope_kv_store"] = m["layers"] - m["body_gemms"] - m["attention"]
        m["final_norm_and_logits"] = m["forward"] - m["layers"]
        m["python_begin_scheduler"] = m["engine_step"] - m["forward"] - m["sampler_greedy"]
        floor = {"body_gemms": body, "lm_head": info["lm_head_bytes"],
                 "attention": info["kv_bytes"]}
        floor_ms = {k: 1e3 * v / bw for k, v in floor.items()}
        floor_ms["step"] = sum(floor_ms.values())
        floor_ms["weights_only"] = floor_ms["body_gemms"] + floor_ms["lm_head"]
        of_floor = {k: m[k] / floor_ms[k] for k in ("body_gemms", "lm_head", "attention")}
        of_floor["step"] = m["engine_step"] / floor_ms["step"]
        result["systems"][s] = {**info, "ms": m, "floor_ms": floor_ms,
                                "time_over_floor": of_floor, "rounds": samples[s]}
    result["note"] = load_note(run)
    path = run.finish(result)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; {result['note']}")
    keys = ("gemm_qkv", "gemm_o_proj", "gemm_gate_up", "gemm_down", "body_gemms", "attention",
            "norms_rope_kv_store", "lm_head", "final_norm_and_logits", "sampler_greedy",
            "sampler_t1", "python_begin_scheduler", "engine_step")
    for s in systems:
        r = result["systems"][s]
        print(f"{s}: lm_head {r['lm_head_dtype']} {r['lm_head_bytes'] / 1e6:.1f} MB, body "
              f"{sum(r['body_bytes'].values()) / 1e6:.1f} MB, KV {r['kv_bytes'] / 1e6:.1f} MB")
        print("  " + ", ".join(f"{k} {r['ms'][k]:.2f}" for k in keys))
        print("  floors ms " + ", ".join(f"{k} {v:.2f}" for k, v in r["floor_ms"].items())
              + "; x floor " + ", ".join(f"{k} {v:.2f}" for k, v in r["time_over_floor"].items()))
    print(path)


if __name__ == "__main__":
    main()
