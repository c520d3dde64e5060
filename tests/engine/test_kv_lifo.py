"""The KV free list is a stack (engine/kv/blocks.py): the page freed last is handed out first,
so a server touches only the pool pages its busiest moment needed. The attack: a reused page
still holds its last owner's K/V, and no request may ever attend it."""

from __future__ import annotations

import torch

from pdcore.config import ServerArgs
from pdcore.engine.kv.blocks import BlockManager
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model


def test_free_list_is_lifo_and_untouched_pages_come_in_order() -> None:
    b = BlockManager(8, 4)
    assert b.alloc(3) == [0, 1, 2]  # never used: ascending
    a = b.alloc(2)
    assert a == [3, 4]
    b.free([0, 1, 2])
    assert b.alloc(2) == [2, 1]  # the freed ones first, the last freed first
    b.free(a)
    assert b.alloc(4) == [4, 3, 0, 5]  # then the older freed page, then a never used one
    assert b.num_free == 2 and b.alloc(2) == [6, 7]
    b.ref([6])
    b.free([6])
    assert b.num_free == 0  # still held once: not free
    b.free([6])
    assert b.alloc(1) == [6]


def test_reused_pages_never_leak_the_last_owner_kv(tmp_path) -> None:
    """Request A fills pages and finishes; every free page of every layer's K and V is then
    poisoned (a large finite value: a masked read stays harmless, an attended one changes
    everything). B, run next, gets A's pages back (LIFO, no prefix cache) including stale
    tails of partly written pages that its decode grows into; its tokens and logprobs equal
    B's on a fresh engine, to the bit."""
    path = make_tiny_model(str(tmp_path / "m"), arch="llama", vocab_size=512, seed=21)
    g = torch.Generator().manual_seed(3)
    prompt_a = torch.randint(3, 512, (61,), generator=g).tolist()
    prompt_b = torch.randint(3, 512, (23,), generator=g).tolist()  # 23: a page part-filled
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    args = dict(model_path=path, max_total_tokens=1024, page_size=8, disable_radix_cache=True)

    fresh = LLMEngine(ServerArgs(**args))
    try:
        want = fresh.generate([prompt_b], sp, return_logprob=True)[0]
    finally:
        fresh.close()

    eng = LLMEngine(ServerArgs(**args))
    try:
        blocks = eng.scheduler.blocks
        seen: list[int] = []
        real_alloc = blocks.alloc

        def spy(n: int) -> list[int]:
            out = real_alloc(n)
            seen.extend(out)
            return out

        blocks.alloc = spy
        eng.generate([prompt_a], sp)
        a_pages = set(seen)
        assert len(a_pages) >= blocks.pages_for(len(prompt_a) + 11) and pages_at_rest(eng.scheduler)
        free = torch.tensor(sorted(blocks._free))
        for k, v in eng.engine.kv.layers:
            k[free] = 1e4
            v[free] = -1e4
        seen.clear()
        got = eng.generate([prompt_b], sp, return_logprob=True)[0]
        blocks.alloc = real_alloc
        # B ran on A's pages only, the poisoned bytes among them
        assert seen and set(seen) <= a_pages, (seen, sorted(a_pages))
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert got["output_ids"] == want["output_ids"]
    assert [lp[0] for lp in got["output_logprobs"]] == [lp[0] for lp in want["output_logprobs"]]
