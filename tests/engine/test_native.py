"""The native kernels (pdcore/engine/native): rope, silu and the attention routing against
their aten formulas (the panel GEMMs: test_native_panels.py; attention: test_native_attention.py),
the native decode loop equal to the Python loop to the bit, and the engine
running without them (switched off, or no compiler) with the reason reported.

This process runs the library of the best ISA this CPU has (or PDCORE_NATIVE_ISA's);
test_native_isa.py runs the file again in a child for each other ISA the CPU has. Tests
of a bf16 model skip where the CPU has no bf16 hardware (the product refuses --dtype bfloat16
there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdcore.engine import native
from pdcore.engine.cpu_features import LAYOUT_ENV, bf16_support
from pdcore.engine.model import layers
from pdcore.engine.model.batch import ForwardBatch, SeqSpan
from pdcore.engine.model.llama import LlamaForCausalLM
from pdcore.errors import ConfigError
from pdserve_testing import random_llama


def _ops():
    o = native.ops()
    if o is None:
        # CI (scripts/test.sh) requires them where this CPU has an ISA for them: a build that
        # failed or timed out on a loaded machine must fail these tests, not skip them all
        if os.environ.get("PDSERVE_TEST_REQUIRE_NATIVE") == "1" and native.choose_isa()[0]:
            pytest.fail(f"native kernels failed to build or load: {native.status()}")
        pytest.skip(f"native kernels unavailable here: {native.status()}")
    return o


def _panels():
    o = _ops()
    if not native.panel_gemm():
        pytest.skip(f"the panel GEMM does not serve here ({native.status()})")
    return o


def _bf16_model(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not bf16_support()[0]:
        pytest.skip(f"no bf16 hardware ({bf16_support()[1]}): --dtype bfloat16 is refused here")


def _panels_serve(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` take the panel layout in this process's library."""
    return native.panel_gemm() if dtype == torch.float32 else native.bf16_gemm()


def test_the_chosen_isa_serves() -> None:
    """PDCORE_NATIVE_ISA (set: that ISA; unset: the best the CPU has) is what status() says."""
    _ops()
    want = os.environ.get(native.ISA_ENV) or next(i for i in native.ISAS if native._cpu_has(i))
    assert native.isa() == want and native.status() == f"native ({want})"
    assert native.ops().isa() == want  # the library's own word


def test_prefill_takes_the_native_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt prefilled in two chunks (the second after its prefix), through the model: the
    native causal kernel serves every chunk (the model counts them for /metrics) and the
    logits match the SDPA path's."""
    from pdcore.engine.model import llama

    _panels()
    model = _llama(torch.float32, monkeypatch)
    kvh, d, pages, page = 2, 64, 64, 16
    perm = torch.randperm(pages * page, generator=torch.Generator().manual_seed(3))
    prompt = torch.randint(3, 400, (300,), generator=torch.Generator().manual_seed(4))
    slots = perm[:300]

    def run() -> list[torch.Tensor]:
        kv = [(torch.zeros(pages, page, kvh, d), torch.zeros(pages, page, kvh, d))
              for _ in model.layers]
        outs = []
        for a, b in ((0, 173), (173, 300)):  # a first chunk, then one after its prefix
            batch = ForwardBatch(prompt[a:b], torch.arange(a, b), slots[a:b],
                                 [SeqSpan(0, b - a, slots[:b])], torch.arange(b - a))
            outs.append(model(batch, kv))
        return outs

    before = model.native_prefill_chunks
    got = run()
    assert model.native_prefill_chunks - before == 2
    real = llama._native_op
    monkeypatch.setattr(llama, "_native_op",
                        lambda name: None if name == "prefill_attention_paged" else real(name))
    want = run()
    assert model.native_prefill_chunks - before == 2  # the SDPA path counts nothing
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_decode_attention_falls_back_to_sdpa_where_it_does_not_apply() -> None:
    o = _ops()
    g = torch.Generator().manual_seed(5)
    for q, k in (((2, 2, 3, 16), (2, 2, 9, 16)),  # head_dim 16: no kernel
                 ((2, 1, 9, 64), (2, 1, 9, 64))):  # 9 query heads per KV head
        qt, kt, vt = torch.randn(*q, generator=g), torch.randn(*k, generator=g), \
            torch.randn(*k, generator=g)
        want = F.scaled_dot_product_attention(qt, kt, vt, scale=0.3)
        assert torch.equal(o.decode_attention(qt, kt, vt, None, 0.3), want)


@pytest.mark.parametrize("dtype,pool", [(torch.float32, torch.float32),
                                        (torch.bfloat16, torch.bfloat16),
                                        (torch.float16, torch.float16),
                                        (torch.float32, torch.bfloat16),  # the aten fallback
                                        (torch.float32, torch.float8_e4m3fn),  # FP8 KV (#48)
                                        (torch.bfloat16, torch.float8_e5m2)])
def test_rope_store_equals_the_aten_formula(dtype: torch.dtype, pool: torch.dtype) -> None:
    """rotary over q and k (x cos + rotate_half(x) sin, each operator rounding to the dtype)
    and the pool store at the slots, fused: equal to the bit to the Python code's operators."""
    o = _ops()
    g = torch.Generator().manual_seed(3)
    T, H, KVH, D = 37, 6, 2, 64
    qkv = (torch.randn(T, (H + 2 * KVH) * D + 8, generator=g) * 3).to(dtype)[:, 8:]  # strided
    ang = torch.randn(T, 1, D, generator=g) * 4
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    kp, vp = torch.zeros(12, 8, KVH, D, dtype=pool), torch.zeros(12, 8, KVH, D, dtype=pool)
    slots = torch.randperm(96, generator=g)[:T]
    qk = o.rope_store(qkv, cos, sin, kp, vp, slots, H, KVH, D)
    x = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
    a, b = x.chunk(2, dim=-1)
    want = x * cos + torch.cat((-b, a), dim=-1) * sin
    assert qk.dtype == dtype and torch.equal(qk, want)
    kf, vf = kp.view(-1, KVH, D), vp.view(-1, KVH, D)
    assert torch.equal(kf[slots], want[:, H:].to(pool))
    assert torch.equal(vf[slots], qkv[:, (H + KVH) * D :].reshape(T, KVH, D).to(pool))
    untouched = torch.ones(96, dtype=torch.bool)
    untouched[slots] = False
    assert not kf[untouched].float().any() and not vf[untouched].float().any()


def test_silu_mul_matches_aten() -> None:
    """bf16 silu(gate) * up in one pass: equal to aten's two operators but for rare last-bit
    ties (its exp and reciprocal differ from aten's by float32 ulps); float32 (its kernel, or
    aten's operators where the width is no multiple of 32) and a bf16 width the kernel does not
    take equal to the bit (test_native_elementwise.py: more float32 widths)."""
    o = _panels()
    g = torch.Generator().manual_seed(5)
    gu = (torch.randn(67, 2 * 96 + 4, generator=g) * 4).bfloat16()[:, 4:]  # strided rows
    want = F.silu(gu[:, :96]) * gu[:, 96:]
    got = o.silu_mul(gu, 96)
    assert got.shape == (67, 96) and got.dtype == torch.bfloat16
    assert (got != want).float().mean().item() < 2e-3
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for x, width in ((torch.randn(5, 40, generator=g), 20),
                     (torch.randn(5, 40, generator=g).bfloat16(), 20)):
        assert torch.equal(o.silu_mul(x, width), F.silu(x[:, :width]) * x[:, width:])
    f32 = torch.randn(9, 64, generator=g)
    assert torch.equal(o.silu_mul(f32, 32), F.silu(f32[:, :32]) * f32[:, 32:])


def _llama(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
           layout: str = "panels") -> LlamaForCausalLM:
    """A tiny random Llama with SmolLM2's head size (64) and grouping (3 query heads per KV
    head), so every native kernel applies (`layout`: the GEMMs' weight layout)."""
    _bf16_model(dtype)
    monkeypatch.setenv(layers.PACKED_GEMM_ENV, "1")
    monkeypatch.setenv(LAYOUT_ENV, layout)
    model = random_llama(0.1, vocab_size=500, hidden_size=384, intermediate_size=512,
                         num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                         max_position_embeddings=1024)
    model.to(dtype)
    model.prepare_for_inference()
    return model


@pytest.mark.parametrize("dtype,view", [(torch.float32, True), (torch.bfloat16, True),
                                        (torch.float32, False)])
def test_native_decode_loop_equals_the_python_loop(dtype: torch.dtype, view: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """view False: no decode K/V view (over its budget): both loops read the pool in place
    (the paged kernel; mode 2 of the native loop). A bf16 model's bf16 pool is never viewed
    (decode_view.bf16_pool, s13): read in place either way."""
    _ops()
    model = _llama(dtype, monkeypatch)
    assert model.native is not None, native.status()
    if not view:
        model.decode_kv.budget = 0
    plan = model.native
    g = torch.Generator().manual_seed(7)
    pages, page = 40, 8
    kv = [(torch.randn(pages, page, 2, 64, generator=g).to(dtype),
           torch.randn(pages, page, 2, 64, generator=g).to(dtype)) for _ in range(3)]
    perm = iter(torch.randperm(pages * page, generator=g).tolist())
    tables = [[next(perm) for _ in range(n)] for n in (5, 40, 23, 61)]  # padded: a mask
    keys = ["a", "b", "c", "d"]
    modes, runs = [], 0
    for step in range(6):
        if step == 4:  # one request leaves: the view fills again
            tables.pop(2), keys.pop(2)
        for t in tables:
            t.append(next(perm))
        batch = lambda step=step: ForwardBatch(
            torch.randint(3, 400, (len(tables),), generator=torch.Generator().manual_seed(step)),
            torch.tensor([len(t) - 1 for t in tables]), torch.tensor([t[-1] for t in tables]),
            [SeqSpan(i, 1, torch.tensor(t), key=keys[i]) for i, t in enumerate(tables)],
            torch.arange(len(tables)))
        kv_py = [(k.clone(), v.clone()) for k, v in kv]
        model.native = None
        want = model(batch(), kv_py)
        model.decode_kv.valid = False  # the Python run refilled the view: fill it again
        model.native = plan
        before = model.native_steps
        got = model(batch(), kv)
        modes.append(model.decode_kv.mode)
        runs += model.native_steps - before
        assert torch.equal(got, want), step  # the same operators in the same order
        for (k1, v1), (k2, v2) in zip(kv, kv_py):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)  # the pool written alike
    viewed = view and dtype != torch.bfloat16
    assert runs == 6 and set(modes) == ({"fill"} if viewed else {""})


@pytest.mark.parametrize("layout", ["panels", "onednn"])
@pytest.mark.parametrize("dtype,pool", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                        (torch.float32, torch.float8_e4m3fn)])
def test_native_append_equals_the_python_loop(dtype: torch.dtype, pool: torch.dtype | None,
                                              layout: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady decoding (append mode: the fused rotary + K/V store) in the native loop against
    the Python loop of an identical model, each with its own view and pool: equal to the bit,
    logits, pool and view, step after step; with either weight layout. `pool`: an FP8 KV pool
    (--kv-cache-dtype fp8_e4m3, scale 1: the native loop casts, the Python loop quantizes), or
    a bf16 model's float32 pool (its bf16 pool is never viewed: decode_view.bf16_pool)."""
    _ops()
    nat, py = _llama(dtype, monkeypatch, layout), _llama(dtype, monkeypatch, layout)
    n = 1 + 4 * len(nat.layers)  # lm_head, qkv, o, gate_up, down
    panels = layout == "panels" and _panels_serve(dtype)  # else oneDNN's, whatever was asked
    assert layers.weight_layouts(nat) == {"panels": n * panels, "onednn": n * (not panels),
                                          "plain": 0, "int8": 0, "fp8": 0, "gguf": 0}
    py.native = None
    g = torch.Generator().manual_seed(11)
    kv = [(torch.randn(40, 8, 2, 64, generator=g).to(pool or dtype),
           torch.randn(40, 8, 2, 64, generator=g).to(pool or dtype)) for _ in range(3)]
    kv_py = [(k.clone(), v.clone()) for k, v in kv]
    perm = iter(torch.randperm(320, generator=g).tolist())
    tables = [[next(perm) for _ in range(n)] for n in (4, 37, 19)]  # padded: a mask
    modes = []
    for step in range(6):
        for t in tables:
            t.append(next(perm))
        ids = torch.randint(3, 400, (3,), generator=torch.Generator().manual_seed(step))

        def batch(ids: torch.Tensor = ids) -> ForwardBatch:
            return ForwardBatch(ids, torch.tensor([len(t) - 1 for t in tables]),
                                torch.tensor([t[-1] for t in tables]),
                                [SeqSpan(i, 1, torch.tensor(t), key=i)
                                 for i, t in enumerate(tables)], torch.arange(3))
        got, want = nat(batch(), kv), py(batch(), kv_py)
        modes.append((nat.decode_kv.mode, py.decode_kv.mode))
        assert torch.equal(got, want), step
        for (k1, v1), (k2, v2) in zip(kv, kv_py):
            assert torch.equal(k1, k2) and torch.equal(v1, v2), step
        for a, b in zip(nat.decode_kv.k + nat.decode_kv.v, py.decode_kv.k + py.decode_kv.v):
            assert torch.equal(a, b), step
    assert modes == [("fill", "fill")] + [("append", "append")] * 5
    assert nat.native_steps == 6 and py.native_steps == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_is_chosen_by_the_weighted_cost(dtype: torch.dtype,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: each weight shape is timed in both layouts (decode rows weighted DECODE_WEIGHT to
    one prefill chunk; an lm_head at decode rows only) and the cheaper layout replaces it; the
    choice is made once per shape. Timings are stood in for, so the rule is what is tested."""
    _panels()
    if dtype == torch.bfloat16 and not native.bf16_gemm():
        pytest.skip("no AVX-512 BF16: bf16 weights only take oneDNN's layout here")
    monkeypatch.setenv(layers.PACKED_GEMM_ENV, "1")
    monkeypatch.setenv(LAYOUT_ENV, "auto")
    monkeypatch.setattr(layers, "_layout_choice", {})
    w = torch.randn(64, 32).to(dtype)
    real = layers.layout_cost(w, layers._panel_packer(w)(w), layers._onednn(w), 8)
    assert set(real) == {"panels", "onednn"}  # both layouts ran, every rep
    assert all(len(v) == layers.LAYOUT_REPS and min(v) > 0 for v in real.values())
    # panels: 1 ms per call at decode rows, 30 at prefill rows; oneDNN: 2 and 8
    cost = {layers.DECODE_ROWS: {"panels": 1.0, "onednn": 2.0},
            layers.PREFILL_ROWS: {"panels": 30.0, "onednn": 8.0}}
    timed = []

    def fake_cost(weight, panels, onednn, rows):
        assert panels.layout == torch.strided and onednn.layout != torch.strided
        timed.append(rows)
        return {name: [ms] * layers.LAYOUT_REPS for name, ms in cost[rows].items()}

    monkeypatch.setattr(layers, "layout_cost", fake_cost)
    # 16 x 1 + 30 = 46 against 16 x 2 + 8 = 40 (13% less): oneDNN
    assert layers.pack_weight(w).layout != torch.strided
    # the lm_head (decode rows only): 16 against 32: panels
    assert layers.pack_weight(w, prefill=False).layout == torch.strided
    assert timed == [8, 256, 8]
    layers.pack_weight(w)  # chosen once per shape: not timed again
    assert timed == [8, 256, 8] and len(layers._layout_choice) == 2
    # a near tie is load noise, not a win: 46 against 16 x 2 + 10 = 42 (9% less) keeps panels
    cost[layers.PREFILL_ROWS]["onednn"] = 10.0
    w2 = torch.randn(96, 32).to(dtype)
    assert layers.pack_weight(w2).layout == torch.strided
    monkeypatch.setenv(LAYOUT_ENV, "fastest")
    with pytest.raises(ConfigError, match="PDCORE_GEMM_LAYOUT must be one of auto, panels, "
                                          "onednn; got 'fastest'"):
        layers.pack_weight(w)


def test_native_decode_loop_appends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady decoding (append mode) through the native loop gives the logits of a model that
    gathers every step."""
    _ops()
    model = _llama(torch.float32, monkeypatch)
    ref = _llama(torch.float32, monkeypatch)
    ref.decode_kv.budget = 0  # no view: gathers from the pool
    g = torch.Generator().manual_seed(9)
    kv = [(torch.randn(30, 8, 2, 64, generator=g), torch.randn(30, 8, 2, 64, generator=g))
          for _ in range(3)]
    kv_ref = [(k.clone(), v.clone()) for k, v in kv]
    perm = iter(torch.randperm(240, generator=g).tolist())
    tables = [[next(perm) for _ in range(n)] for n in (3, 30, 12)]
    modes = []
    for step in range(5):
        for t in tables:
            t.append(next(perm))

        def batch(keyed: bool, step: int = step) -> ForwardBatch:
            return ForwardBatch(
                torch.tensor([5 + step, 9, 300]), torch.tensor([len(t) - 1 for t in tables]),
                torch.tensor([t[-1] for t in tables]),
                [SeqSpan(i, 1, torch.tensor(t), key=i if keyed else None)
                 for i, t in enumerate(tables)], torch.arange(3))
        got = model(batch(True), kv)
        modes.append(model.decode_kv.mode)
        torch.testing.assert_close(got, ref(batch(False), kv_ref), rtol=1e-5, atol=1e-5)
    assert modes == ["fill"] + ["append"] * 4 and model.native_steps == 5


CHILD = r"""
import json, torch
from pdcore.engine import native
from pdcore.engine.model import layers
w = torch.nn.Parameter(torch.randn(40, 16), requires_grad=False)
keep, packed = layers.pack_in_place(w)
x = torch.randn(3, 16)
ok = torch.allclose(layers.linear(x, keep, None, packed), torch.nn.functional.linear(x, w),
                    atol=1e-5)
print(json.dumps({"status": native.status(), "ops": native.ops() is not None, "ok": ok,
                  "layout": str(packed.layout) if packed is not None else None}))
"""


def _child(**env: str) -> dict:
    e = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", CHILD], env=e, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_switched_off_runs_without_native() -> None:
    r = _child(PDCORE_NATIVE="0")
    assert r == {"status": "off (PDCORE_NATIVE=0)", "ops": False, "ok": True,
                 "layout": "torch._mkldnn"}, r


def test_no_compiler_is_reported_and_the_engine_still_computes(tmp_path) -> None:
    r = _child(CXX=str(tmp_path / "no-such-g++"), PDSERVE_NATIVE_DIR=str(tmp_path / "cache"),
               PDCORE_NATIVE="1")
    assert r["ops"] is False and r["ok"] is True and r["layout"] == "torch._mkldnn", r
    assert r["status"].startswith("off (no C++ compiler") and "no-such-g++" in r["status"], r
    assert not any((tmp_path / "cache").glob("*.so"))


def test_a_bad_layout_setting_is_refused_at_the_command_line() -> None:
    r = subprocess.run([sys.executable, "-m", "pdcore", "serve", "--load-format", "dummy"],
                       capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, LAYOUT_ENV: "fastest"})
    assert r.returncode == 2, r.stderr
    assert "PDCORE_GEMM_LAYOUT must be one of auto, panels, onednn; got 'fastest'" in r.stderr

