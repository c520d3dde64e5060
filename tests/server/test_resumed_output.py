"""A migrated request's output (docs/migration.md), without servers: an assembler that starts
from the ids an earlier leg streamed (`OutputAssembler.resume`) ends as the undisturbed one,
stop strings across the join included; and a sampler state that observed them draws as the
undisturbed request would (penalties, min_new_tokens, the seed's stream)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdcore.engine.model.tokenizer import default_model_file, load_tokenizer
from pdcore.engine.sched.sampler import SampleState, uniforms
from pdcore.messages.io import SamplingParams, TokenOut

TEXT = "Once upon a time, the café served crème brûlée; the end came at last. More after."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(SimpleNamespace(model_path=default_model_file()))


def _run(tok, prompt: list[int], ids: list[int], sampling: SamplingParams, resumed: int = 0
         ) -> tuple[str, dict | None, list[int], list[str]]:
    from pdcore.server.output import OutputAssembler

    asm = OutputAssembler(tok, "r", prompt, sampling)
    asm.resume(ids[:resumed])
    shown = [asm.visible_text()[:asm.resumed_visible]]
    for k, t in enumerate(ids[resumed:], start=resumed):
        last = k == len(ids) - 1
        done = asm.feed(TokenOut("r", [t], prompt_tokens=len(prompt) + resumed, finished=last,
                                 finish_reason={"type": "length"} if last else None))
        shown.append(asm.out.text if done else asm.visible_text())
        if done:
            break
    assert asm.out.prompt_tokens == len(prompt)
    return asm.out.text, asm.out.finish_reason, asm.out.output_ids, shown


@pytest.mark.parametrize("stop", [[], ["the end"], ["brûlée"]])
def test_resumed_assembler_ends_as_the_undisturbed_one(tok, stop: list[str]) -> None:
    prompt = tok.encode("Tell me a story.")
    ids = tok.encode(TEXT)
    sampling = SamplingParams(max_new_tokens=len(ids), stop=stop)
    text, reason, out, shown = _run(tok, prompt, ids, sampling)
    for k in range(1, len(ids)):
        got = _run(tok, prompt, ids, sampling, resumed=k)
        if len(got[2]) > len(out) or (reason or {}).get("type") == "stop" and k >= len(out):
            continue  # the undisturbed run stopped before token k: nothing to resume
        assert got[:3] == (text, reason, out), k
        # what the resumed leg's client had already seen is what the undisturbed run showed
        assert shown[k] == got[3][0], k


def test_resumed_sampler_state_draws_as_the_undisturbed_one() -> None:
    params = SamplingParams(temperature=0.8, seed=99, frequency_penalty=0.5, min_new_tokens=4)
    prompt, out = [1, 2, 3], [7, 8, 7]
    whole = SampleState.create(params, prompt, (0,))
    for t in out:
        uniforms([whole])  # one draw per sampled token
        whole.observe(t)
    resumed = SampleState.create(params, prompt + out, (0,), resumed=len(out),
                                 seed_skip=len(out))
    assert (resumed.generated, resumed.counts, resumed.banned) == \
        (whole.generated, whole.counts, whole.banned)
    assert torch.equal(uniforms([resumed]), uniforms([whole]))
