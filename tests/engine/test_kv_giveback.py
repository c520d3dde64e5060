"""#48: at idle the engine hands the KV pool's free, written pages back to the kernel
(engine/kv/giveback.py, ModelRunner.release_caches). The attacks: the pool's resident pages drop
(mincore), a page the prefix cache holds keeps its K/V to the bit and still serves a hit, and
the next request after the give-back generates what a fresh engine does; the bytes given back
are on the stats report and /metrics (pdserve_kv_pages_given_back_bytes_total)."""

from __future__ import annotations

import ctypes
import mmap

import torch

from pdcore.config import ServerArgs
from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.build import build_engine
from pdcore.engine.kv import giveback
from pdcore.engine.kv.giveback import runs
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.server.metrics import ServerMetrics
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model

PS = 16  # 16 positions x 2 KV heads x head_dim 64 x 4 bytes: 8 KiB, two whole OS pages
SP = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def resident_pages(t: torch.Tensor) -> int:
    """OS pages of tensor `t`'s memory resident now (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    end = t.data_ptr() + t.numel() * t.element_size()
    n = -(-(end - start) // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(n)
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def pool_resident(eng: LLMEngine) -> int:
    return sum(resident_pages(k) + resident_pages(v) for k, v in eng.engine.kv.layers)


def _model(tmp_path) -> str:
    return make_tiny_model(str(tmp_path / "m"), arch="llama", vocab_size=512, seed=5,
                           hidden=256, heads=4, kv_heads=2)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (150, 61, 23)]


def test_runs_and_written_pages() -> None:
    assert runs([5, 1, 2, 3, 9, 8]) == [(1, 4), (5, 6), (8, 10)]
    b = BlockManager(8, 4)
    a = b.alloc(3)
    b.ref([a[1]])
    b.free(a)
    assert sorted(b.take_free_written()) == [a[0], a[2]]  # a[1] is still held
    assert b.take_free_written() == []
    b.free([a[1]])
    assert b.take_free_written() == [a[1]]


def test_idle_gives_free_pages_back_and_the_next_request_is_unchanged(tmp_path) -> None:
    path = _model(tmp_path)
    big, _, small = _prompts()
    args = dict(model_path=path, max_total_tokens=2048, page_size=PS, disable_radix_cache=True)
    fresh = LLMEngine(ServerArgs(**args))
    try:
        want = fresh.generate([small], SP, return_logprob=True)[0]
    finally:
        fresh.close()
    eng = LLMEngine(ServerArgs(**args))
    try:
        eng.generate([big, big[::-1]], SP)
        assert pages_at_rest(eng.scheduler)
        before = pool_resident(eng)
        # 2 x 162 tokens of K/V in 2 layers x (K, V), 8 KiB a page: 2 x 11 pages x 4 buffers x 2
        assert before >= 2 * 10 * 4 * 2, before
        eng.loop.release_caches()
        after = pool_resident(eng)
        assert after <= 4, (before, after)  # all pages are free: nothing written stays
        assert eng.loop.runner.model_runner.given_back >= (before - after) * mmap.PAGESIZE
        got = eng.generate([small], SP, return_logprob=True)[0]
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert got["output_ids"] == want["output_ids"]
    assert got["output_logprobs"] == want["output_logprobs"]


def test_pages_the_prefix_cache_holds_keep_their_kv(tmp_path) -> None:
    path = _model(tmp_path)
    big, mid, _ = _prompts()
    args = dict(model_path=path, max_total_tokens=2048, page_size=PS)
    fresh = LLMEngine(ServerArgs(**args, disable_radix_cache=True))
    try:
        want = fresh.generate([big + mid], SP)[0]
    finally:
        fresh.close()
    eng = LLMEngine(ServerArgs(**args))
    try:
        eng.generate([big, mid], SP)
        blocks, kv = eng.scheduler.blocks, eng.engine.kv
        held = [p for p in range(blocks.num_pages) if blocks.refcount(p) > 0]
        assert held and pages_at_rest(eng.scheduler)
        snap = [(k[held].clone(), v[held].clone()) for k, v in kv.layers]
        assert all(k.abs().sum() > 0 for k, _ in snap)
        before = pool_resident(eng)
        eng.loop.release_caches()
        assert eng.loop.runner.model_runner.given_back > 0  # the unaligned tails were free pages
        assert pool_resident(eng) < before
        for (k, v), (k0, v0) in zip(kv.layers, snap):
            assert torch.equal(k[held], k0) and torch.equal(v[held], v0)
        # big's cached pages are the next prompt's prefix: it hits them
        assert len(eng.scheduler.cache.match(big + mid, len(big), touch=False)) == len(big) // PS
        got = eng.generate([big + mid], SP)[0]
    finally:
        eng.close()
    assert got["output_ids"] == want["output_ids"]


GIVEN = "pdserve_kv_pages_given_back_bytes_total"


def _scraped(report) -> dict[str, float]:
    """The unlabelled samples of /metrics rendered from `report`, and `TYPE <name>` -> 0 for
    a counter, 1 otherwise."""
    m = ServerMetrics()
    m.update_from_stats(report)
    text = m.render().decode()
    assert "# HELP " + GIVEN + " Bytes of free KV pool pages handed back to the kernel" in text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            out["TYPE " + line.split()[2]] = float(line.split()[3] != "counter")
        elif line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_the_bytes_given_back_at_idle_are_on_metrics(tmp_path) -> None:
    big, mid, _ = _prompts()
    eng = LLMEngine(ServerArgs(model_path=_model(tmp_path), max_total_tokens=2048, page_size=PS,
                               disable_radix_cache=True))
    try:
        eng.loop.release_caches()  # idle before any request: nothing written, nothing given
        cold = eng.loop.stats()
        assert cold["kv_pages_given_back_bytes_total"] == 0
        assert "kv_pages_given_back_bytes_total" in cold.counters()
        scraped = _scraped(cold)
        assert scraped[GIVEN] == 0 and scraped["TYPE " + GIVEN] == 0  # a counter
        assert not any(k.startswith("pdserve_scheduler_kv_pages_given") for k in scraped)
        eng.generate([big, mid], SP)
        assert eng.loop.stats()["kv_pages_given_back_bytes_total"] == 0  # not idle yet
        eng.loop.release_caches()
        given = eng.loop.runner.model_runner.given_back
        assert given > 0
        warm = eng.loop.stats()
        assert warm["kv_pages_given_back_bytes_total"] == given
        assert _scraped(warm)[GIVEN] == given
        eng.generate([mid], SP)
        eng.loop.release_caches()  # a second idle adds its bytes: a counter, never reset
        assert eng.loop.stats()["kv_pages_given_back_bytes_total"] > given
    finally:
        eng.close()


def test_a_pd_server_never_gives_pages_back(tmp_path) -> None:
    """A prefill or decode server's pool is registered with a transfer backend: an RDMA
    registration pins the physical pages, and a page advised away would fault back in as other
    memory than the NIC writes. Built as a decode or prefill server, the runner gives nothing
    back at idle, its free written pages staying resident; a unified server does (the attack:
    before, every server gave pages back)."""
    model = _model(tmp_path)
    for mode, gives in (("null", True), ("decode", False), ("prefill", False)):
        assert giveback.allowed(mode) is gives
        eng = build_engine(ServerArgs(model_path=model, max_total_tokens=256, page_size=PS,
                                      disaggregation_mode=mode))
        try:
            mr = eng.loop.runner.model_runner
            assert mr.give_back_pages is gives, mode
            pages = eng.blocks.alloc(4)
            for k, v in eng.kv.layers:  # the steps' K/V writes, then the pages come free
                for t in (k, v):
                    t.view(t.shape[0], -1)[pages] = 1.0
            eng.blocks.free(pages)
            before = sum(resident_pages(k) + resident_pages(v) for k, v in eng.kv.layers)
            mr.release_caches()
            after = sum(resident_pages(k) + resident_pages(v) for k, v in eng.kv.layers)
            assert (mr.given_back > 0 and after < before) if gives else \
                (mr.given_back == 0 and after == before), (mode, before, after, mr.given_back)
        finally:
            eng.close()


def _segment_bytes(pid: int) -> int:
    """Bytes /dev/shm holds for this process's shm pool segments (tmpfs blocks allocated)."""
    from pathlib import Path

    return sum(p.stat().st_blocks * 512 for p in Path("/dev/shm").glob(f"pdserve_*_{pid}_*"))


def test_a_shm_pools_reservation_is_kept(tmp_path) -> None:
    """A unified server may run its pool in /dev/shm (--memory-pool shm). Its segments are
    reserved whole at start (posix_fallocate: a full /dev/shm fails the start, never a later
    write with SIGBUS); MADV_REMOVE would free the written pages only by giving that
    reservation up, and DONTNEED frees nothing there. So idle hands nothing back: the segments'
    allocated bytes stay whole (the attack: a give-back by MADV_REMOVE drops them) and the next
    request still generates what a fresh engine does."""
    import os

    path = _model(tmp_path)
    big, _, small = _prompts()
    args = dict(model_path=path, max_total_tokens=2048, page_size=PS, disable_radix_cache=True,
                memory_pool="shm")
    fresh = LLMEngine(ServerArgs(**args))
    try:
        want = fresh.generate([small], SP, return_logprob=True)[0]
    finally:
        fresh.close()
    eng = LLMEngine(ServerArgs(**args))
    try:
        kv = eng.engine.kv
        assert kv.pool.name == "shm"
        whole = sum(t.numel() * t.element_size() for k, v in kv.layers for t in (k, v))
        eng.generate([big, big[::-1]], SP)
        assert _segment_bytes(os.getpid()) >= whole
        eng.loop.release_caches()
        assert eng.loop.runner.model_runner.given_back == 0
        assert _segment_bytes(os.getpid()) >= whole  # every page still reserved
        got = eng.generate([small], SP, return_logprob=True)[0]
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert got["output_ids"] == want["output_ids"]
    assert got["output_logprobs"] == want["output_logprobs"]
