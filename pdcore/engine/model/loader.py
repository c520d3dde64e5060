"""Load a model's config and weights into our model (whose forward pass reads and writes the
paged KV pool).

Weights come straight from the folder's safetensors files (`weights.py`: mapped, zero-copy; no
transformers model is built). A GGUF file loads through its cached float32 HF conversion
(`gguf_cache.py`); only with that cache off does transformers read the GGUF itself.
`--load-format dummy` draws random weights with transformers' own initialisation.
The config is read directly for the plain Llama families (`hf_config.py`), else by AutoConfig.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pdcore.engine.model import deepseek, llama, mimo, mixtral, qwen_moe
from pdcore.engine.model.gguf_cache import converted
from pdcore.engine.model.gguf_packed import GGUFCheckpoint
from pdcore.engine.model.hf_config import read_plain_config
from pdcore.engine.model import quant_config
from pdcore.engine.model.layers import TPInfo, pack_panels, pack_panels_bf16
from pdcore.engine.model.fp8 import Fp8Checkpoint, fp8_layers
from pdcore.engine.model.modelslim import modelslim_checkpoint
from pdcore.engine.model.quant import Int8Checkpoint, int8_lm_head, lm_head_stand_in
from pdcore.engine.model.tokenizer import ResolvedModel, resolve_model
from pdcore.engine.model.weights import SafetensorsWeights
from pdcore.env import ENV
from pdcore.errors import ConfigError, ModelLoadError
from pdcore.runtime_env import hold_heap, trim_heap

log = logging.getLogger(__name__)

# architecture (config.json "architectures") -> our model class; one module per family
MODEL_CLASSES: dict[str, type] = {
    **dict.fromkeys(llama.SUPPORTED_ARCHS, llama.LlamaForCausalLM),
    **dict.fromkeys(deepseek.SUPPORTED_ARCHS, deepseek.DeepseekForCausalLM),
    **dict.fromkeys(qwen_moe.SUPPORTED_ARCHS, qwen_moe.QwenMoeForCausalLM),
    **dict.fromkeys(mixtral.SUPPORTED_ARCHS, mixtral.MixtralForCausalLM),
    **dict.fromkeys(mimo.SUPPORTED_ARCHS, mimo.MiMoForCausalLM),
}
SUPPORTED_ARCHS = tuple(MODEL_CLASSES)

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"--dtype must be auto or one of {', '.join(DTYPES)}; got {name!r}") from None


def load_config(resolved: ResolvedModel, trust_remote_code: bool = False,
                plain: bool = True) -> Any:
    """The model's config: read directly for the plain Llama families (hf_config.py; `plain`
    False forces AutoConfig, as `--load-format dummy` needs), else by AutoConfig."""
    if plain and not trust_remote_code and resolved.gguf_file is None:
        cfg = read_plain_config(resolved.path, tuple(
            a for a, cls in MODEL_CLASSES.items() if cls is not deepseek.DeepseekForCausalLM))
        if cfg is not None:
            return cfg
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(resolved.path, trust_remote_code=trust_remote_code,
                                         **resolved.hf_kwargs())
    except Exception as e:
        raise ModelLoadError(f"cannot read the model config at {resolved.display_path}: {e}") from e
    arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"architecture {arch} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    if not getattr(cfg, "architectures", None):
        cfg.architectures = [arch]
    return cfg


def _progress_bars_on_a_thread_lock() -> None:
    """tqdm guards its bars with a multiprocessing lock by default. In our spawned engine and
    rank processes that is a named POSIX semaphore (/dev/shm/sem.mp-*) that only the process's
    resource tracker removes, so every SIGKILLed server left one behind. Our bars are never
    shared between processes: a thread lock does."""
    import threading

    try:
        from tqdm import tqdm
    except ImportError:  # transformers without tqdm: no bars, no lock
        return
    tqdm.set_lock(threading.RLock())


def _check_format(resolved: ResolvedModel, load_format: str) -> None:
    is_gguf = resolved.gguf_file is not None or resolved.source is not None
    if load_format == "gguf" and not is_gguf:
        raise ConfigError(f"--load-format gguf: {resolved.display_path} is not a GGUF model")
    if load_format in ("safetensors", "dummy") and is_gguf:
        raise ConfigError(f"--load-format {load_format}: {resolved.display_path} is a GGUF model; "
                          "use --load-format auto or gguf")


def _hf_state_dict(resolved: ResolvedModel, cfg: Any, load_format: str,
                   trust_remote_code: bool) -> Any:
    """Checkpoint tensors by HF name: mapped from the safetensors files; for `dummy`, random ones
    of the config's shapes drawn by transformers' initialisation (no weight file is read); for
    a GGUF file read without the cache, transformers' dequantised model's."""
    if load_format != "dummy" and resolved.gguf_file is None:
        return SafetensorsWeights(resolved.path)
    from transformers import AutoModelForCausalLM

    if load_format == "dummy":
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                trust_remote_code=trust_remote_code).state_dict()
    try:
        return AutoModelForCausalLM.from_pretrained(
            resolved.path, dtype=torch.float32, trust_remote_code=trust_remote_code,
            **resolved.hf_kwargs(),
        ).state_dict()
    except Exception as e:
        raise ModelLoadError(f"cannot load weights from {resolved.display_path}: {e}") from e


def _quantization(resolved: ResolvedModel, cfg: Any, load_format: str) -> str | None:
    """The checkpoint's quantization (quant_config.py; the server checked it against
    --quantization at start-up): ConfigError for a format pdserve does not run; W8A8 int8 only
    for the dense Llama families (their linear layers take int8 weights)."""
    if load_format == "dummy" or resolved.gguf_file is not None:
        return None
    name = quant_config.resolve(None, quant_config.detect(resolved.path, None),
                                resolved.display_path)
    arch = cfg.architectures[0]
    if name in ("w8a8_int8", "modelslim"):
        if not issubclass(MODEL_CLASSES[arch], (llama.LlamaForCausalLM,  # MiMo: a Qwen2 body
                                                deepseek.DeepseekForCausalLM)):
            raise ConfigError(f"{resolved.display_path}: {name} is built for the dense Llama "
                              f"families ({', '.join(llama.SUPPORTED_ARCHS)}) and DeepSeek-V2/V3 "
                              f"(MLA + MoE); {arch} is not yet")
        log.info("quantization %s (%s): the decoder's linear weights%s stay int8 with "
                 "per-output-channel scales, activations are quantized per token at run time, "
                 "int8 x int8 -> int32 GEMMs (engine/native's, else torch._int_mm)", name,
                 quant_config.detect(resolved.path, None).detail if name == "modelslim"
                 else "compressed-tensors W8A8 int8",
                 " and MoE experts" if issubclass(MODEL_CLASSES[arch],
                                                  deepseek.DeepseekForCausalLM) else "")
    return name


def _check_modelslim_offsets(sd: Any, resolved: ResolvedModel) -> None:
    """msModelSlim W8A8_DYNAMIC weights carry `weight_offset` per channel; the int8 path is
    symmetric, so every offset must be zero (msModelSlim writes zeros for symmetric weights)."""
    for name in sd:
        if name.endswith(".weight_offset") and bool(sd[name].float().abs().max() > 0):
            raise ConfigError(f"{resolved.display_path}: {name} is not zero; pdserve runs "
                              "msModelSlim's symmetric W8A8_DYNAMIC weights only")


def _fp8_block(cfg: Any) -> tuple[int, int] | None:
    """quantization_config's weight_block_size (bn, bk), if any."""
    qc = getattr(cfg, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    block = qc.get("weight_block_size")
    if block is None:  # compressed-tensors: its weights' block_structure
        groups = qc.get("config_groups") or {}
        block = next((g.get("weights", {}).get("block_structure") for g in groups.values()
                      if g.get("weights", {}).get("block_structure")), None)
    if block is None:
        return None
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise ConfigError(f"quantization_config weight_block_size {block}: want [rows, cols]")
    return int(block[0]), int(block[1])


def _packed_gguf(raw: ResolvedModel, cfg: Any, device: torch.device,
                 tp: TPInfo | None) -> GGUFCheckpoint | None:
    """The GGUF file's tensors with the quantized ones kept packed (gguf_packed.py), where
    PDCORE_GGUF_PACKED is on and this model can take them: a Llama-architecture GGUF on CPU, one
    TP rank. None: the de-quantized float weights load instead (logged when asked for)."""
    if raw.gguf_file is None or not ENV.pdcore_gguf_packed:
        return None
    why = ""
    if MODEL_CLASSES[cfg.architectures[0]] is not llama.LlamaForCausalLM:
        why = f"{cfg.architectures[0]} is not a dense Llama-family model"
    elif torch.device(device).type != "cpu":
        why = f"the packed kernels run on CPU, not {device}"
    elif tp is not None and tp.size != 1:
        why = "--tensor-parallel-size > 1"
    if not why:
        try:
            sd = GGUFCheckpoint(raw.display_path, cfg)
        except ValueError as e:
            why = str(e)
    if why:
        log.warning("GGUF weights de-quantized to float at load, not served packed: %s", why)
        return None
    log.info("GGUF weights served packed (%s): %s", raw.display_path, sd.summary())
    from pdcore.engine import native

    native.gguf_path()  # the GEMM's path, chosen and logged once
    return sd


def bf16_lm_head(model: torch.nn.Module) -> bool:
    """Replace a W8A8 model's float32 lm_head by bf16 weight panels (layers.pack_panels of the
    matrix rounded to bf16, half its bytes) as its `lm_head_packed`: the native panel GEMM
    widens each weight as it reads it (exact) and multiplies the float32 activations, so the
    logits are the float32 kernel's on the rounded matrix. The matrix becomes an int8 stand-in
    of its shape (quant.lm_head_stand_in). False where the lm_head is already packed, is not
    a float32 matrix on the CPU, or the native panel GEMM does not serve here."""
    from pdcore.engine import native

    head = model.lm_head
    if (getattr(model, "lm_head_packed", None) is not None or head.dim() != 2
            or head.dtype != torch.float32 or head.device.type != "cpu"
            or not native.panel_gemm()):
        return False
    model.lm_head_packed = pack_panels(head.detach().to(torch.bfloat16))
    model.lm_head = lm_head_stand_in(head)
    return True


def bf16_dot_support() -> str:
    """'' where the bf16 dot-product lm_head serves (the native bf16 GEMM: the avx512 library
    on a CPU with AVX-512 BF16, as cpu_features sees it, so PDCORE_CPU_ISA=avx2 and
    PDCORE_CPUINFO hide it too), else why not."""
    from pdcore.engine import native
    from pdcore.engine.cpu_features import cpu_flags

    if "avx512_bf16" not in cpu_flags():
        return "this CPU has no avx512_bf16"
    if not native.bf16_gemm():
        return f"no native bf16 GEMM ({native.status() or 'native kernels off'})"
    return ""


def bf16_dot_lm_head(model: torch.nn.Module) -> bool:
    """Replace a W8A8 model's float32 lm_head by bf16 pair panels (layers.pack_panels_bf16 of
    the matrix rounded to bf16) as its `lm_head_packed`: layers.linear hands float32 x with them
    to the native bf16 dot-product head (bf16_head.h: x rounded to bf16, vdpbf16ps, float32
    logits). The caller checks bf16_dot_support first. False where the lm_head is already
    packed or is not a float32 matrix of even width on the CPU."""
    head = model.lm_head
    if (getattr(model, "lm_head_packed", None) is not None or head.dim() != 2
            or head.dtype != torch.float32 or head.device.type != "cpu" or head.shape[1] % 2):
        return False
    model.lm_head_packed = pack_panels_bf16(head.detach().to(torch.bfloat16))
    model.lm_head = lm_head_stand_in(head)
    return True


def _w8a8_lm_head(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """PDCORE_W8A8_LM_HEAD: a W8A8 model's float lm_head rounded to bf16 weights (bf16_lm_head,
    where the model computes in float32: the panel GEMM takes float32 activations), with its
    activations rounded to bf16 too and bf16 dot products (bf16_dot_lm_head, where the CPU has
    AVX-512 BF16; elsewhere the bf16 one), kept as the checkpoint stores it (float) or
    quantized to int8 like the body (quant.int8_lm_head), on the CPU; logged either way."""
    how = ENV.pdcore_w8a8_lm_head
    if how in ("bf16", "bf16_dot") and dtype != torch.float32:
        log.info("W8A8 lm_head: as the checkpoint stores it (the %s head serves float32 "
                 "activations; this model computes in %s)", how, dtype)
        return
    if how == "float":
        log.info("W8A8 lm_head: float as the checkpoint stores it (PDCORE_W8A8_LM_HEAD=float; "
                 "bf16 or bf16_dot halves its bytes; docs/quantization.md)")
        return
    if how == "bf16_dot":
        why = bf16_dot_support()
        if not why and bf16_dot_lm_head(model):
            log.info("W8A8 lm_head: bf16 weights and activations, bf16 dot products, float32 "
                     "logits (PDCORE_W8A8_LM_HEAD=bf16_dot)")
            return
        log.info("W8A8 lm_head: the bf16_dot head does not serve here (%s); the bf16 one "
                 "instead", why or "not a float32 matrix of even width on the CPU")
        how = "bf16"
    done = (int8_lm_head if how == "int8" else bf16_lm_head)(model)
    log.info("W8A8 lm_head: %s (PDCORE_W8A8_LM_HEAD=%s)",
             ("int8 per output channel, quantized at load" if how == "int8" else
              "bf16 weights, float32 activations") if done else
             "float: not a float32 matrix on the CPU or no native panel GEMM here", how)


def _check_int8_loaded(sd: Int8Checkpoint, resolved: ResolvedModel, cfg: Any) -> None:
    """Every int8 weight of the checkpoint went to an int8 linear layer (one read by anything
    else would have been taken as float values)."""
    # MTP layers (a MiMo's model.mtp_layers.*, DeepSeek's model.layers.{num_hidden_layers}.*)
    # load with the draft head, not the model
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    missed = sorted(n for n in sd.int8_weight_names() - sd.int8_names
                    if ".mtp_layers." not in n and not n.startswith(mtp))
    if missed:
        raise ModelLoadError(f"{resolved.display_path}: int8 weights this model does not load "
                             f"as W8A8 linear layers: {', '.join(missed[:4])}"
                             f"{' ...' if len(missed) > 4 else ''}")


def load_model(model_path: str | None, dtype: torch.dtype, device: torch.device,
               tp: TPInfo | None = None, trust_remote_code: bool = False,
               load_format: str = "auto", *, overrides: dict[str, Any] | None = None
               ) -> tuple[Any, Any, ResolvedModel]:
    """Our model with weights loaded; `overrides` (--json-model-override-args) are laid over
    its config.json's values first."""
    _progress_bars_on_a_thread_lock()
    raw = resolve_model(model_path)
    _check_format(raw, load_format)
    # a GGUF file loads through its cached HF conversion; dummy weights need only the config
    resolved = raw if load_format == "dummy" else converted(raw)
    cfg = load_config(resolved, trust_remote_code, plain=load_format != "dummy")
    for key, value in (overrides or {}).items():
        log.info("config.json %s: %r -> %r (--json-model-override-args)", key,
                 getattr(cfg, key, None), value)
        setattr(cfg, key, value)
    log.info("loading %s (%s) as %s%s", resolved.display_path, cfg.architectures[0], dtype,
             " with random weights (--load-format dummy)" if load_format == "dummy" else "")
    sd = _packed_gguf(raw, cfg, device, tp) if load_format != "dummy" else None
    if sd is None:
        sd = _hf_state_dict(resolved, cfg, load_format, trust_remote_code)
    quantization = _quantization(resolved, cfg, load_format)
    if quantization == "modelslim":
        _check_modelslim_offsets(sd, resolved)
    if quantization == "modelslim":
        sd = modelslim_checkpoint(sd, resolved.path, resolved.display_path)
    elif quantization == "w8a8_int8":
        sd = Int8Checkpoint(sd)
    elif quantization == "fp8":
        sd = Fp8Checkpoint(sd, _fp8_block(cfg))
    model = MODEL_CLASSES[cfg.architectures[0]](cfg, tp)
    try:
        model.load_hf_state_dict(sd)
    except KeyError as e:
        raise ModelLoadError(f"{resolved.display_path} lacks the weight {e} that "
                             f"{cfg.architectures[0]} needs") from e
    if isinstance(sd, Int8Checkpoint):
        _check_int8_loaded(sd, resolved, cfg)
        _w8a8_lm_head(model, dtype)
    if isinstance(sd, Fp8Checkpoint):
        lin, moe = fp8_layers(model)
        log.info("quantization fp8 (%s): %d FP8 weights read; %d linear layers and %d MoE "
                 "expert sets kept FP8 (de-quantized per layer at compute), the rest "
                 "de-quantized at load", quant_config.detect(resolved.path, None).detail,
                 sd.fp8_handed_out, lin, moe)
    # in inference mode like the load: the mapped checkpoint tensors the model adopted are
    # inference tensors, and converting one (bf16) outside it leaves a parameter that fails
    # "Inference tensors do not track version counter" at its first use
    with torch.inference_mode():
        model = model.to(device=device, dtype=dtype).eval()
        model.prepare_for_inference()
    if isinstance(sd, GGUFCheckpoint) and getattr(model, "decode_kv", None) is not None:
        model.decode_kv.prefer_pool = True  # its float32 pool read in place (decode_view.py)
    if torch.device(device).type == "cpu":
        from pdcore.engine.model.layers import weight_layouts

        log.info("GEMM weights by layout (PDCORE_GEMM_LAYOUT, chosen by timing at load): %s",
                 ", ".join(f"{n} {k}" for k, n in weight_layouts(model).items() if n))
    if isinstance(sd, (SafetensorsWeights, Int8Checkpoint, Fp8Checkpoint)):
        sd.release_pages()
    del sd  # one copy of the weights from here: ours (prepare_for_inference replaces them)
    trim_heap()
    hold_heap()  # from here each step reuses the activations' memory the last one freed
    return model, model.cfg, resolved


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights occupy: every parameter, buffer and reordered weight, each
    storage once (a stand-in's one element counts as what it is)."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        tensors += [t for t in vars(m).values() if isinstance(t, torch.Tensor)]
        tensors += [t for v in vars(m).values() if hasattr(v, "tensors") and
                    not isinstance(v, torch.Tensor) for t in v.tensors()]  # FP8 weights
    for t in tensors:
        if t.is_mkldnn:  # opaque storage: its logical size
            total += t.numel() * t.element_size()
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
