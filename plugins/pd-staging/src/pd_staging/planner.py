"""The `staging` transfer planner (selected by SGLANG_DISAGG_STAGING_BUFFER=1).

- pairs whose heads line up (equal TP, or GQA replicas holding the same heads): the default
  page-run plan, no staging at all (bypass);
- different TP (non-MLA): staged; P gathers a chunk's head slices into a per-worker buffer
  (pd_staging.buffers), one write lands it in decode's ring grant, decode scatters it into its
  pages (pd_staging.ring). `plan()` still answers for any pair (the per-head slice path), which
  the core uses when the other side runs without staging;
- MLA models: refused with a clear error (their latent cache has no heads to slice).
"""

from __future__ import annotations

import numpy as np

from pd_staging.geometry import same_heads
from pdcore.errors import ConfigError
from pdcore.interfaces.planner import (
    DecodeStaging,
    KVLayout,
    PrefillStaging,
    StagingContext,
    StagingPlanner,
)
from pdcore.interfaces.transfer import CopyBatch
from pdcore.plugins.host import transfer_planners

MLA_REFUSAL = ("pd-staging does not support MLA models (their latent KV cache is not split by "
               "heads); unset SGLANG_DISAGG_STAGING_BUFFER: MLA KV moves between any prefill "
               "and decode TP sizes without staging")


class StagingTransferPlanner(StagingPlanner):
    name = "staging"

    def __init__(self) -> None:
        self._default = transfer_planners().create("default")  # the page-run and slice plans

    def supports(self, src: KVLayout, dst: KVLayout) -> tuple[bool, str]:
        if src.is_mla or dst.is_mla:
            return False, MLA_REFUSAL
        return self._default.supports(src, dst)

    def staged(self, src: KVLayout, dst: KVLayout) -> bool:
        if src.is_mla or dst.is_mla or src.tp_size == dst.tp_size:
            return False
        return not same_heads(src.tp_size, dst)

    def plan(self, src: KVLayout, dst: KVLayout, src_pages: np.ndarray, dst_pages: np.ndarray,
             token_count: int | None = None) -> CopyBatch:
        return self._default.plan(src, dst, src_pages, dst_pages, token_count)

    def open_prefill(self, ctx: StagingContext) -> PrefillStaging:
        from pd_staging.buffers import PrefillBuffers

        _check(ctx)
        return PrefillBuffers(ctx)

    def open_decode(self, ctx: StagingContext) -> DecodeStaging:
        from pd_staging.ring import DecodeRing

        _check(ctx)
        return DecodeRing(ctx)


def _check(ctx: StagingContext) -> None:
    if ctx.layout.is_mla:
        raise ConfigError(MLA_REFUSAL)
    if ctx.buffer_bytes < 1 or ctx.ring_bytes < 1:
        raise ConfigError("SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB and SGLANG_DISAGG_STAGING_POOL_"
                          "SIZE_MB must be >= 1")
