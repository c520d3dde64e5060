"""Where the TP ranks are: the checks on --tp-size / --nnodes / --node-rank / --dist-init-addr /
--dp-size (those of --dp-size: pdcore.runtime.dp.args), which ranks this node runs, and where the
ranks meet."""

from __future__ import annotations

from pdcore.config import ServerArgs
from pdcore.engine.parallel.dp_attention_args import new_init_method
from pdcore.errors import ConfigError
from pdcore.runtime.dp.args import check_dp_args


def check_parallel_args(args: ServerArgs) -> None:
    """What --tp-size / --nnodes / --node-rank / --dist-init-addr / --dp-size must satisfy."""
    if args.dp_size > 1:
        check_dp_args(args)
    if args.enable_dp_attention or args.enable_dp_lm_head:
        from pdcore.engine.parallel.dp_attention_args import check_args

        check_args(args)
    if args.tp_size % args.nnodes:
        raise ConfigError(f"--tp-size {args.tp_size} must be a multiple of --nnodes "
                          f"{args.nnodes} (every node runs the same number of ranks)")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, "
                          "where the ranks meet); give every node the same value")
    if args.dist_init_addr:
        split_addr(args.dist_init_addr)


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def local_ranks(args: ServerArgs) -> range:
    per_node = args.tp_size // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def init_method(args: ServerArgs) -> str:
    if args.dist_init_addr:
        host, port = split_addr(args.dist_init_addr)
        if args.dp_size > 1 and not args.enable_dp_attention:
            port += args.dp_rank  # each replica's TP group meets at its own port
        return f"tcp://{host}:{port}"
    return new_init_method()  # one node: a file store, passed to the children
