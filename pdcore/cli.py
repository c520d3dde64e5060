"""`pdserve`: the command-line entry point (typer).

Commands: `serve` (one server; flags generated from ServerArgs), `plugins` (pdcore.plugins_cli),
`router` (pdcore.router.cli). More commands (`up`, `bench`, ...) plug in through
`register_commands` below: add a `(module, function)` pair to _COMMAND_REGISTRARS; the function
takes the typer app and adds its command. Modules are imported when the app is built, not when
this module is imported.
"""

from __future__ import annotations

import importlib

import typer

from pdcore.errors import ConfigError

# (module, function(app)) pairs adding commands owned by other packages of pdcore.
_COMMAND_REGISTRARS: list[tuple[str, str]] = [
    ("pdcore.plugins_cli", "register_plugins_command"),
    ("pdcore.router.cli", "build_router_command"),
    ("pdcore.up_cli", "register_up_command"),
]

_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _serve(ctx: typer.Context) -> None:
    """Start one server: unified (default), prefill or decode (--disaggregation-mode).
    Run `pdserve serve --help` for every flag."""
    from pdcore.server.args_parser import parse_server_args
    from pdcore.server.runner import run_server

    args = parse_server_args(list(ctx.args), prog="pdserve serve")
    try:
        rc = run_server(args)
    except ConfigError as e:
        typer.echo(f"pdserve serve: error: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(rc)


def register_commands(app: typer.Typer) -> None:
    for module, func in _COMMAND_REGISTRARS:
        getattr(importlib.import_module(module), func)(app)


def build_app() -> typer.Typer:
    app = typer.Typer(name="pdserve", no_args_is_help=True, add_completion=False,
                      help="pdserve: prefill/decode disaggregated LLM serving.")

    @app.callback()
    def _root() -> None:
        """pdserve: prefill/decode disaggregated LLM serving."""

    app.command("serve", context_settings=_PASSTHROUGH, add_help_option=False)(_serve)
    register_commands(app)
    return app


def main() -> None:
    from pdcore.runtime_env import apply

    apply()  # before anything loads torch
    build_app()()
