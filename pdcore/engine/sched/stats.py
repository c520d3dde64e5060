"""The scheduler's counters and the report it builds from them (what /get_load answers and
/metrics exports: docs/metrics.md; the report's type, `StatsReport`, is in pdcore.messages.stats,
since it crosses to the HTTP process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcore.messages.stats import Kind, StatsReport


@dataclass
class Counters:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    preempted: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    steps: int = 0
    # forward passes and their wall time, by kind: "decode" (every request one token) and
    # "extend" (at least one prompt chunk; decodes may ride along), so /metrics shows where a
    # server's time goes (mean decode step = decode seconds / decode steps)
    decode_steps: int = 0
    decode_seconds: float = 0.0
    extend_steps: int = 0
    extend_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def book(self, kind: str, took: float) -> None:
        """One forward's time by the step's kind: "extend", "decode" or "verify" (drafts
        verified: the speculator books those steps' time)."""
        self.steps += 1
        if kind == "extend":
            self.extend_steps += 1
            self.extend_seconds += took
        elif kind == "decode":
            self.decode_steps += 1
            self.decode_seconds += took


def scheduler_stats(s: Any, runner: Any, spec: Any) -> StatsReport:
    """The engine's report (/get_load, /metrics; pdcore.engine.loop.StepLoop.stats): the
    scheduler's queues, pages, counters, and those of its prefix cache, the native kernels,
    the role extension, the grammars (the runner's backend) and the speculator (None: off). `s`
    is the pdcore.engine.sched.scheduler.Scheduler (not imported: it imports this module)."""
    c = s.counters
    r = StatsReport()
    r.add(Kind.LOAD, {
        "num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
        "num_reqs": len(s.reqs), "num_pages_total": s.blocks.num_pages,
        "num_pages_free": s.blocks.num_free, "num_pages_used": s.blocks.num_used})
    r.add(Kind.INFO, {"page_size": s.blocks.page_size})
    r.add(Kind.LOAD, {"num_tokens": sum(q.seq_len for q in s.reqs.values())})
    r.add(Kind.TOTAL, {
        "prompt_tokens_total": c.prompt_tokens, "generation_tokens_total": c.generated_tokens,
        "finished_total": c.finished, "aborted_total": c.aborted,
        "preempted_total": c.preempted, "steps_total": c.steps,
        "forward_decode_steps_total": c.decode_steps,
        "forward_decode_seconds_total": c.decode_seconds,
        "forward_extend_steps_total": c.extend_steps,
        "forward_extend_seconds_total": c.extend_seconds})
    _budget_stats(s, r)
    _native_stats(s, runner, r)
    _cache_stats(s, r)
    _giveback_stats(runner, r)
    r.update(s.ext.stats())
    _grammar_stats(s, getattr(runner, "grammar", None), r)  # test runners may have none
    if spec is not None:
        r.add_named(spec.stats(), loads=("spec_cache_entries",))
    return r


def _budget_stats(s: Any, r: StatsReport) -> None:
    """The prefill budget of a step that also runs decodes: the fixed one or the last one
    given (auto, with its estimates and the mixed steps' count and budgets' sum)."""
    r.add_named(s.budget.stats())


def _grammar_stats(s: Any, g: Any, r: StatsReport) -> None:
    running = sum(1 for q in s.running if q.params.grammar is not None)
    r.add(Kind.TOTAL, {"grammar_compiled_total": g.compiled if g else 0,
                       "grammar_compile_seconds_total": g.compile_seconds if g else 0.0})
    r.add(Kind.LOAD, {"grammar_running_requests": running})


def _native_stats(s: Any, runner: Any, r: StatsReport) -> None:
    """Whether the native kernels serve (1/0) and on which ISA (native_isa_*: 1 for the
    library loaded), how many decode steps took the native layer loop (engine/native; the
    rest ran the Python loop), how many prefill chunks the native causal attention served, how many sampled batches took each sampler path (greedy
    argmax, the native sampler, the torch fallback) and how many GEMM weights sit in each
    layout (models/layers.py: chosen at load)."""
    from pdcore.engine import native
    from pdcore.engine.model.layers import weight_layouts

    model = runner.model
    if s.gemm_layouts is None:
        s.gemm_layouts = weight_layouts(model)
    isa = native.isa()
    r.add(Kind.INFO, {"native_kernels": int(native.status().startswith("native")),
                      **{f"native_isa_{name}": int(isa == name) for name in native.ISAS}})
    r.add(Kind.TOTAL, {"native_decode_steps_total":
                       int(getattr(model, "native_steps", 0)),
                       "native_prefill_chunks_total":
                       int(getattr(model, "native_prefill_chunks", 0))})
    r.add(Kind.TOTAL, {f"sampler_batches_{path}_total": n  # test runners may not count
                       for path, n in getattr(runner, "sampler_paths", {}).items()})
    r.add(Kind.INFO, {f"gemm_weights_{k}": v for k, v in s.gemm_layouts.items()})


def _giveback_stats(runner: Any, r: StatsReport) -> None:
    """Bytes of free, written KV pool pages handed back to the kernel at idle, since start
    (engine/kv/giveback.py; ModelRunner.given_back: 0 where the pool is not a plain host pool).
    Rank 0's: every TP rank gives back the same pages of its own shard."""
    mr = getattr(runner, "model_runner", None)  # test runners may have none
    r.add(Kind.TOTAL, {"kv_pages_given_back_bytes_total": int(getattr(mr, "given_back", 0))})


def _cache_stats(s: Any, r: StatsReport) -> None:
    c, cache = s.counters, s.cache
    r.add(Kind.INFO, {"radix_cache_enabled": cache is not None})
    r.add(Kind.TOTAL, {"cache_hit_tokens_total": c.cached_tokens})
    r.add(Kind.INFO, {"cache_hit_rate": c.cached_tokens / c.prompt_tokens
                      if c.prompt_tokens else 0.0})
    r.add(Kind.LOAD, {"radix_cache_pages": cache.num_pages if cache else 0,
                      "radix_cache_evictable_pages": cache.evictable() if cache else 0})
    r.add(Kind.TOTAL, {
        "radix_cache_evicted_pages_total": cache.evicted_pages if cache else 0,
        "radix_cache_inserted_pages_total": cache.inserted_pages if cache else 0})
