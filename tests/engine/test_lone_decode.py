"""#48: a lone decoding sequence (batch 1, the commonest interactive step) takes the native
layer loop (llama.py fast_layers; engine/native/decode_step.cpp) as a decode group of one,
through the decode K/V view (fill, then append) or, without one, reading a float32 pool in
place. Before, ForwardBatch.decode_group left a lone decode to the Python loop, op by op, its
attention per sequence (`_old_rule` below restores that rule). Every attention path sums keys
in one order (native/attn_block.h), so where the old path took a native attention kernel
(float32, W8A8 and packed GGUF: the paged kernel) the new one gives its logits and pool to the
bit, step after step, a context past two attention parts included. A bf16 model or an FP8 pool
used to attend alone through SDPA: there the loop equals the Python loop of the new rule to
the bit (a lone decode now attends as a batched one does) and the old path closely.

test_native_isa.py runs this file again for each other ISA the CPU has (AVX2 forced)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pdcore.engine import native
from pdcore.engine.model.batch import ForwardBatch, SeqSpan
from test_native import _llama, _ops

PAGES, PAGE = 80, 8  # 640 slots: a context past two attention parts (attention.h: 256 keys)


@contextlib.contextmanager
def _old_rule():
    """decode_group as it was: None for fewer than two decoding sequences."""
    real = ForwardBatch.decode_group

    def old(self: ForwardBatch):
        g = real(self)
        return g if g is not None and len(g.seqs) >= 2 else None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ForwardBatch, "decode_group", old)
        yield


def _pool(model, dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    a = model.layers[0].self_attn
    g = torch.Generator().manual_seed(seed)
    shape = (PAGES, PAGE, a.num_kv_heads, a.head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in model.layers]


def _lone_steps(model, kv, ctx: int, steps: int, *, old: bool = False, python: bool = False
                ) -> tuple[list[torch.Tensor], list[str], int]:
    """One sequence of `ctx` cached tokens decoding `steps` steps: each step's logits, the view's
    mode and the native loop's step count. old: the rule before #48 (the Python loop, attention
    per sequence); python: the new rule through the Python loop."""
    perm = torch.randperm(PAGES * PAGE, generator=torch.Generator().manual_seed(5)).tolist()
    table = perm[:ctx]
    ids = torch.randint(3, model.cfg.vocab_size, (steps,),
                        generator=torch.Generator().manual_seed(6))
    plan, before = model.native, model.native_steps
    if old or python:
        model.native = None
    model.decode_kv.valid = False  # another run's view is not this one's
    logits, modes = [], []
    try:
        with _old_rule() if old else contextlib.nullcontext():
            for step in range(steps):
                table.append(perm[ctx + step])
                batch = ForwardBatch(ids[step : step + 1], torch.tensor([len(table) - 1]),
                                     torch.tensor([table[-1]]),
                                     [SeqSpan(0, 1, torch.tensor(table), key="r")],
                                     torch.arange(1))
                logits.append(model(batch, kv))
                modes.append(model.decode_kv.mode)
    finally:
        model.native = plan
    return logits, modes, model.native_steps - before


def _equal_runs(model, pool_dtype: torch.dtype, ctx: int, steps: int = 4) -> list[str]:
    """The new rule (native loop) against the old path: logits and pools equal to the bit."""
    kv, kv_old = _pool(model, pool_dtype, 1), _pool(model, pool_dtype, 1)
    want, _, old_native = _lone_steps(model, kv_old, ctx, steps, old=True)
    got, modes, runs = _lone_steps(model, kv, ctx, steps)
    assert old_native == 0 and runs == steps, (old_native, runs)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (step, (a - b).abs().max().item())
    for (k1, v1), (k2, v2) in zip(kv, kv_old):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    return modes


@pytest.mark.parametrize("ctx", [37, 600])
@pytest.mark.parametrize("view", [True, False])
def test_float32_lone_decode_equals_the_old_path(view: bool, ctx: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """view False (`prefer_pool`, as a packed GGUF model has it since s11): the loop reads the
    pool in place (mode 2), as the old path's paged kernel did; view True (the default): through
    the decode K/V view. ctx 600: past two parts of 256 keys (split attention)."""
    _ops()
    model = _llama(torch.float32, monkeypatch)
    assert model.native is not None, native.status()
    model.decode_kv.prefer_pool = not view
    modes = _equal_runs(model, torch.float32, ctx)
    assert modes == (["fill"] + ["append"] * 3 if view else [""] * 4)


@pytest.mark.parametrize("dtype,pool", [(torch.bfloat16, torch.bfloat16),
                                        (torch.float32, torch.float8_e4m3fn)])
def test_a_lone_decode_attends_as_a_batched_one(dtype: torch.dtype, pool: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model, an FP8 pool (scale 1): the native loop equals the new rule's Python loop
    to the bit (float32 attention over the view's de-quantized copies, as a decode group
    has); the old path (SDPA in the model's dtype over the gathered context) closely."""
    _ops()
    model = _llama(dtype, monkeypatch)
    kv, kv_py, kv_old = (_pool(model, pool, 1) for _ in range(3))
    got, modes, runs = _lone_steps(model, kv, 37, 3)
    py, _, _ = _lone_steps(model, kv_py, 37, 3, python=True)
    old, _, _ = _lone_steps(model, kv_old, 37, 3, old=True)
    # a bf16 model's bf16 pool is read in place (no float32 view: decode_view.bf16_pool, s13)
    assert runs == 3 and modes == (["fill", "append", "append"] if pool != torch.bfloat16
                                   else [""] * 3)
    # bf16: the old path rounded q.k, softmax and P.V to bf16 (8 bits): within 4 ulps of the
    # largest logit (seen: 3); FP8 pool (float32 model): float32 summation orders (seen: 1e-5)
    rel = 2**-5 if dtype == torch.bfloat16 else 1e-5
    for a, b, c in zip(got, py, old):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=0, atol=rel * c.abs().max().item())


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's head size and grouping, so the native attention
    kernels serve (the shared tiny Llama's head_dim of 16 takes SDPA)."""
    from pdserve_testing import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("lone_f32"), hidden_size=384,
                            intermediate_size=512, num_attention_heads=6,
                            num_key_value_heads=2, vocab_size=2048)


@pytest.fixture(scope="module")
def w8a8_model(head64_dir, tmp_path_factory):
    """Its W8A8 checkpoint, loaded (the checkpoint's float lm_head)."""
    from pdcore.engine.model.loader import load_model
    from pdcore.testing.quant_models import make_w8a8_model

    path = make_w8a8_model(str(head64_dir), str(tmp_path_factory.mktemp("lone_w8a8") / "m"))
    mp = pytest.MonkeyPatch()
    mp.setenv("PDCORE_W8A8_LM_HEAD", "float")
    try:
        model, _, _ = load_model(path, torch.float32, torch.device("cpu"))
    finally:
        mp.undo()
    return model


@pytest.mark.parametrize("ctx", [37, 600])
def test_w8a8_lone_decode_equals_the_old_path(w8a8_model, ctx: int) -> None:
    _ops()
    if w8a8_model.native is None:
        pytest.skip(f"the int8 GEMM does not serve the native loop here ({native.status()})")
    assert _equal_runs(w8a8_model, torch.float32, ctx) == ["fill"] + ["append"] * 3


def test_packed_gguf_lone_decode_equals_the_old_path() -> None:
    """The default model served packed with the integer dot (int8 activations: a last-bit
    difference in attention would show as a whole rounding step)."""
    from pdcore.engine.model.loader import load_model
    from test_gguf_packed import packed_with

    _ops()
    with packed_with("int8"):
        model, _, _ = load_model(None, torch.float32, torch.device("cpu"))
        assert model.lm_head_packed.dtype == torch.uint8 and model.native is not None
        # served packed, its float32 pool is read in place (the loader's prefer_pool): no view
        assert model.decode_kv.prefer_pool
        assert _equal_runs(model, torch.float32, 300, steps=3) == [""] * 3


def test_a_seeded_lone_request_keeps_its_text(head64_dir) -> None:
    """A sampled request alone (seeded): the same tokens and logprobs under the old rule and the
    new, and its decode steps ran the native loop only under the new."""
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    _ops()
    sp = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                        ignore_eos=True)
    eng = LLMEngine(ServerArgs(model_path=str(head64_dir), max_total_tokens=1024,
                               page_size=4, disable_radix_cache=True))
    try:
        model = eng.engine.model
        if model.native is None:
            pytest.skip(f"no native decode loop here ({native.status()})")
        runs = []
        for old in (True, False):
            before = model.native_steps
            with _old_rule() if old else contextlib.nullcontext():
                o = eng.generate([[1, 17, 42, 99, 7, 300, 5]], sp, return_logprob=True)[0]
            runs.append((o["output_ids"], [lp for lp, *_ in o["output_logprobs"]],
                         model.native_steps - before))
    finally:
        eng.close()
    (ids_old, lp_old, n_old), (ids_new, lp_new, n_new) = runs
    assert n_old == 0 and n_new == 11, (n_old, n_new)
    assert ids_new == ids_old and lp_new == lp_old


def test_a_bf16_models_rows_equal_alone_batched_and_teacher_forced(head64_dir, monkeypatch
                                                                   ) -> None:
    """#47 (s13): a bf16 model over its bf16 pool attends in one order in every phase (the
    bf16 pair dots of native/bf16_attn.h where the CPU has vdpbf16ps, else the widening one),
    its decode rows read in place (never through the float32 view). A request's greedy tokens
    and logprobs have the same bits alone and in a batch (decode groups, steps mixed with other
    prompts' 64-token chunks; one context past two attention parts), and teacher-forced: its
    own tokens fed back as a prompt, prefill rows where decode steps computed them."""
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine
    from test_native import _bf16_model

    from pdcore.env import Env

    _ops()
    _bf16_model(torch.bfloat16)
    if not native.bf16_gemm():  # oneDNN's bf16 GEMMs: a row's bits depend on the row count
        pytest.skip(f"no bf16 panel GEMM here ({native.status()})")
    monkeypatch.setenv(Env.pdcore_gemm_layout.name, "panels")  # not a load-time timing's pick
    # the native prefill kernel: on an AMX host `auto` attends bf16 chunks through SDPA, whose
    # prefill rows are not the decode kernel's bits (engine/model/prefill_route.py)
    monkeypatch.setenv(Env.pdcore_prefill_attention.name, "native")
    new = 10
    sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (650, 9, 70)]
    eng = LLMEngine(ServerArgs(model_path=str(head64_dir), dtype="bfloat16",
                               max_total_tokens=4096, page_size=4, chunked_prefill_size=64,
                               disable_radix_cache=True))
    try:
        model, blocks = eng.engine.model, eng.scheduler.blocks
        if model.native is None:
            pytest.skip(f"no native decode loop here ({native.status()})")
        before = model.native_steps
        batched = eng.generate(prompts, sp, return_logprob=True)
        assert model.native_steps - before >= new - 1  # decoded in the native loop
        assert not model.decode_kv.valid  # never viewed
        alone = {i: eng.generate([prompts[i]], sp, return_logprob=True)[0] for i in (0, 1)}
        cuts = [(i, k) for i in (0, 2) for k in (1, new // 2, new - 1)]
        forced = eng.generate([prompts[i] + batched[i]["output_ids"][:k] for i, k in cuts],
                              one, return_logprob=True)
        assert blocks.num_free == blocks.num_pages
    finally:
        eng.close()

    def lps(o: dict) -> list[float]:
        return [lp[0] for lp in o["output_logprobs"]]

    for i, o in alone.items():
        assert o["output_ids"] == batched[i]["output_ids"], i
        assert lps(o) == lps(batched[i]), i
    for (i, k), o in zip(cuts, forced):
        assert o["output_ids"] == batched[i]["output_ids"][k : k + 1], (i, k)
        assert lps(o) == lps(batched[i])[k : k + 1], (i, k)
