"""`python -m pdcore.router ...`: the router command on its own typer app."""

from __future__ import annotations

from collections.abc import Sequence

import typer

from pdcore.router.cli import build_router_command


def main(argv: Sequence[str] | None = None) -> None:
    app = typer.Typer(add_completion=False)
    build_router_command(app)
    app(args=list(argv) if argv is not None else None, prog_name="python -m pdcore.router")


if __name__ == "__main__":
    main()
