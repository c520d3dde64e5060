"""Parallel samples (n > 1) that share one prompt's KV pages.

A follower starts from its leader's prompt: every page before the one holding the last prompt
position is shared (one more reference each); the page holding the last position is copied into
a page of the follower's own on every layer, K and V. The follower then recomputes the last
prompt position and samples its first token with its own sampler state, as a request of its own
would from the prompt's last logits; the copy means that rewrite (and every token it appends)
lands in its own page, never in bytes the leader reads. With TP every rank runs the same
schedule, so each rank copies its own shard of the page.

When no page is free for the copy, the follower shares the full pages only and recomputes the
rest of the prompt (fewer than page_size positions) once the scheduler finds it a page.
"""

from __future__ import annotations

import torch

from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.sched.request import Req

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


def shared_pages(blocks: BlockManager, prompt_len: int) -> int:
    """Pages of a prompt that no sample ever writes again: those before the last position's."""
    return (prompt_len - 1) // blocks.page_size


def follower_pages(blocks: BlockManager, prompt_len: int, extra_tokens: int) -> int:
    """Pages a follower allocates itself to hold its prompt plus `extra_tokens` more."""
    return blocks.pages_for(prompt_len + extra_tokens) - shared_pages(blocks, prompt_len)


def copy_page(layers: KVLayers, src: int, dst: int) -> None:
    for k, v in layers:
        k[dst].copy_(k[src])
        v[dst].copy_(v[src])


@torch.inference_mode()
def fork(blocks: BlockManager, layers: KVLayers, leader: Req, follower: Req) -> bool:
    """Give `follower` (no pages yet, same prompt) the leader's prompt KV. True: it holds the
    whole prompt but its last position, which its next forward recomputes. False: no page
    was free; it holds the shared pages only and must be filled from there by the scheduler.
    The leader must hold its prompt's KV (all of it) and nothing else may have run on it."""
    if follower.pages or follower.prompt != leader.prompt:
        raise ValueError(f"{follower.rid} cannot fork from {leader.rid}: it must be a fresh "
                         f"request with the same prompt")
    n = len(leader.prompt)
    s = shared_pages(blocks, n)
    follower.pages = blocks.ref(leader.pages[:s])
    follower.ctx_slots = None  # the slot table is rebuilt from the pages on the next forward
    if not blocks.can_alloc(1):
        follower.num_computed = s * blocks.page_size
        return False
    own = blocks.alloc(1)[0]
    copy_page(layers, leader.pages[s], own)
    follower.pages.append(own)
    follower.num_computed = n - 1
    return True
