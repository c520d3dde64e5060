"""Which kernel attends a prefill chunk on the CPU (#47): the native causal kernel (engine/native:
prefill_attention_paged, the pool read in place) or torch's SDPA (Attention.forward's SDPA path:
a whole prompt's own K/V, or a chunk after its prefix through `_after_prefix`).

On a CPU with AMX, torch's CPU flash attention runs bf16 in AMX tiles (oneDNN's brgemm); the
native kernel does not: one layer of the 1B-shaped model's 4096-token causal prefill took
0.442 s native against 0.135 s through SDPA (bench/prefill_attn_route.py). The trade: the
native kernels keep "a row has the same bits in every phase" (native/bf16_attn.h: a row's
attention output is the same whether a prefill or a decode step computed it); SDPA's prefill
rows differ in bits from the decode kernel's (bf16 rounding of another summation order), so
where `auto` picks SDPA a prompt's rows are no longer bit-equal to the same rows decoded.

PDCORE_PREFILL_ATTENTION:
- `native`: the native kernel wherever it applies (the bits held in every phase);
- `sdpa`: SDPA for every prefill chunk of two or more tokens whose pool holds the model's dtype;
- `auto` (default): SDPA for bf16 chunks of at least SDPA_MIN_TOKENS tokens on a CPU with
  amx_bf16 (cpu_features: PDCORE_CPU_ISA=avx512 or avx2 hides it, so a forced-down run stays
  native, as on AMD Zen); float32 (no AMX for float32) and short chunks stay native.
The choice is made once at load and set on every layer's attention as `sdpa_from`: chunks of
at least that many tokens (and a pool in the query's dtype) take SDPA.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdcore.env import ENV

log = logging.getLogger(__name__)

NEVER = 1 << 62  # sdpa_from that no chunk reaches: the native kernel wherever it applies
# the crossover measured on a Xeon with AMX (bench/results/prefill_attn_route.json, bf16, two
# threads, 1B-shaped and SmolLM2 heads): native 1.1-1.4x faster at 2 and 8 tokens, SDPA
# 1.2-1.8x at 16 (a whole prompt, or after a 4096 prefix), 1.9-3.4x at 64, 3.3-3.8x at 1024+
SDPA_MIN_TOKENS = 16


@dataclass(frozen=True)
class Route:
    mode: str  # the setting: auto, native or sdpa
    sdpa_from: int  # chunks of at least this many tokens take SDPA (NEVER: none)
    why: str

    def describe(self) -> str:
        if self.sdpa_from >= NEVER:
            return f"prefill attention: native kernel ({self.mode}: {self.why})"
        return (f"prefill attention: SDPA for chunks of >= {self.sdpa_from} tokens, native "
                f"below ({self.mode}: {self.why})")


def choose(dtype: torch.dtype, device: str, mode: str | None = None) -> Route:
    """The route of a model computing in `dtype` on `device` ("cpu", "cuda"); `mode` None:
    PDCORE_PREFILL_ATTENTION (a bad value: EnvError, exit 2)."""
    mode = ENV.pdcore_prefill_attention if mode is None else mode
    if device != "cpu":
        return Route(mode, NEVER, "not the CPU: no native kernel, SDPA as always")
    if mode == "native":
        return Route(mode, NEVER, "set")
    if mode == "sdpa":
        return Route(mode, 2, "set")
    if dtype != torch.bfloat16:
        return Route(mode, NEVER, f"{str(dtype).removeprefix('torch.')} (AMX computes bf16)")
    from pdcore.engine.cpu_features import cpu_flags

    if "amx_bf16" not in cpu_flags():
        return Route(mode, NEVER, "no amx_bf16 on this CPU (or PDCORE_CPU_ISA hides it)")
    return Route(mode, SDPA_MIN_TOKENS, "bf16 on a CPU with amx_bf16: torch's flash attention "
                 "in AMX tiles; its rows differ in bits from the decode kernel's")


def apply(model: torch.nn.Module) -> Route | None:
    """Choose for a loaded model (its first norm's dtype, its device) and set `sdpa_from` on
    every layer's attention that has one; logs the choice once. None: no such layer."""
    attns = [la.self_attn for la in getattr(model, "layers", ())
             if hasattr(getattr(la, "self_attn", None), "sdpa_from")]
    if not attns:
        return None
    w = model.layers[0].input_layernorm.weight
    route = choose(w.dtype, w.device.type)
    for a in attns:
        a.sdpa_from = route.sdpa_from
    log.info("%s", route.describe())
    return route
