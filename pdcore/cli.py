"""`pdserve`: the command-line entry point (typer).

Commands: `serve` (one server; flags parsed by pdcore.server.startup.args_parser), `plugins`
(pdcore.plugins_cli), `router` (pdcore.router.cli) and `up` (pdcore.up_cli); each module adds its
own command to the app. They are imported when the app is built, not when this module is.
"""

from __future__ import annotations

import typer

from pdcore.errors import ConfigError

_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _serve(ctx: typer.Context) -> None:
    """Start one server: unified (default), prefill or decode (--disaggregation-mode).
    Run `pdserve serve --help` for every flag."""
    from pdcore.server.startup.args_parser import parse_server_args
    from pdcore.server.runner import run_server

    args = parse_server_args(list(ctx.args), prog="pdserve serve")
    try:
        rc = run_server(args)
    except ConfigError as e:
        typer.echo(f"pdserve serve: error: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(rc)


def register_commands(app: typer.Typer) -> None:
    """The commands other modules of pdcore own (`plugins`, `router`, `up`)."""
    from pdcore.plugins_cli import register_plugins_command
    from pdcore.router.cli import build_router_command
    from pdcore.up_cli import register_up_command

    for register in (register_plugins_command, build_router_command, register_up_command):
        register(app)


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
