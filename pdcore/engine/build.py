"""Builds an engine (model, KV pool, scheduler) from ServerArgs; also an in-process API.

1. resolve platform and device; seed the RNGs (`--random-seed`); load the model through
   transformers (`--load-format dummy`: random weights of the config's shapes);
2. size the KV pool: `--max-total-tokens`, else `--mem-fraction-static` (default 0.1 on
   host memory, 0.85 on accelerators) of the device's TOTAL memory minus the weights (on a host,
   split evenly when `pdserve up` says the server is one of N: PDCORE_HOST_SERVERS), capped at
   context length x max running requests. Never "what is free now", so the size does not
   change from one start to the next, except that an explicit `--mem-fraction-static` on a
   host (SGLang's 0.8 is meant for an accelerator) is cut to 80% of the memory available,
   with a warning. The KV dtype is `--kv-cache-dtype` (auto: the model's);
3. allocate it from the memory-pool plugin (host pools are untouched zero pages: resident only
   once requests write them); build block manager, runner and scheduler.

The in-process API over an engine is pdcore.runtime.llm_engine.LLMEngine.
"""

from __future__ import annotations

import json

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pdcore.config import (
    HOST_SERVERS_ENV,
    NGRAM_DRAFT_TOKENS,
    SPEC_HEADS,
    ServerArgs,
    host_servers,
    jump_forward,
    spec_gate,
)
from pdcore.constrained.backend import GrammarBackend
from pdcore.engine.kv import giveback
from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.kv.cache import KVCache, KVSpec
from pdcore.engine.kv.radix import RadixCache
from pdcore.engine.loop import StepLoop
from pdcore.engine.model.layers import TPInfo
from pdcore.engine.model.loader import load_model, resolve_dtype, weight_bytes
from pdcore.engine.model.runner import ModelRunner
from pdcore.engine.model.source import sampling_defaults
from pdcore.engine.sched.batch_run import BatchRunner
from pdcore.engine.sched.extension import HeadChain, ModelSide
from pdcore.engine.sched.runtime_api import RuntimeAPI
from pdcore.engine.sched.scheduler import Scheduler, SchedulerConfig
from pdcore.engine.sched.speculative import SpecConfig, Speculator
from pdcore.env import environ
from pdcore.errors import ConfigError
from pdcore.interfaces.geometry import kv_head_span
from pdcore.interfaces.memory import PoolContext
from pdcore.messages.info import EngineInfo

log = logging.getLogger(__name__)

# share of TOTAL device memory for weights + KV when --mem-fraction-static is not given: host
# RAM is shared with everything else on the machine, an accelerator's memory is ours
DEFAULT_HOST_MEM_FRACTION, DEFAULT_DEVICE_MEM_FRACTION = 0.1, 0.85
# ... and the least KV a host server gets by default when the weights fill that share (a 1B
# float32 model is 4.4 GiB, over 10% of a 24 GiB host): 1/40 of the host (0.6 GiB there), the
# way vLLM CPU gives its KV a fixed space. An explicit --mem-fraction-static is kept as given.
DEFAULT_HOST_MIN_KV_FRACTION = 1 / 40


@dataclass
class Engine:
    args: ServerArgs
    model: Any
    hf_config: Any
    kv: KVCache
    blocks: BlockManager
    scheduler: Scheduler
    info: EngineInfo
    loop: StepLoop  # the step: schedule -> run -> postprocess (engine/loop.py)

    def close(self) -> None:
        RuntimeAPI(self.scheduler).close_role()
        self.kv.close()


HOST_FREE_SHARE = 0.8  # a host's KV pool takes at most this share of the memory available


def kv_pool_tokens(args: ServerArgs, platform: Any, device: torch.device, model: Any,
                   per_token: int, context: int) -> int:
    """The KV pool's size in tokens, from the flags, the device's total memory and the model:
    the same on every start of the same server on the same machine."""
    if args.max_total_tokens:
        return args.max_total_tokens
    host = device.type == "cpu"
    frac = args.mem_fraction_static or (DEFAULT_HOST_MEM_FRACTION if host
                                        else DEFAULT_DEVICE_MEM_FRACTION)
    mem = platform.memory_info(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # --dp-size N on a host: the N replicas' pools share its memory (on a device each replica
    # has its own accelerators, offset by --base-gpu-id)
    share = args.dp_size if host else 1
    budget = int(mem.total_bytes * frac / share) - weights
    if host and args.mem_fraction_static is None:
        least = int(mem.total_bytes * DEFAULT_HOST_MIN_KV_FRACTION / share)
        if budget < least:
            log.info("the weights (%.2f GiB) fill the default %.0f%% of host memory: the KV "
                     "pool gets %.2f GiB (1/%d of it); --mem-fraction-static or "
                     "--max-total-tokens set it", weights / 2**30, frac * 100, least / 2**30,
                     round(1 / DEFAULT_HOST_MIN_KV_FRACTION))
            budget = least
    # servers started together on a host (`pdserve up`): each its own weights, the KV budget
    # split among them (the weights are not divided: every server holds a whole copy)
    servers = host_servers() if host else 1
    budget //= servers
    if budget < per_token * args.page_size:
        split = f", split over {servers} servers ({HOST_SERVERS_ENV})" if servers > 1 else ""
        raise ConfigError(
            f"--mem-fraction-static {frac} of {mem.total_bytes / 2**30:.1f} GiB leaves no room "
            f"for the KV cache after {weights / 2**30:.2f} GiB of weights{split}; raise it or "
            "give --max-total-tokens")
    # more tokens than every running request's whole context can never be in use at once
    tokens = min(budget // per_token, context * args.max_running_requests)
    if host and args.mem_fraction_static is not None \
            and tokens * per_token > HOST_FREE_SHARE * mem.free_bytes:
        # SGLang's fraction is of accelerator memory; on a host the rest of the machine lives
        # in the same memory, so the pool is sized to what is available now instead
        fit = max(args.page_size, int(HOST_FREE_SHARE * mem.free_bytes) // per_token)
        log.warning("--mem-fraction-static %g asks a KV pool of %.1f GiB, but this host has "
                    "%.1f GiB available now: the pool holds %d tokens (%.1f GiB) instead; "
                    "give --max-total-tokens to choose", frac, tokens * per_token / 2**30,
                    mem.free_bytes / 2**30, fit, fit * per_token / 2**30)
        tokens = fit
    if tokens * per_token > mem.free_bytes:
        log.warning("the KV pool (%.1f MiB) is larger than the memory free now (%.1f MiB); "
                    "lower --mem-fraction-static or --max-total-tokens if the start fails",
                    tokens * per_token / 2**20, mem.free_bytes / 2**20)
    return tokens


def seed_everything(seed: int) -> None:
    """--random-seed: torch (every device), random and numpy."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def kv_dtype(args: ServerArgs, model_dtype: torch.dtype) -> torch.dtype:
    from pdcore.engine.kv.fp8 import FP8_KV_DTYPES

    if args.kv_cache_dtype in FP8_KV_DTYPES:
        return FP8_KV_DTYPES[args.kv_cache_dtype]
    return model_dtype if args.kv_cache_dtype == "auto" else resolve_dtype(args.kv_cache_dtype,
                                                                           "cpu")


def _platform(args: ServerArgs) -> Any:
    from pdcore.plugins.host import platforms

    reg = platforms()
    if args.device not in reg:
        raise ConfigError(f"--device {args.device}: no platform plugin registered under that name;"
                          f" installed: {', '.join(reg.names())}")
    return reg.create(args.device)


def _backend_pool(args: ServerArgs) -> str | None:
    """The pool a PD transfer backend needs (declared at registration), if any."""
    if args.disaggregation_mode == "null":
        return None
    from pdcore.plugins.default_backend import resolve_transfer_backend
    from pdcore.plugins.host import transfer_backends

    name = resolve_transfer_backend(args)
    return transfer_backends().get(name).pool_for(environ())


def _prefix_cache(args: ServerArgs, blocks: BlockManager) -> RadixCache | None:
    """Unified and prefill servers cache prefixes unless --disable-radix-cache; a decode server
    only with --disaggregation-decode-enable-radix-cache (its pages come from prefill)."""
    if args.disable_radix_cache:
        return None
    if args.disaggregation_mode == "decode" and not args.disaggregation_decode_enable_radix_cache:
        return None
    return RadixCache(blocks)


def kv_spec(model: Any, cfg: Any, tp: TPInfo) -> KVSpec:
    """This rank's pool geometry: the model's own `kv_spec()` (MLA: one latent per token), else
    the Llama rule (its share of the KV heads, each head_dim wide)."""
    if hasattr(model, "kv_spec"):
        return model.kv_spec()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVSpec(kv_heads=kv_head_span(cfg.num_key_value_heads, tp.rank, tp.size)[1],
                  head_dim=head_dim, total_kv_heads=cfg.num_key_value_heads, is_mla=False)


def _grammar(args: ServerArgs, cfg: Any, eos: list[int]) -> GrammarBackend:
    """The structured-output backend; it loads the tokenizer on the first constrained request."""
    from pdcore.engine.model.tokenizer import load_tokenizer

    return GrammarBackend(args.grammar_backend, lambda: load_tokenizer(args), cfg.vocab_size,
                          eos, any_whitespace=not args.constrained_json_disable_any_whitespace)


def _speculator(args: ServerArgs, model: Any = None, blocks: BlockManager | None = None,
                model_dir: str | None = None, kv: KVCache | None = None, *,
                runner: ModelRunner | None = None) -> Speculator | None:
    """Drafts for the servers that decode: NGRAM, EAGLE, EAGLE3 or NEXTN (--speculative-algorithm),
    and jump-forward for constrained requests (the grammar's forced tokens; without TP, where
    the matcher is on the rank that drafts). A prefill server samples one token and drafts
    nothing, but with a draft head (EAGLE, EAGLE3, NEXTN) it runs the head over the prompt
    (`observe`), whose K/V then travel to decode with the target's (`kv`: in PD mode the
    head's pool is the KV cache's; NEXTN's one latent buffer, as the target's MLA layers)."""
    jump = (jump_forward() and args.grammar_backend != "none" and args.tp_size == 1
            and not args.enable_dp_attention)
    if args.speculative_algorithm is None and not jump:
        return None
    prefill = args.disaggregation_mode == "prefill"
    if prefill and args.speculative_algorithm not in SPEC_HEADS:
        if args.speculative_algorithm is not None:
            log.info("--speculative-algorithm %s: a prefill server computes only the first "
                     "token; the decode server speculates", args.speculative_algorithm)
        return None
    jump = jump and not prefill
    cfg = SpecConfig(args.speculative_algorithm,
                     args.speculative_num_draft_tokens or NGRAM_DRAFT_TOKENS,
                     args.speculative_ngram_min_match_window_size,
                     args.speculative_ngram_max_match_window_size,
                     args.speculative_ngram_branch_length, args.speculative_ngram_capacity,
                     gate=spec_gate(), jump_forward=jump)
    drafter = None
    if cfg.algorithm in SPEC_HEADS:
        drafter = _head_drafter(args, cfg, model, blocks, model_dir,
                                kv if args.disaggregation_mode != "null" else None, runner=runner)
    if prefill:
        log.info("%s on a prefill server: the draft head runs over every prompt and its K/V "
                 "travel to decode with the target's", cfg.algorithm)
    elif cfg.algorithm is not None:
        log.info("speculative decoding: %s, up to %d draft tokens per request and step%s",
                 cfg.algorithm, cfg.max_drafts, "; jump-forward for constrained requests"
                 if jump else "")
    return Speculator(cfg, drafter)


def compute_param(module: torch.nn.Module) -> torch.Tensor:
    """A parameter whose dtype and device are the module's compute ones: the first floating
    one (a quantized model's first parameter may be an int8 matrix, or the int8 stand-in of an
    lm_head packed elsewhere: quant.lm_head_stand_in)."""
    return next(p for p in module.parameters() if p.is_floating_point())


def _head_drafter(args: ServerArgs, cfg: SpecConfig, model: Any, blocks: BlockManager | None,
                  model_dir: str | None, kv: KVCache | None = None, *,
                  runner: ModelRunner | None = None):
    """The draft head beside `model`, with its one-layer K/V pool addressed like the target's
    (engine/sched/eagle.py): EAGLE's and EAGLE3's of --speculative-draft-model-path (EAGLE3:
    engine/model/eagle3.py, over three of the target's layers); NEXTN's the MTP layer
    of the target's own checkpoint (`model_dir`) unless that flag names another folder (a
    MiMo's first MTP layer, engine/model/mimo.py); --enable-multi-layer-eagle: a MiMo's N MTP
    layers, one pool each (engine/sched/mtp_chain.py). With
    `kv` (PD mode) the pool is allocated in the KV cache's memory, one more transfer layer.
    Its passes run through `runner`, the target's model runner."""
    from pdcore.engine.sched.eagle import HeadDrafter

    assert model is not None and blocks is not None
    from pdcore.engine.model.mtp import is_mimo

    p = compute_param(model)
    drafter_class = HeadDrafter
    if args.enable_multi_layer_eagle or (cfg.algorithm == "NEXTN" and is_mimo(model.cfg)):
        from pdcore.engine.model.mimo import load_mimo_head
        from pdcore.engine.sched.mtp_chain import MultiLayerDrafter

        if args.load_format in ("dummy", "gguf") or not model_dir:
            raise ConfigError(f"the MTP layers' weights are read from the safetensors "
                              f"checkpoint; --load-format {args.load_format} has none")
        source = args.speculative_draft_model_path or model_dir
        head = load_mimo_head(model, source, args.enable_multi_layer_eagle, p.dtype, p.device)
        if head.num_layers > 1:
            drafter_class = MultiLayerDrafter
    elif cfg.algorithm == "EAGLE":
        from pdcore.engine.model.eagle import load_eagle_head

        source = args.speculative_draft_model_path
        head = load_eagle_head(source, model, p.dtype, p.device)
    elif cfg.algorithm == "EAGLE3":  # reads three target layers: build_engine sets the capture
        from pdcore.engine.model.eagle3 import load_eagle3_head

        source = args.speculative_draft_model_path
        head = load_eagle3_head(source, model, p.dtype, p.device)
    else:
        from pdcore.engine.model.nextn import load_nextn_head

        if args.load_format in ("dummy", "gguf") or not model_dir:
            raise ConfigError(f"--speculative-algorithm NEXTN reads the MTP layer's weights from "
                              f"the safetensors checkpoint; --load-format {args.load_format} "
                              "has none")
        source = args.speculative_draft_model_path or model_dir
        head = load_nextn_head(model, source, p.dtype, p.device)
    # TP: every rank holds the head's layer sharded as the target's and runs every pass
    drafter = drafter_class(head, blocks, args.max_running_requests, cfg.max_drafts,
                            kv.draft_buffer if kv is not None else None, tp=model.tp,
                            runner=runner)
    log.info("%s draft head %s: %d-token chains; its K/V pool takes %.1f MiB beside the "
             "target's", cfg.algorithm, source, cfg.max_drafts, drafter.pool_bytes / 2**20)
    return drafter


def build_engine(args: ServerArgs, tp: TPInfo | None = None) -> Engine:
    tp = tp or TPInfo()
    platform = _platform(args)
    device = platform.device_for_rank(tp.rank, args.base_gpu_id)
    dtype = resolve_dtype(args.dtype, device.type)
    if args.random_seed is not None:
        seed_everything(args.random_seed)
    model, cfg, resolved = load_model(args.model_path, dtype, device, tp, args.trust_remote_code,
                                      args.load_format,
                                      # --json-model-override-args, checked at start-up
                                      overrides=json.loads(args.json_model_override_args or "{}"))
    cache_dtype = kv_dtype(args, dtype)
    spec = kv_spec(model, cfg, tp)
    kv_heads, head_dim = spec.kv_heads, spec.head_dim
    if spec.is_mla and cache_dtype.itemsize == 1:
        raise ConfigError(f"--kv-cache-dtype {args.kv_cache_dtype}: FP8 KV pools serve the "
                          "Llama-family attention; an MLA model (DeepSeek) keeps its latent in "
                          "auto, float32 or bfloat16")
    if cache_dtype.itemsize == 1:
        scaled = sum(getattr(m, "k_scale", 1.0) != 1.0 or getattr(m, "v_scale", 1.0) != 1.0
                     for m in model.modules())
        log.info("FP8 KV pool (%s): K/V quantized on write, de-quantized on read; %d layers "
                 "with the checkpoint's k_scale / v_scale, the others 1.0", cache_dtype,
                 scaled)
    per_token = KVCache.bytes_per_token(cfg.num_hidden_layers, kv_heads, head_dim, cache_dtype,
                                        spec.is_mla)
    model_context = args.context_length or getattr(cfg, "max_position_embeddings", 4096)
    tokens = kv_pool_tokens(args, platform, device, model, per_token, model_context)
    # every TP rank must see the same pool (the schedule is replicated): take the smallest
    num_pages = tp.all_min([max(1, tokens // args.page_size)])[0]
    # the longest sequence the pool can hold is what /v1/models reports as max_model_len
    context = min(model_context, num_pages * args.page_size)
    if context < model_context:
        log.warning("context length %d -> %d: the KV pool holds %d tokens", model_context,
                    context, num_pages * args.page_size)
    from pdcore.plugins.host import memory_pools

    pool_name = args.memory_pool or _backend_pool(args) or getattr(platform, "default_pool",
                                                                    "torch")
    pool = memory_pools().create(
        pool_name, PoolContext(server_id=args.server_id, device=str(device), rank=tp.rank,
                               env=environ()))
    kv = KVCache(pool, cfg.num_hidden_layers, num_pages, args.page_size, kv_heads, head_dim,
                 dtype=cache_dtype, tp_rank=tp.rank, tp_size=tp.size,
                 total_kv_heads=spec.total_kv_heads, is_mla=spec.is_mla)
    blocks = BlockManager(num_pages, args.page_size)
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    eos_ids = frozenset(e for e in eos if e is not None)
    model_runner = ModelRunner(model, kv, blocks, tp)
    model_runner.give_back_pages = giveback.allowed(args.disaggregation_mode)
    runner = BatchRunner(model_runner, _grammar(args, cfg, [e for e in eos if e is not None]))
    speculator = _speculator(args, model, blocks,
                             None if resolved.gguf_file else resolved.path, kv, runner=model_runner)
    model_runner.capture_hidden = speculator is not None and speculator.needs_hidden
    # EAGLE3: the residual streams entering its three target layers instead (such steps run
    # the Python layer loop; every other server keeps the native decode loop)
    head = getattr(speculator.drafter, "head", None) if speculator is not None else None
    model_runner.capture_layers = getattr(head, "aux_layers", None)
    chain = None  # a draft head's chain starts: what PD's aux rows carry and adopt
    if head is not None:
        p = compute_param(head)
        chain = HeadChain(p.dtype, p.device, speculator.cfg.max_drafts)  # type: ignore[union-attr]
    sched = Scheduler(blocks, SchedulerConfig(
        max_running=args.max_running_requests, chunk_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens, context_length=context,
        decode_step_prefill=_fixed_step_prefill(args.decode_step_prefill_tokens),
        decode_step_auto=args.decode_step_prefill_tokens == "auto",
        tpot_target_s=args.decode_tpot_target_ms / 1e3,
        eos_ids=eos_ids,
        schedule_policy=args.schedule_policy,
        conservativeness=args.schedule_conservativeness), cache=_prefix_cache(args, blocks),
        tp=tp, side=ModelSide(kv.layers, int(cfg.hidden_size), int(cfg.vocab_size), chain))
    info = EngineInfo(
        model_path=resolved.display_path, tokenizer_path=resolved.display_path,
        served_model_name=args.served_model_name or resolved.name,
        context_length=context, max_total_tokens=num_pages * args.page_size,
        page_size=args.page_size, num_pages=num_pages, vocab_size=cfg.vocab_size,
        eos_token_ids=sorted(eos_ids), dtype=str(dtype).replace("torch.", ""),
        kv_cache_dtype=str(cache_dtype).replace("torch.", ""),
        load_format=args.load_format, random_seed=args.random_seed,
        device=str(device), architectures=list(cfg.architectures),
        model_type=cfg.model_type, disaggregation_mode=args.disaggregation_mode,
        tp_size=args.tp_size, dp_size=args.dp_size, nnodes=args.nnodes,
        bootstrap_port=args.disaggregation_bootstrap_port, memory_pool=pool_name,
        is_mla=spec.is_mla, kv_bytes_per_token=per_token,
        weight_bytes=weight_bytes(model),
        sampling_defaults=sampling_defaults(resolved, args.sampling_defaults),
    )
    if info.sampling_defaults:
        log.info("OpenAI routes' sampling defaults (--sampling-defaults model): %s",
                 info.sampling_defaults)
    log.info("KV pool: %d pages x %d tokens (%.1f MiB, %s) in pool %r; max context %d",
             num_pages, args.page_size, num_pages * args.page_size * per_token / 2**20,
             info.kv_cache_dtype, pool_name, context)
    return Engine(args, model, cfg, kv, blocks, sched, info, StepLoop(sched, runner, speculator))


def _fixed_step_prefill(value: int | str) -> int | None:
    """--decode-step-prefill-tokens as a fixed cap: None for -1 (the chunk) and for auto."""
    return value if isinstance(value, int) and value > 0 else None
