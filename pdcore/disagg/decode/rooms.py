"""D's per-room bookkeeping: the prefill instance a room pulls from (resolved through its
bootstrap server) and what the room has received so far."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdcore.disagg import wire


@dataclass(eq=False)
class Instance:
    """One prefill instance as resolved through its bootstrap server."""

    addr: str
    instance_id: str
    dp_size: int
    tp_size: int
    targets: list[int]  # P TP ranks this D rank pulls from
    required_dst: int  # TransferInfos each target waits for (D TP > P TP)
    responses: int  # Success statuses this D rank waits for (P TP > D TP)
    ctrl_addrs: dict[tuple[int, int], str]  # (dp, tp) -> tcp://ip:port


@dataclass(eq=False)
class Room:
    room: int
    addr: str
    started: float
    fake: bool = False
    inst: Instance | None = None
    aux_slot: int = wire.NO_AUX_SLOT
    deadline: float | None = None
    confirmed: set[int] = field(default_factory=set)  # P ranks that answered its Claim
    responders: set[int] = field(default_factory=set)
    staged_by: set[int] = field(default_factory=set)  # P ranks whose KV is in the grant
    aux_payload: bytes = b""
    dst_pages: np.ndarray | None = None  # where P writes (its TransferInfo; prefix included)
    grant: tuple[int, int] | None = None  # (offset, bytes) in the staging ring
    prefix_pages: int = 0  # leading pages D's prefix cache holds: P writes none of them
    prefix_digest: str = ""
    prompt_digest: str = ""  # of the whole prompt: P prefills only for its own prompt
    prefill_dp: int | None = None  # P's DP rank the request named; None: room % P's dp size
    sent_at: float | None = None  # monotonic time TransferInfo last went to `inst`
    rebinding: bool = False  # `inst` restarted before serving the room: re-resolving its address

    def prefill_dp_of(self, inst: Instance) -> int:
        """The P DP rank holding this room's KV (SGLang's rule: room % dp unless named)."""
        return self.prefill_dp if self.prefill_dp is not None else self.room % inst.dp_size
