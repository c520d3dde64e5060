"""`--enable-dp-attention` across nodes (`--nnodes N`): where each DP rank lives and how node 0's
HTTP process reaches the DP ranks of the other nodes.

Layout (SGLang's): the T = `--tp-size` ranks are spread over N nodes, T/N consecutive ranks per
node; DP rank d owns ranks d*A .. d*A+A-1 (A = T / `--dp-size`). With `--dp-size` a multiple of
N every DP rank lies on one node (the check in pdcore.runtime.dp.args), so each node runs whole
DP ranks: node 0 the first D/N of them, next to its HTTP process, node R the next D/N.

Link: node 0 is the only request dispatcher (pdcore.runtime.dp.remote). For each DP rank d
of another node it binds two zmq sockets on the `--dist-init-addr` host, at that address's port
+ 1 + 2d (requests to the scheduler) and + 2 + 2d (outputs from it). Node R's scheduler process
of DP rank d (`run_remote_scheduler`) connects both, says hello, and receives the DP rank's
server arguments from node 0 (one source of truth: the init address, the PD route secret, the DP
rank), keeping only what is its own node's (its host, its node rank, its local accelerators).
From then on it is an ordinary scheduler process (pdcore.runtime.scheduler_process) whose ready
message and outputs travel over those sockets.

Failure: node 0 watches each link's TCP connection (zmq's socket monitor, TCP keep-alive probes
for a silent peer) and fails the server's requests when one drops; the DP ranks' per-iteration
collectives also break at once when any rank's process dies (pdcore.engine.parallel.dp_attention).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from typing import Any

from pdcore.config import ServerArgs
from pdcore.errors import ConfigError
from pdcore.runtime.topology import split_addr

log = logging.getLogger(__name__)

HELLO_RESEND_S = 1.0


def attention_size(args: ServerArgs) -> int:
    return args.tp_size // args.dp_size


def per_node(args: ServerArgs) -> int:
    return args.tp_size // args.nnodes


def leader_node(args: ServerArgs, dp_rank: int) -> int:
    """The node that runs DP rank `dp_rank` (all of its ranks: see the module docstring)."""
    return dp_rank * attention_size(args) // per_node(args)


def node_dp_ranks(args: ServerArgs, node: int) -> list[int]:
    return [d for d in range(args.dp_size) if leader_node(args, d) == node]


def multi_node(args: ServerArgs) -> bool:
    return bool(args.enable_dp_attention) and args.dp_size > 1 and args.nnodes > 1


def link_addrs(args: ServerArgs, dp_rank: int) -> tuple[str, str]:
    """(to the scheduler, from the scheduler) of a DP rank on another node."""
    host, port = split_addr(args.dist_init_addr)
    shown = f"[{host}]" if ":" in host else host
    to_port, from_port = port + 1 + 2 * dp_rank, port + 2 + 2 * dp_rank
    if from_port > 65535:
        raise ConfigError(f"--dist-init-addr port {port} leaves no room for the DP links "
                          f"(ports up to {port + 2 * args.dp_size} are used); pick a lower one")
    return f"tcp://{shown}:{to_port}", f"tcp://{shown}:{from_port}"


def own_args(node0: ServerArgs, mine: ServerArgs, dp_rank: int) -> ServerArgs:
    """Node 0's arguments for DP rank `dp_rank`, with this node's own host, rank and devices."""
    first_local = dp_rank * attention_size(mine) - mine.node_rank * per_node(mine)
    return dataclasses.replace(node0, host=mine.host, node_rank=mine.node_rank,
                               base_gpu_id=mine.base_gpu_id + first_local)


def set_keepalive(sock: Any) -> None:
    """A peer that vanishes without closing its connection is noticed within ~15 s."""
    import zmq

    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 5)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 2)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 4)


class _SocketReady:
    """The ready pipe of a scheduler on another node: its ready message goes over the link."""

    def __init__(self, send: Any) -> None:
        self.send_sock = send

    def send(self, msg: dict[str, Any]) -> None:
        self.send_sock.send(pickle.dumps(msg))


def run_remote_scheduler(mine: ServerArgs, dp_rank: int, timeout_s: float) -> None:
    """Entry point (spawned on node R > 0) of DP rank `dp_rank`'s scheduler process."""
    import zmq

    from pdcore.runtime.lifeline import die_with_parent
    from pdcore.runtime.scheduler_process import serve_scheduler

    die_with_parent()
    logging.basicConfig(level=getattr(logging, mine.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s [dp{dp_rank}] %(name)s: %(message)s")
    to_addr, from_addr = link_addrs(mine, dp_rank)
    ctx = zmq.Context()
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (recv, send):
        set_keepalive(s)
    send.setsockopt(zmq.LINGER, 1000)
    recv.connect(to_addr)
    send.connect(from_addr)
    hello = pickle.dumps({"hello": dp_rank, "node": mine.node_rank})
    deadline = time.monotonic() + timeout_s
    node0: ServerArgs | None = None
    while node0 is None:
        if time.monotonic() > deadline:
            log.error("DP rank %d: node 0 (%s) sent no arguments within %.0fs; is node 0 "
                      "running with the same --dist-init-addr?", dp_rank, to_addr, timeout_s)
            ctx.destroy(0)
            raise SystemExit(1)
        send.send(hello)  # zmq queues it until node 0 binds; a resend covers node 0 restarts
        if recv.poll(int(HELLO_RESEND_S * 1000)):
            msg = pickle.loads(recv.recv())
            if isinstance(msg, ServerArgs):
                node0 = msg
    log.info("DP rank %d: linked to node 0 at %s / %s", dp_rank, to_addr, from_addr)
    if not serve_scheduler(own_args(node0, mine, dp_rank), ctx, recv, send, _SocketReady(send)):
        raise SystemExit(1)  # node 0 got the error; this node's process exits 1 too
