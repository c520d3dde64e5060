"""`python -m pdcore.launch_server --model-path ...`: SGLang's launcher name, same flags as
`pdserve serve`."""

from __future__ import annotations

import sys

from pdcore.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    from pdcore.runtime_env import apply

    apply()
    from pdcore.server.startup.args_parser import parse_server_args
    from pdcore.server.runner import run_server

    prog = "python -m pdcore.launch_server"
    args = parse_server_args(sys.argv[1:] if argv is None else argv, prog=prog)
    try:
        return run_server(args)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
