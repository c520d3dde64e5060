"""The engine's numbers do not depend on the size of its thread team.

The busy-neighbour adaptation (pdcore/runtime/cpu_team.py) changes the team between steps with
torch.set_num_threads. That is only safe for greedy serving if no kernel splits a reduction
across threads: otherwise a resize in the middle of a request would change its summation order,
its logits and, on a near-tie, its text. This runs the default model (SmolLM2, float32, the
native kernels of this host's ISA; tests/engine/test_native_isa.py runs it again on the AVX2
path) with prompts of several lengths, one prefill chunk and many decode steps each, at 2
threads and at 1, and asks for every prompt and output logprob to be bit-equal.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path) -> Iterator[LLMEngine]:
    eng = LLMEngine(ServerArgs(model_path=str(smollm2_gguf), max_total_tokens=4096,
                               dtype="float32", log_level="warning"))
    try:
        yield eng
    finally:
        eng.close()


def _run(eng: LLMEngine, threads: int, prompts: list[list[int]]) -> list[dict]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        return eng.generate(prompts, sp, return_logprob=True, logprob_start_len=0)
    finally:
        torch.set_num_threads(before)


def test_logprobs_are_bit_equal_at_one_and_two_threads(engine: LLMEngine) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (37, 300, 129)]
    two = _run(engine, 2, prompts)
    one = _run(engine, 1, prompts)
    for i, (a, b) in enumerate(zip(two, one)):
        assert not a["error"] and len(a["output_ids"]) == 24
        assert a["output_ids"] == b["output_ids"], f"prompt {i}: the text changed with the team"
        assert len(a["input_logprobs"]) >= len(prompts[i]) - 1
        for what in ("input_logprobs", "output_logprobs"):
            diff = [k for k, (x, y) in enumerate(zip(a[what], b[what])) if x[0] != y[0]]
            assert not diff, f"prompt {i}: {what} differ at positions {diff[:5]}"
