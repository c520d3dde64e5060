"""Checks that run before the model loads, so a bad start costs about a second, not a model load.

1. the default transfer backend is filled in (pdcore.plugins.default_backend);
2. `preflight` raises ConfigError (the CLI exits 2 with its one-line message) for what can be
   known without the model: the backend, memory pool, platform and planner plugins (including
   their SDK imports), SGLANG_* values, port clashes, files named by flags;
3. it returns one warning per flag or variable that would do nothing in this configuration;
   which ones a plugin uses comes from what it declared (`reads=` at registration), never from
   its name.

Nothing here imports torch: importing it alone takes seconds on a busy host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pdcore.config import DisaggEnv, ServerArgs
from pdcore.env import environ
from pdcore.edge.ports import check_port_free
from pdcore.errors import ConfigError, PluginError
from pdcore.plugins.default_backend import FALLBACK_BACKEND, resolve_transfer_backend

# The engine's attention is torch SDPA on every platform (reading the pool's KV dtype).
ATTENTION_BACKENDS = ("torch", "sdpa")
# Flags that only mean something to a plugin that declares them (`reads=`), with the value that
# means "not set".
PLUGIN_FLAGS = {"disaggregation_ib_device": None, "base_gpu_id": 0}
# Variables of SGLang's transfer backends: set for a backend that does not read them, they do
# nothing. Installed backends add the variables they declare.
BACKEND_VARIABLES = ("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "MOONCAKE_PROTOCOL", "MC_FORCE_TCP",
                     "SGLANG_DISAGGREGATION_NIXL_BACKEND", "ASCEND_MF_STORE_URL",
                     "ASCEND_MF_TRANSFER_PROTOCOL")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _entry(kind: str, name: str):  # type: ignore[no-untyped-def]
    from pdcore.plugins import host

    registry = {"backend": host.transfer_backends, "pool": host.memory_pools,
                "platform": host.platforms, "planner": host.transfer_planners}[kind]()
    try:
        entry = registry.get(name)
    except PluginError as e:
        raise ConfigError(str(e)) from None
    ok, reason = entry.available()
    if not ok:
        raise ConfigError(f"{entry.kind.value} {name!r} is not available here: {reason}")
    return entry


def _check_files(args: ServerArgs) -> None:
    from pdcore.edge.ports import tls_settings

    tls_settings(args.ssl_certfile, args.ssl_keyfile, "--ssl-certfile", "--ssl-keyfile")
    if args.chat_template:
        path = os.path.expanduser(args.chat_template)
        if not os.path.isfile(path):
            raise ConfigError(f"--chat-template {args.chat_template}: no such file (give a "
                              "Jinja template file)")
        import jinja2

        try:
            with open(path, encoding="utf-8") as f:
                jinja2.Environment().parse(f.read())
        except (OSError, UnicodeDecodeError, jinja2.TemplateSyntaxError) as e:
            raise ConfigError(f"--chat-template {args.chat_template} is not a valid Jinja "
                              f"template: {e}") from None
    if args.load_format in ("safetensors", "gguf", "dummy"):
        from pdcore.runtime import resolve_model

        is_gguf = resolve_model(args.model_path).gguf_file is not None
        if args.load_format == "gguf" and not is_gguf:
            raise ConfigError(f"--load-format gguf: {args.model_path} holds no .gguf file")
        if args.load_format in ("safetensors", "dummy") and is_gguf:
            raise ConfigError(f"--load-format {args.load_format}: {args.model_path} is a GGUF "
                              "model; use --load-format auto or gguf")
    if args.speculative_algorithm == "NEXTN" or (args.speculative_algorithm == "EAGLE"
                                                 and args.enable_multi_layer_eagle):
        _check_nextn(args)
    if args.speculative_algorithm == "EAGLE3":
        _check_eagle3(args.speculative_draft_model_path)


def _check_eagle3(draft: str) -> None:
    """The EAGLE3 head's folder: a config.json naming LlamaForCausalLMEagle3 with one layer
    (its weights, d2t and layer ids are checked against the target when the engine loads it:
    engine/model/eagle3.py)."""
    import json

    where = f"--speculative-algorithm EAGLE3: --speculative-draft-model-path {draft}"
    folder = os.path.expanduser(draft)
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: no readable config.json ({type(e).__name__}); expected "
                          "an HF folder of an EAGLE-3 draft head") from None
    arch = (raw.get("architectures") or [None])[0] if isinstance(raw, dict) else None
    if arch != "LlamaForCausalLMEagle3":
        raise ConfigError(f"{where}: config.json names {arch!r}, not LlamaForCausalLMEagle3 "
                          "(an EAGLE-1 head is --speculative-algorithm EAGLE)")
    if raw.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"{where}: the head has {raw.get('num_hidden_layers')} layers; only "
                          "one-layer EAGLE-3 heads are built")
    if not any(n.endswith(".safetensors") for n in os.listdir(folder)):
        raise ConfigError(f"{where}: no .safetensors weights (a pytorch_model.bin head: "
                          "convert it to safetensors)")


def _check_nextn(args: ServerArgs) -> None:
    """NEXTN drafts with the model's own MTP layer (a DeepSeek-V3's, or a MiMo's first) and
    --enable-multi-layer-eagle with a MiMo's N >= 2 MTP layers: a safetensors checkpoint that
    has them (its config and the weight files' headers, read before the model loads)."""
    from pdcore.runtime import check_mtp_folder, resolve_model

    if args.load_format in ("dummy", "gguf"):
        raise ConfigError(f"--speculative-algorithm NEXTN reads the MTP layer's weights from the "
                          f"safetensors checkpoint; --load-format {args.load_format} has none")
    resolved = resolve_model(args.model_path)
    if resolved.gguf_file is not None:
        raise ConfigError(f"--speculative-algorithm NEXTN: {args.model_path} is a GGUF model; "
                          "the MTP layer is read from a DeepSeek-V3 safetensors checkpoint")
    draft = args.speculative_draft_model_path
    if draft and not os.path.isdir(os.path.expanduser(draft)):
        raise ConfigError(f"--speculative-draft-model-path {draft}: no such folder")
    check_mtp_folder(resolved.path, draft and os.path.expanduser(draft),
                     args.enable_multi_layer_eagle, args.speculative_algorithm)


def _check_disagg(args: ServerArgs, env: Mapping[str, str]) -> str | None:
    """Backend, planner, SGLANG_* values, bootstrap port; returns the backend's pool, if any."""
    backend = _entry("backend", resolve_transfer_backend(args) or FALLBACK_BACKEND)
    denv = DisaggEnv.from_env(env)
    if denv.staging_buffer:
        _entry("planner", "staging")
    if args.disaggregation_mode == "prefill":
        if args.disaggregation_bootstrap_port == args.port:
            raise ConfigError(f"--disaggregation-bootstrap-port {args.port} is also --port; "
                              "give them different ports")
        if args.node_rank == 0:
            check_port_free(args.host, args.disaggregation_bootstrap_port,
                             "--disaggregation-bootstrap-port")
    return backend.pool_for(env)


def _warnings(args: ServerArgs, env: Mapping[str, str]) -> list[str]:
    from pdcore.plugins.host import platforms, transfer_backends

    out: list[str] = []
    backend_name = args.disaggregation_transfer_backend
    pd = args.disaggregation_mode != "null"
    backend_reads = transfer_backends().get(backend_name).reads if pd and backend_name else set()
    platform_reads = platforms().get(args.device).reads
    for name, unset in PLUGIN_FLAGS.items():
        value = getattr(args, name)
        if value == unset or name in backend_reads or name in platform_reads:
            continue
        if name == "base_gpu_id":
            why = f"platform {args.device!r} has no device index to choose"
        elif not pd:
            why = "unified mode has no transfer backend"
        else:
            why = f"transfer backend {backend_name!r} does not use it"
        out.append(f"{_flag(name)} {value} is ignored: {why}")
    declared = {r for e in transfer_backends().entries() for r in e.reads if r.isupper()}
    for var in sorted(declared | set(BACKEND_VARIABLES)):
        if var in env and var not in backend_reads:
            why = (f"transfer backend {backend_name!r} does not read it" if pd
                   else "unified mode has no transfer backend")
            out.append(f"{var} is set but ignored: {why}")
    if args.attention_backend and args.attention_backend not in ATTENTION_BACKENDS:
        out.append(f"--attention-backend {args.attention_backend} is ignored: attention runs "
                   f"torch SDPA on {args.device}")
    if args.cuda_graph_bs:
        out.append(f"--cuda-graph-bs {' '.join(map(str, args.cuda_graph_bs))} is ignored: it "
                   "sizes the batches of captured CUDA graphs, a GPU feature; pdserve captures "
                   f"none (--device {args.device}), so it has no effect here")
    if args.schedule_policy == "lpm" and args.disable_radix_cache:
        out.append("--schedule-policy lpm runs as fcfs: longest-prefix-match needs the prefix "
                   "cache, which --disable-radix-cache turns off")
    if args.disaggregation_decode_enable_radix_cache and args.disaggregation_mode != "decode":
        out.append("--disaggregation-decode-enable-radix-cache is ignored: only a decode server "
                   "reads it (prefill and unified servers cache prefixes by default)")
    elif args.disaggregation_decode_enable_radix_cache and args.disable_radix_cache:
        out.append("--disaggregation-decode-enable-radix-cache is ignored: "
                   "--disable-radix-cache turns every prefix cache off")
    return out


def preflight(args: ServerArgs, env: Mapping[str, str] | None = None) -> list[str]:
    """Raise ConfigError for anything that would fail after the model loads; return the
    warnings (one line each) for settings that would silently do nothing."""
    env = environ() if env is None else env
    _entry("platform", args.device)
    _check_files(args)
    backend_pool = _check_disagg(args, env) if args.disaggregation_mode != "null" else None
    if args.memory_pool or backend_pool:
        _entry("pool", args.memory_pool or backend_pool)
    if args.node_rank == 0:
        check_port_free(args.host, args.port, "--port")
    return _warnings(args, env)
