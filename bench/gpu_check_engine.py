"""What bench/gpu_check.py and its PD part (bench/gpu_check_pd.py) share: the tiny models'
sizes, the report, the prompts and one engine run; see gpu_check.py's doc."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 512, 64, 4, 2, 2
NEW = 30  # tokens per greedy request in the engine checks
PD_NEW = 24
SPEC_ENV = {"PDSERVE_SPEC_GATE": "0"}  # verify every draft


def _now() -> float:
    return time.monotonic()


def _tb() -> str:
    return traceback.format_exc()[-6000:]


class Report:
    """The JSON result, rewritten after every section (what a killed run leaves is readable)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"failures": [], "notes": []}

    def fail(self, what: str) -> None:
        print("FAIL:", what, flush=True)
        self.data["failures"].append(what)

    def note(self, what: str) -> None:
        print("NOTE:", what, flush=True)
        self.data["notes"].append(what)

    def dump(self) -> None:
        self.data["ok"] = not self.data["failures"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


# -- models ---------------------------------------------------------------------------------------
def prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(3)
    out = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 45, 7, 90)]
    out.append([11, 12, 13, 14, 15] * 6)  # repetitive: NGRAM drafts from its own context
    return out


# -- engine ---------------------------------------------------------------------------------------
def engine_args(target: str, head: str, algo: str, device: str, dtype: str, page: int,
                chunk: int) -> Any:
    from pdcore.config import ServerArgs

    extra: dict[str, Any] = {}
    if algo == "EAGLE":
        extra = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": head,
                 "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                 "speculative_num_draft_tokens": 4}
    elif algo == "NGRAM":
        extra = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}
    return ServerArgs(model_path=target, device=device, dtype=dtype, max_total_tokens=4096,
                      page_size=page, chunked_prefill_size=chunk, grammar_backend="none",
                      **extra)


def run_engine(args: Any, ps: list[list[int]], batched: bool, sp: Any,
               top: int = 2) -> dict[str, Any]:
    """Outputs of `ps` (batched or one at a time), then of the first two again (the prefix
    cache), the scheduler's stats and the checks that need the engine itself."""
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.pages import pages_at_rest

    t0 = _now()
    eng = LLMEngine(args)
    built = _now() - t0
    try:
        t1 = _now()
        if batched:
            outs = eng.generate(ps, sp, return_logprob=True, top_logprobs_num=top)
        else:
            outs = [eng.generate([p], sp, return_logprob=True, top_logprobs_num=top)[0]
                    for p in ps]
        again = eng.generate(ps[:2], sp, return_logprob=True, top_logprobs_num=top)
        gen_s = _now() - t1
        stats = eng.loop.stats().as_dict()
        spec = eng.loop.spec
        drafter = getattr(spec, "drafter", None) if spec is not None else None
        return {
            "outs": outs + again, "stats": stats, "at_rest": pages_at_rest(eng.scheduler),
            "drafter_failures": getattr(drafter, "failures", None), "build_s": round(built, 2),
            "generate_s": round(gen_s, 2),
            "device": str(eng.engine.kv.layers[0][0].device),
        }
    finally:
        eng.close()
