"""One sampling-params type (#34 item 2): `SamplingParams` (messages/io.py) declares the
fields and their defaults once; the wire schemas declare only JSON types of the same names and
`params.build_sampling` checks the ranges once, at the edge."""

from __future__ import annotations

import dataclasses

import pytest

from pdcore.messages.io import SamplingParams
from pdcore.errors import InvalidRequestError
from pdcore.server.params import SAMPLING_FIELDS, build_sampling
from pdcore.edge.schemas import ChatCompletionRequest, CompletionRequest, SamplingParamsIn

# OpenAI's names for two engine fields; grammar comes from response_format / json_schema / ...
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def test_wire_schemas_name_every_field_and_declare_no_default() -> None:
    native = SamplingParamsIn.model_fields
    for name in SAMPLING_FIELDS - {"grammar"}:
        assert name in native, f"sampling_params lacks {name}"
        assert native[name].default is None, f"sampling_params.{name} restates a default"
        for model in (CompletionRequest, ChatCompletionRequest):
            wire = OPENAI_NAMES.get(name, name)
            assert wire in model.model_fields, f"{model.__name__} lacks {wire}"
            if name != "max_new_tokens":  # max_tokens' default is OpenAI's per route (16 / none)
                assert model.model_fields[wire].default is None, f"{model.__name__}.{wire}"


def test_absent_fields_take_the_engine_defaults() -> None:
    s = build_sampling({})
    want = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        assert getattr(s, f.name) == getattr(want, f.name), f.name
    # None is "use the default", as clients serialise unset options
    assert build_sampling({"temperature": None, "stop": None}).temperature == want.temperature


def test_wire_forms_are_normalised() -> None:
    s = build_sampling({"stop": "END", "logit_bias": {"7": 3}, "temperature": 0})
    assert s.stop == ["END"] and s.logit_bias == {7: 3.0}
    assert isinstance(s.temperature, float) and s.greedy


@pytest.mark.parametrize("given,field", [
    ({"temperature": -1.0}, "p.temperature"), ({"top_p": 0.0}, "p.top_p"),
    ({"top_k": 0}, "p.top_k"), ({"min_p": 2.0}, "p.min_p"),
    ({"repetition_penalty": 0.0}, "p.repetition_penalty"),
    ({"presence_penalty": 3.0}, "p.presence_penalty"), ({"stop": ["a", ""]}, "p.stop"),
    ({"stop_token_ids": [-1]}, "p.stop_token_ids"), ({"min_new_tokens": -2}, "p.min_tokens"),
    ({"logit_bias": {"x": 1.0}}, "p.logit_bias"), ({"temperature": float("nan")}, "p.temperature"),
])
def test_out_of_range_names_the_wire_field(given: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        build_sampling(given, "p.", names={"min_new_tokens": "min_tokens"})
    assert e.value.field == field


def test_unknown_field_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="not sampling fields"):
        build_sampling({"n": 2})


# ---- --sampling-defaults (#45 item 5) ---------------------------------------------------------
def test_sampling_defaults_model_reads_generation_config(tmp_path) -> None:
    import json

    from pdcore.engine.model.source import ResolvedModel, resolve_model, sampling_defaults

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0,
        "repetition_penalty": 1.05, "max_new_tokens": 99, "eos_token_id": 2}))
    folder = resolve_model(str(tmp_path))
    assert sampling_defaults(folder, "model") == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
        "repetition_penalty": 1.05}
    assert sampling_defaults(folder, "openai") == {}
    (tmp_path / "generation_config.json").write_text('{"top_k": 0, "temperature": "hot"}')
    assert sampling_defaults(folder, "model") == {"top_k": -1}  # transformers' "off" is 0
    (tmp_path / "generation_config.json").unlink()
    assert sampling_defaults(folder, "model") == {}
    # the default model's GGUF carries none: its model card's values; a converted copy of it too
    default = ResolvedModel("/x", "SmolLM2-135M-Instruct.Q4_1.gguf", "smol")
    assert sampling_defaults(default, "model") == {"temperature": 0.2, "top_p": 0.9}
    copy = ResolvedModel(str(tmp_path), None, "smol", source="/y/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert sampling_defaults(copy, "model") == {"temperature": 0.2, "top_p": 0.9}
    assert sampling_defaults(default, "openai") == {}


def test_sampling_defaults_flag_takes_sglangs_choices() -> None:
    from pdcore.server.startup.args_parser import parse_server_args

    assert parse_server_args([]).sampling_defaults == "model"  # SGLang's default
    assert parse_server_args(["--sampling-defaults", "openai"]).sampling_defaults == "openai"
    with pytest.raises(SystemExit) as e:
        parse_server_args(["--sampling-defaults", "vllm"])
    assert e.value.code == 2


# ---- one request planner (#46 item 2) ---------------------------------------------------------
def test_max_new_tokens_is_decided_in_one_function() -> None:
    from pdcore.messages.info import EngineInfo
    from pdcore.server.planner import max_new_tokens

    info = EngineInfo(context_length=100, max_total_tokens=80)
    assert max_new_tokens(None, "max_tokens", 30, info, None, "null") == 50  # the pool's room
    assert max_new_tokens(None, "max_tokens", 30, info, 16, "null") == 16  # the route default
    assert max_new_tokens(500, "max_tokens", 30, EngineInfo(context_length=100), None,
                          "null") == 70
    assert max_new_tokens(0, "max_tokens", 30, info, None, "null") == 0
    assert max_new_tokens(500, "max_tokens", 30, info, None, "prefill") == 1
    with pytest.raises(InvalidRequestError) as e:
        max_new_tokens(-1, "max_output_tokens", 30, info, None, "null")
    assert e.value.field == "max_output_tokens"


# the one place that writes it: tests/test_one_planner.py


# ---- one declaration of the sampling fields (#46 item 2) --------------------------------------
_JSON = {"float": "number", "int": "integer", "bool": "boolean", "int | None": "integer",
         "list[str]": "array", "list[int]": "array", "dict[int, float]": "object"}


def test_the_wire_schemas_take_the_declared_json_types() -> None:
    """The OpenAPI schemas of /generate's sampling_params and the OpenAI bodies accept each
    field in the type SamplingParams declares (and null, for the default)."""
    for model in (SamplingParamsIn, CompletionRequest, ChatCompletionRequest):
        props = model.model_json_schema()["properties"]
        for decl in dataclasses.fields(SamplingParams):
            wire = decl.name if model is SamplingParamsIn else \
                OPENAI_NAMES.get(decl.name, decl.name)
            if decl.name == "grammar" or wire not in props:
                continue
            kinds = {k.get("type") for k in props[wire].get("anyOf", [props[wire]])}
            assert _JSON[str(decl.type)] in kinds and "null" in kinds, (model.__name__, wire)


def test_bounds_and_preferable_fields_come_from_the_declaration() -> None:
    from pdcore.engine.model.source import GENERATION_SAMPLING_KEYS
    from pdcore.server.startup.sglang_flags import PREFERRED_SAMPLING_FIELDS

    for decl in dataclasses.fields(SamplingParams):
        bounds = decl.metadata["bounds"]
        if bounds is not None:  # the default lies in range; one step outside is refused
            assert bounds.holds(decl.default), decl.name
            outside = (bounds.lo if bounds.lo_open else bounds.lo - 1) if bounds.lo is not None \
                else None
            with pytest.raises(InvalidRequestError) as e:
                build_sampling({decl.name: outside}, "p.")
            assert e.value.field == f"p.{decl.name}" and bounds.text() in str(e.value)
    assert set(PREFERRED_SAMPLING_FIELDS) == SAMPLING_FIELDS - {"seed", "logit_bias", "grammar"}
    assert set(GENERATION_SAMPLING_KEYS) <= SAMPLING_FIELDS
