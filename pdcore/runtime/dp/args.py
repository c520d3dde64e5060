"""What `--dp-size` > 1 must satisfy (called by pdcore.runtime.topology.check_parallel_args)."""

from __future__ import annotations

from pdcore.config import ServerArgs
from pdcore.errors import ConfigError


def check_dp_args(args: ServerArgs) -> None:
    """--dp-size > 1: with DP attention the DP ranks are one rank group spread over the nodes
    (pdcore.runtime.dp.nodes); without it each replica is its own TP group, which with
    --nnodes > 1 spans every node as in SGLang (node R runs ranks of every replica; replica r's
    group meets at the --dist-init-addr port + r; in PD mode each replica is its own endpoint of
    the PD control plane: pdcore.runtime.dp.client)."""
    if args.enable_dp_attention:
        if args.nnodes > 1 and args.dp_size % args.nnodes:
            # every DP rank's attention ranks on one node (pdcore.runtime.dp.nodes's layout)
            raise ConfigError(
                f"--enable-dp-attention over --nnodes {args.nnodes}: --dp-size {args.dp_size} "
                "must be a multiple of --nnodes, so that every DP rank's attention ranks are on "
                "one node")
        return
    if args.dist_init_addr and args.nnodes == 1:
        raise ConfigError("--dp-size > 1 on one node needs no --dist-init-addr (each replica's "
                          "ranks meet on this node); drop it, or give --nnodes > 1")
