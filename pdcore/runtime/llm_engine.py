"""`LLMEngine`: a synchronous in-process engine over token ids (tests, benchmarks): builds the
engine and, with `tp_size` > 1, spawns the other ranks and leads them in lockstep."""

from __future__ import annotations

import uuid
from typing import Any

from pdcore.config import ServerArgs
from pdcore.engine.build import build_engine
from pdcore.messages.io import GenerateReq, SamplingParams, TokenOut
from pdcore.errors import ConfigError
from pdcore.runtime.group import agree_started
from pdcore.runtime.lockstep import Lockstep
from pdcore.runtime.ranks import RankGroup
from pdcore.runtime.topology import check_parallel_args


class LLMEngine:
    """Synchronous in-process engine over token ids (no HTTP, no tokenizer). With
    `tp_size` > 1 this process is rank 0 and spawns the other ranks (pdcore.runtime.ranks)."""

    def __init__(self, args: ServerArgs) -> None:
        args.validate()
        check_parallel_args(args)
        if args.dp_size > 1:
            raise ConfigError("LLMEngine runs one replica; use `pdserve serve --dp-size N`")
        if args.nnodes > 1:
            raise ConfigError("LLMEngine runs on one node; use `pdserve serve` for --nnodes > 1")
        self.ranks = RankGroup(args)
        tp = self.ranks.start()
        error, engine = None, None
        try:
            engine = build_engine(args, tp)
        except Exception as e:
            if tp.size == 1:
                raise
            error = f"{type(e).__name__}: {e}"
        error = agree_started(tp, error) if tp.size > 1 else None
        if error:
            if engine is not None:
                engine.close()
            self.ranks.close()
            raise RuntimeError(f"TP engine failed to start: {error}")
        self.engine = engine
        self.scheduler, self.loop = self.engine.scheduler, self.engine.loop
        self.lockstep = Lockstep(self.engine)
        self._closed = False

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0) -> list[dict[str, Any]]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        msgs = [GenerateReq(uuid.uuid4().hex, list(ids), sp, return_logprob, logprob_start_len,
                            top_logprobs_num) for ids, sp in zip(prompts, params)]
        rids = [m.rid for m in msgs]
        acc: dict[str, dict[str, Any]] = {r: {"output_ids": [], "output_logprobs": [],
                                              "input_logprobs": None} for r in rids}
        pending = set(rids)
        while pending:
            for msg in self.lockstep.lead(msgs):
                self._merge(acc, msg)
                if msg.finished:
                    pending.discard(msg.rid)
            msgs = []
        return [acc[r] for r in rids]

    @staticmethod
    def _merge(acc: dict[str, dict[str, Any]], msg: TokenOut) -> None:
        a = acc.get(msg.rid)
        if a is None:
            return
        a["output_ids"].extend(msg.new_token_ids)
        a["output_logprobs"].extend(msg.output_logprobs)
        if msg.input_logprobs is not None:
            a["input_logprobs"] = msg.input_logprobs
        if msg.finished:
            a["finish_reason"], a["error"] = msg.finish_reason, msg.error

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.lockstep.lead([], stop=True)
        finally:
            self.engine.close()
            self.ranks.close()
