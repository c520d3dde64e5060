"""Registers `pdserve up` on the typer app."""

from __future__ import annotations

import typer

from pdcore.errors import ConfigError


def register_up_command(app: typer.Typer) -> None:
    @app.command("up", context_settings={"allow_extra_args": True,
                                         "ignore_unknown_options": True})
    def up(
        ctx: typer.Context,
        prefill: int = typer.Option(1, help="number of prefill servers"),
        decode: int = typer.Option(1, help="number of decode servers"),
        backend: str = typer.Option(None, help="transfer backend (default: shm on one host)"),
        model_path: str = typer.Option(None, help="model folder or .gguf (default SmolLM2)"),
        host: str = typer.Option("127.0.0.1", help="address every process binds"),
        *, port: int = typer.Option(8000, help="router port"),
        server_port_base: int = typer.Option(30000, help="first server port"),
        bootstrap_port_base: int = typer.Option(8998, help="first prefill bootstrap port"),
        policy: str = typer.Option("round_robin", help="router policy"),
        routers: int = typer.Option(1, help="routers over the same servers, on --port, "
                                    "--port + 1, ...: each serves any request"),
        startup_timeout: float = typer.Option(600.0, help="seconds to wait for readiness"),
        state_dir: str = typer.Option(None, help="where the drawn admin key is written, 0600 "
                                      "(default $XDG_RUNTIME_DIR/pdserve/up-PORT, else "
                                      "~/.local/state/pdserve/up-PORT)"),
    ) -> None:
        """Start N prefill + M decode servers and the router on this machine; extra flags go
        to every `pdserve serve`."""
        from pdcore.up import UpConfig, run_up

        cfg = UpConfig(prefill, decode, backend, model_path, host, port, server_port_base,
                       bootstrap_port_base, policy, startup_timeout, list(ctx.args),
                       state_dir=state_dir, routers=routers)
        try:
            rc = run_up(cfg)
        except ConfigError as e:
            typer.echo(f"pdserve up: error: {e}", err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(rc)
