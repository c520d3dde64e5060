"""Units: a draft head's chain start in the aux rows (issue #33: D drafts from its first decode
step).

- rows without a head are what they were (no chain start part, nothing more to move);
- with a head the row grows by a 64-byte header and the vector, stays 64-byte aligned, and a
  chain start survives a raw copy P slot -> D slot bit for bit (bf16 and float32);
- hostile rows (a draft token outside the vocabulary, a non-finite vector, another position)
  are dropped with a reason; a row without a chain start reads as none;
- pairing refuses a P and D whose chain starts differ in size or dtype, naming the flags;
- D's scheduling extension (a real EAGLE engine, a stand-in KV manager playing P): a sound
  chain start makes the first decode step verify drafts, a corrupted one is dropped and
  counted and the request still finishes.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from pd_disagg_util import HostPool, TestKV

from pdcore.builtin.planner import DefaultPlanner
from pdcore.config import ServerArgs
from pdcore.disagg import wire
from pdcore.disagg.aux import ROW_BYTES, AuxBuffers, AuxRow, ChainGeometry
from pdcore.disagg.decode.sched import DecodeExtension
from pdcore.disagg.sessions import parse_register
from pdcore.disagg.states import KVPoll
from pdcore.messages.bootstrap import BootstrapInfo
from pdcore.messages.io import GenerateReq, PDRoute, SamplingParams
from pdcore.errors import ProtocolError
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.tiny_models import make_eagle_head, make_tiny_model

VOCAB, HIDDEN = 1000, 64


def _aux(dtype: torch.dtype = torch.bfloat16, slots: int = 4) -> AuxBuffers:
    return AuxBuffers(HostPool(), slots, chain=ChainGeometry(HIDDEN, dtype, VOCAB))


def _put(aux: AuxBuffers, slot: int, token: int = 7, at: int = 11,
         hidden: torch.Tensor | None = None) -> torch.Tensor:
    h = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(slot)) if hidden is None \
        else hidden
    aux.write(slot, AuxRow(room=100 + slot, first_token_id=3, prompt_tokens=at))
    aux.write_chain(slot, token, at, h)
    return h.to(aux.chain.dtype)


def test_rows_without_a_head_are_unchanged() -> None:
    aux = AuxBuffers(HostPool(), 2)
    assert aux.row_bytes == ROW_BYTES == 192 and aux.chain is None and aux.chain_bytes == 0
    assert aux.chain_info() == {"chain_hidden": 0, "chain_dtype": "", "chain_head": ""}
    aux.write(0, AuxRow(room=1, first_token_id=2))
    assert aux.read_chain(0, 5) == (None, "")
    with pytest.raises(ValueError, match="no chain start"):
        aux.write_chain(0, 1, 5, torch.zeros(HIDDEN))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chain_start_crosses_with_the_row(dtype) -> None:
    src, dst = _aux(dtype), _aux(dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    assert src.row_bytes % 64 == 0 and src.row_bytes == ROW_BYTES + 64 + HIDDEN * size
    assert src.chain_bytes == HIDDEN * size
    assert src.chain_info() == {"chain_hidden": HIDDEN, "chain_dtype": str(dtype)[6:],
                              "chain_head": ""}
    want = _put(src, 2)
    dst.write_raw(1, src.raw(2))  # what the backend (or the Status payload) does
    start, why = dst.read_chain(1, 11)
    assert why == "" and start is not None and (start.token, start.at) == (7, 11)
    assert start.hidden.dtype == dtype and torch.equal(start.hidden, want)
    assert dst.read(1).room == 102  # the base row is as it was
    dst.free(dst.alloc() or 0)  # a freed slot is cleared: no chain start left in it
    assert dst.read_chain(0, 11) == (None, "")
    # a row written again without a chain start carries none (write clears the marker)
    src.write(2, AuxRow(room=5, first_token_id=1))
    assert src.read_chain(2, 11) == (None, "")
    with pytest.raises(ValueError, match="65 values"):
        src.write_chain(2, 1, 11, torch.zeros(HIDDEN + 1))


def _corrupt(aux: AuxBuffers, slot: int, what: str) -> None:
    """Hostile bytes written straight into the row, as a broken or hostile P would."""
    raw = aux.tensor[slot].numpy()
    header = raw[ROW_BYTES : ROW_BYTES + 12].view("<i4")
    vec = aux.tensor[slot, ROW_BYTES + 64 : ROW_BYTES + 64 + aux.chain_bytes].view(
        aux.chain.dtype)
    if what == "token_high":
        header[1] = VOCAB
    elif what == "token_negative":
        header[1] = -3
    elif what == "position":
        header[2] = 10
    elif what == "nan":
        vec[5] = float("nan")
    elif what == "inf":
        vec[HIDDEN - 1] = float("-inf")


@pytest.mark.parametrize("what,words", [
    ("token_high", "draft token 1000 outside the vocabulary of 1000"),
    ("token_negative", "draft token -3 outside"),
    ("position", "made at position 10, the prompt has 11"),
    ("nan", "non-finite"), ("inf", "non-finite")])
def test_hostile_chain_start_is_dropped(what, words) -> None:
    aux = _aux()
    _put(aux, 0)
    _corrupt(aux, 0, what)
    start, why = aux.read_chain(0, 11)
    assert start is None and words in why


def _info(peer: dict) -> BootstrapInfo:  # type: ignore[type-arg]
    return BootstrapInfo.from_json(peer)  # what decode reads from P's bootstrap server


def test_pairing_refuses_another_chain_start() -> None:
    local, remote = TestKV(seed=1), TestKV()
    mine = {"chain_hidden": HIDDEN, "chain_dtype": "bfloat16"}
    peer = {"tp_size": 1, "page_size": local.layout.page_size, "kv_cache_dtype": "float32"}
    wire.check_pairing("prefill", _info({**peer, **mine}), local.layout, "", mine)
    wire.check_pairing("prefill", _info(peer), local.layout, "", mine)  # an older peer
    for theirs, said in (({"chain_hidden": 128, "chain_dtype": "bfloat16"}, "128 x bfloat16"),
                         ({"chain_hidden": HIDDEN, "chain_dtype": "float32"}, "64 x float32"),
                         ({"chain_hidden": 0, "chain_dtype": ""}, "no speculative chain")):
        with pytest.raises(ProtocolError, match=f"{said}.*--speculative-algorithm.*--dtype"):
            wire.check_pairing("prefill", _info({**peer, **theirs}), local.layout, "", mine)
    # P checks D's registration before the aux row size the chain start sets
    reg = wire.Register(
        session="d1", ctrl_addr="tcp://127.0.0.1:1", backend="tcp", endpoint=b"{}",
        layout=remote.layout.to_dict(), regions=[r.to_dict() for r in remote.regions],
        aux_region=remote.aux.region.to_dict(), aux_row_bytes=remote.aux.row_bytes,
        aux_slots=remote.aux.num_slots, rank=0, tp_size=1, page_size=remote.layout.page_size,
        dtype="float32", chain_hidden=HIDDEN, chain_dtype="float32")
    with pytest.raises(ProtocolError, match="--dtype"):
        parse_register(reg, local.layout, "tcp", local.aux.row_bytes, DefaultPlanner(), "",
                       chain=mine)
    with pytest.raises(ProtocolError, match="no speculative chain start"):
        parse_register(reg, local.layout, "tcp", local.aux.row_bytes, DefaultPlanner(), "",
                       chain=local.aux.chain_info())


def test_pairing_refuses_another_draft_head() -> None:
    """Same vector size and dtype, another head (EAGLE on P, EAGLE3 on D; or EAGLE heads with
    other weights): refused on both sides, naming the flags; an older peer naming no head is
    not compared, and a hostile long name is cut short in the reason."""
    local, remote = TestKV(seed=1), TestKV()
    geo = {"chain_hidden": HIDDEN, "chain_dtype": "float32"}
    mine = {**geo, "chain_head": "EAGLE:00112233aabbccdd"}
    peer = {"tp_size": 1, "page_size": local.layout.page_size, "kv_cache_dtype": "float32"}
    wire.check_pairing("prefill", _info({**peer, **mine}), local.layout, "", mine)
    wire.check_pairing("prefill", _info({**peer, **geo}), local.layout, "", mine)  # an older peer
    for theirs in ("EAGLE3:00112233aabbccdd", "EAGLE:ffffffffffffffff", "X" * 5000):
        with pytest.raises(ProtocolError, match="--speculative-draft-model-path") as e:
            wire.check_pairing("prefill", _info({**peer, **geo, "chain_head": theirs}),
                               local.layout, "", mine)
        assert len(str(e.value)) < 400 and "EAGLE:00112233aabbccdd" in str(e.value)
    reg = wire.Register(
        session="d1", ctrl_addr="tcp://127.0.0.1:1", backend="tcp", endpoint=b"{}",
        layout=remote.layout.to_dict(), regions=[r.to_dict() for r in remote.regions],
        aux_region=remote.aux.region.to_dict(), aux_row_bytes=remote.aux.row_bytes,
        aux_slots=remote.aux.num_slots, rank=0, tp_size=1, page_size=remote.layout.page_size,
        dtype="float32", chain_hidden=HIDDEN, chain_dtype="float32",
        chain_head="EAGLE3:00112233aabbccdd")
    with pytest.raises(ProtocolError, match="runs the draft head 'EAGLE3:"):
        parse_register(reg, local.layout, "tcp", local.aux.row_bytes, DefaultPlanner(), "",
                       chain=mine)


def test_draft_identity_names_algorithm_and_weights(tmp_path) -> None:
    from pdcore.engine.model.fingerprint import draft_identity

    def args(algo, path=None):
        return SimpleNamespace(speculative_algorithm=algo, speculative_draft_model_path=path)

    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"1" * 100)
    one = draft_identity(args("EAGLE", str(tmp_path)))
    assert one.startswith("EAGLE:") and len(one) == len("EAGLE:") + 16
    assert draft_identity(args("EAGLE3", str(tmp_path))) == "EAGLE3:" + one[6:]
    (tmp_path / "model.safetensors").write_bytes(b"2" * 100)  # other weights, same names
    assert draft_identity(args("EAGLE", str(tmp_path))) != one
    assert draft_identity(args("NEXTN")) == "NEXTN" and draft_identity(args(None)) == ""


# -- D's scheduling extension with a real EAGLE engine -----------------------------------------
class PlaysPrefill:
    """A stand-in decode KV manager: P is known at once, and the transfer 'succeeds' as soon
    as D sent its pages, with the aux row P would write (and a chain start, maybe corrupted)."""

    def __init__(self, aux: AuxBuffers, corrupt: str | None) -> None:
        self.aux, self.corrupt = aux, corrupt
        self.states: dict[int, KVPoll] = {}
        self.prompts: dict[int, int] = {}
        self.kv = SimpleNamespace(page_bytes=0)  # D's cached prefix pages count 0 bytes

    def add(self, room: int, host: str, port: int, dp: int | None = None) -> None:
        self.states[room] = KVPoll.WaitingForInput

    def send_transfer_info(self, room: int, pages: Any, slot: int, **prefix: Any) -> None:
        at = self.prompts[room]
        self.aux.write(slot, AuxRow(room=room, first_token_id=9, prompt_tokens=at))
        self.aux.write_chain(slot, 5, at, torch.randn(HIDDEN))
        if self.corrupt:
            _corrupt(self.aux, slot, self.corrupt)
        self.states[room] = KVPoll.Success

    def poll(self, room: int) -> KVPoll:
        return self.states.get(room, KVPoll.Failed)

    def failure_reason(self, room: int) -> str:
        return ""

    def abort(self, room: int, reason: str) -> None:
        self.states[room] = KVPoll.Failed

    def release(self, room: int) -> None:
        self.states.pop(room, None)

    def peer_fault(self, room: int) -> bool:
        return False

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def eagle_engine(tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("chain")
    model = make_tiny_model(str(root / "m"), seed=13, hidden=HIDDEN)
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    head = make_eagle_head(str(root / "h"), vocab=vocab, hidden=HIDDEN, seed=1)
    os.environ["PDSERVE_SPEC_GATE"] = "0"
    try:
        eng = LLMEngine(ServerArgs(model_path=model, max_total_tokens=512, page_size=4,
                                   speculative_algorithm="EAGLE",
                                   speculative_draft_model_path=head, speculative_num_steps=3))
    finally:
        os.environ.pop("PDSERVE_SPEC_GATE", None)
    try:
        yield eng, vocab
    finally:
        eng.close()


@pytest.mark.parametrize("corrupt", [None, "nan", "token_high"])
def test_decode_adopts_a_sound_chain_start_and_drops_a_hostile_one(eagle_engine,
                                                                   corrupt) -> None:
    eng, vocab = eagle_engine
    sched = eng.scheduler
    from pdcore.engine.sched.api import SchedulerAPI

    geo = SchedulerAPI(sched).chain_geometry()
    assert geo is not None and geo[0] == HIDDEN and geo[2] == vocab
    aux = AuxBuffers(HostPool(), 4, chain=ChainGeometry(*geo))
    mgr = PlaysPrefill(aux, corrupt)
    ext = DecodeExtension(sched, mgr, aux, ServerArgs(disaggregation_mode="decode"))
    old, sched.ext = sched.ext, ext
    try:
        first = {None: 3, "nan": 40, "token_high": 80}[corrupt]  # no prefix cache hits
        prompt = list(np.arange(first, first + 11))
        mgr.prompts[77] = len(prompt)
        req = GenerateReq("r", [int(t) for t in prompt],
                          SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
                          route=PDRoute(host="127.0.0.1", port=1, room=77))
        seen: list[Any] = []
        out = eng.lockstep.lead([req])
        for _ in range(50):
            seen += out
            if any(m.finished for m in out):
                break
            out = eng.lockstep.lead([])
        done = [m for m in seen if m.finished]
        assert done and done[0].error is None, seen
        tokens = [t for m in seen for t in m.new_token_ids]
        assert tokens[0] == 9 and len(tokens) == 3  # P's first token, then D's two
        c = ext.counts
        if corrupt is None:
            assert (c["chain_starts_received"], c["chain_starts_dropped"]) == (1, 0)
            assert done[0].spec_verify_ct >= 1  # the first decode step verified a draft
        else:
            assert (c["chain_starts_received"], c["chain_starts_dropped"]) == (0, 1)
            assert done[0].spec_verify_ct == 0  # no drafts on the first step, no room after
    finally:
        sched.ext = old
