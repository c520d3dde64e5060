"""`pdserve router` / `python -m pdcore.router`: argv -> RouterConfig -> uvicorn.

`--prefill URL [BOOTSTRAP_PORT|none]` takes one or two tokens, which click/typer options cannot
express, so the command accepts its arguments raw and `parse_router_args` parses them. Every
other flag is generated from a `RouterConfig` field (`foo_bar` -> `--foo-bar`; bools are switches
that also take `--flag=true|false`). Bad input raises ConfigError; the command turns it into a
usage error (message on stderr, exit code 2) whose message names what to fix.
"""

from __future__ import annotations

import difflib
import logging
import typing
from collections.abc import Sequence
from dataclasses import MISSING, fields

import typer

from pdcore.env import check as check_env
from pdcore.edge.ports import check_port_free
from pdcore.errors import ConfigError
from pdcore.router.config import RouterConfig
from pdcore.router.discovery import SELECTOR_FLAGS, load_cluster_config, parse_selector

_NONE_WORDS = ("none", "null")
LIST_FLAGS = ("ca-cert-paths", "worker-urls", "peer-routers")  # PATH ... / URL ...


def _field_kinds() -> dict[str, tuple[type, bool]]:
    """flag name -> (scalar type, accepts None) for every plain RouterConfig field."""
    hints = typing.get_type_hints(RouterConfig)
    out = {}
    for f in fields(RouterConfig):
        if f.metadata.get("special"):
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        kind = args[0] if args else hint
        out[f.name.replace("_", "-")] = (kind, type(None) in typing.get_args(hint))
    return out


def _convert(flag: str, raw: str, kind: type, nullable: bool) -> object:
    if nullable and raw.lower() in _NONE_WORDS:
        return None
    if kind is bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{flag} is a switch; give it alone or as --{flag}=true|false")
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise ConfigError(f"--{flag} expects {noun}, got {raw!r}") from None
    return raw


def _bootstrap_port(url: str, raw: str) -> int | None:
    if raw.lower() in _NONE_WORDS:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(
            f"--prefill {url} {raw}: the bootstrap port must be an integer in 1..65535 or 'none' "
            "(repeat --prefill for each prefill worker)"
        )
    return port


def parse_router_args(argv: Sequence[str]) -> RouterConfig:
    """Parse router arguments into a validated RouterConfig; ConfigError says what to fix."""
    kinds = _field_kinds()
    values: dict[str, object] = {}
    prefill: list[tuple[str, int | None]] = []
    decode: list[str] = []
    selectors: dict[str, dict[str, str]] = {}
    lists: dict[str, list[str]] = {}
    args = list(argv)
    i = 0

    def is_value(j: int) -> bool:
        return j < len(args) and not args[j].startswith("--")

    while i < len(args):
        token = args[i]
        if not token.startswith("--"):
            raise ConfigError(
                f"unexpected argument {token!r}: values follow their flag "
                "(--prefill URL [BOOTSTRAP_PORT], --decode URL, --port N, ...)"
            )
        flag, has_inline, inline = token[2:].partition("=")
        i += 1
        if flag in ("prefill", "decode"):
            if has_inline:
                url = inline
            elif is_value(i):
                url, i = args[i], i + 1
            else:
                usage = "URL [BOOTSTRAP_PORT]" if flag == "prefill" else "URL"
                raise ConfigError(f"--{flag} needs a worker URL: --{flag} {usage}")
            if flag == "prefill":
                port = None
                if not has_inline and is_value(i):
                    port, i = _bootstrap_port(url, args[i]), i + 1
                prefill.append((url, port))
            else:
                decode.append(url)
            continue
        if flag in LIST_FLAGS:  # one or more values, as sglang-router's nargs
            tokens = [inline] if has_inline else []
            while is_value(i):
                tokens, i = [*tokens, args[i]], i + 1
            if not tokens:
                raise ConfigError(f"--{flag} needs at least one value")
            lists.setdefault(flag.replace("-", "_"), []).extend(tokens)
            continue
        if flag in SELECTOR_FLAGS:  # one or more k=v tokens, as sglang-router's nargs="+"
            tokens = [inline] if has_inline else []
            while is_value(i):
                tokens, i = [*tokens, args[i]], i + 1
            selectors[flag.replace("-", "_")] = parse_selector(flag, tokens)
            continue
        if flag not in kinds:
            close = difflib.get_close_matches(flag, list(kinds) + ["prefill", "decode"], n=1)
            hint = f"; did you mean --{close[0]}?" if close else "; see --help"
            raise ConfigError(f"unknown option --{flag}{hint}")
        kind, nullable = kinds[flag]
        if kind is bool and not has_inline:
            values[flag] = True
            continue
        if has_inline:
            raw = inline
        elif i < len(args) and not args[i].startswith("--"):
            raw, i = args[i], i + 1
        else:
            raise ConfigError(f"--{flag} needs a value")
        values[flag] = _convert(flag, raw, kind, nullable)
    config = RouterConfig(
        prefill=prefill, decode=decode, **selectors, **lists,
        **{k.replace("-", "_"): v for k, v in values.items()},
    )
    config.validate()
    return config


def router_options() -> list[tuple[str, object, str, tuple[str, ...]]]:
    """Every router flag as (usage, default to show or None, help, choices): what `--help`
    prints and docs/flags.md tabulates."""
    out = []
    for f in fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "prefill":
            flag += " URL [BOOTSTRAP_PORT|none]"
        elif f.name == "decode":
            flag += " URL"
        elif flag[2:] in SELECTOR_FLAGS:
            flag += " K=V ..."
        elif flag[2:] in LIST_FLAGS:
            flag += " VALUE ..."
        default = f.default if f.default is not MISSING else None
        shown = None if f.metadata.get("special") or default in (None, False) else default
        out.append((flag, shown, str(f.metadata.get("help", "")),
                    tuple(f.metadata.get("choices") or ())))
    return out


def router_help() -> str:
    lines = [
        (
            "Usage: pdserve router --pd-disaggregation --prefill URL [BOOTSTRAP_PORT|none] ... "
            "--decode URL ... [OPTIONS]"
        ),
        "",
        "Prefill/decode router, a drop-in for sglang-router PD mode.",
        "",
    ]
    for flag, default, helptext, choices in router_options():
        shown = f" [{default}]" if default is not None else ""
        extra = f" ({'|'.join(choices)})" if choices else ""
        lines.append(f"  {flag:<34} {helptext}{extra}{shown}")
    return "\n".join(lines)


def run_router(config: RouterConfig) -> None:
    """Serve the router until interrupted (blocking)."""
    import uvicorn

    from pdcore.router.app import create_app

    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from pdcore.edge import connections, ports

    tls = ports.tls_settings(config.tls_cert_path, config.tls_key_path,
                             "--tls-cert-path", "--tls-key-path")
    app = create_app(config)
    # header / body deadlines, a connection limit that evicts the slowest first, quiet logs
    _, protocol = connections.install(app, app.state.router.metrics.registry)
    uvicorn.run(
        app, host=config.host, port=config.port, log_level=config.log_level,
        access_log=config.log_level == "debug", http=protocol,
        timeout_keep_alive=connections.keepalive_s(), **tls,
    )


def build_router_command(app: typer.Typer, name: str = "router") -> None:
    """Add the `router` command to `app`; it parses its own argv (see module docstring)."""

    @app.command(
        name,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        add_help_option=False,
        help="PD router (sglang-router compatible). Run with --help for all flags.",
    )
    def router(ctx: typer.Context) -> None:
        if any(a in ("-h", "--help") for a in ctx.args):
            typer.echo(router_help())
            raise typer.Exit(0)
        try:
            check_env()
            config = parse_router_args(ctx.args)
            if config.service_discovery:
                load_cluster_config()  # no credentials: exit 2 now, not a crash-looping watch
            check_port_free(config.host, config.port)
        except ConfigError as exc:
            # Printed by hand: a click.UsageError raised inside a typer command body is shown
            # as a traceback with exit code 1 by this typer version.
            typer.echo(f"Error: {exc}\nRun with --help to list every flag.", err=True)
            raise typer.Exit(2) from None
        run_router(config)
