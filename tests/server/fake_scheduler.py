"""A stand-in scheduler process speaking the real zmq protocol (pdcore.messages.io).

Deterministic echo model: output token i is input_ids[i % len(input_ids)]; after echoing the
prompt once it emits EOS (unless ignore_eos), so the generated text equals the prompt text.
It keeps page accounting like the real pool (a request holds ceil(tokens / page_size) pages
until it finishes or is aborted) so tests can check that aborts free pages.
Env: FAKE_TOKEN_DELAY (seconds per decode step, default 0.005), FAKE_NUM_PAGES (default 4096).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdcore.messages.io import AbortReq, ControlReq, ControlResp, GenerateReq, TokenOut
from pdcore.messages.stats import Kind, StatsReport


@dataclass
class _Running:
    req: GenerateReq
    out: list[int] = field(default_factory=list)
    first: bool = True


def run_fake_scheduler(args: Any, recv_addr: str, send_addr: str, ready_conn: Any) -> None:
    with open(os.path.join(args.model_path, "config.json")) as f:
        cfg = json.load(f)
    vocab = int(cfg["vocab_size"])
    eos = cfg.get("eos_token_id", 2)
    eos_ids = eos if isinstance(eos, list) else [eos]
    num_pages = int(os.environ.get("FAKE_NUM_PAGES", "4096"))
    delay = float(os.environ.get("FAKE_TOKEN_DELAY", "0.005"))
    page = args.page_size
    ctx_len = args.context_length or int(cfg.get("max_position_embeddings", 4096))
    time.sleep(float(os.environ.get("FAKE_READY_DELAY", "0")))
    if os.environ.get("FAKE_READY_FAIL"):
        ready_conn.send({"ok": False, "error": os.environ["FAKE_READY_FAIL"]})
        return
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    pull.bind(recv_addr)
    push = zctx.socket(zmq.PUSH)
    push.connect(send_addr)
    ready_conn.send({"ok": True, "info": {
        "model_path": os.path.abspath(args.model_path), "tokenizer_path":
        os.path.abspath(args.tokenizer_path or args.model_path),
        "served_model_name": args.served_model_name or os.path.basename(args.model_path),
        "context_length": ctx_len, "max_total_tokens": num_pages * page, "page_size": page,
        "num_pages": num_pages, "vocab_size": vocab, "eos_token_ids": eos_ids,
        "dtype": "float32", "device": "cpu", "architectures": ["LlamaForCausalLM"],
        "model_type": "llama", "disaggregation_mode": args.disaggregation_mode,
        "tp_size": 1, "dp_size": 1, "bootstrap_port": args.disaggregation_bootstrap_port}})
    ready_conn.close()
    running: dict[str, _Running] = {}
    seen: list[GenerateReq] = []  # for the "last_requests" control call

    def pages_used() -> int:
        return sum(math.ceil((len(r.req.input_ids) + len(r.out)) / page) for r in running.values())

    def load() -> dict[str, Any]:
        return {"num_reqs": len(running), "num_waiting_reqs": 0,
                "num_tokens": sum(len(r.req.input_ids) + len(r.out) for r in running.values()),
                "num_pages_free": num_pages - pages_used(), "num_pages_used": pages_used(),
                "num_pages": num_pages}

    while True:
        timeout_ms = 0 if running else 50
        while pull.poll(timeout_ms):
            timeout_ms = 0
            msg = pull.recv_pyobj()
            if isinstance(msg, GenerateReq):
                for r in (msg, *msg.forks):  # a decode server's parallel samples ride along
                    running[r.rid] = _Running(r)
                seen.append(msg)
                del seen[:-64]
            elif isinstance(msg, AbortReq):
                running.pop(msg.rid, None)
            elif isinstance(msg, ControlReq):
                data: Any = {}
                if msg.kind == "get_load":
                    data = load()
                elif msg.kind == "stats":  # a StatsReport, as the real scheduler answers
                    data = StatsReport().add(Kind.LOAD, {**load(), "num_running_reqs":
                                                         len(running), "num_waiting_reqs": 0})
                elif msg.kind == "last_requests":
                    data = {"reqs": [vars(r) | {"sampling": vars(r.sampling),
                                                 "route": r.route and vars(r.route)}
                                     for r in seen]}
                elif msg.kind == "flush_cache":  # the real scheduler's answer when idle
                    data = {"flushed": True, "freed_pages": 0}
                elif msg.kind in ("start_profile", "stop_profile"):
                    data = {"args": msg.args}
                push.send_pyobj(ControlResp(msg.call_id, True, data))
        step: list[TokenOut] = []  # sent as one message, as the real scheduler sends a step's
        for rid, r in list(running.items()):
            req, sp = r.req, r.req.sampling
            ids = req.input_ids
            if sp.max_new_tokens == 0:
                tok = None
            elif len(r.out) == len(ids) and not sp.ignore_eos:
                tok = eos_ids[0]
            else:
                tok = ids[len(r.out) % len(ids)]
            out = TokenOut(rid=rid, new_token_ids=[] if tok is None else [tok])
            if tok is not None:
                r.out.append(tok)
                if req.return_logprob:
                    top = ([(-0.05, tok), (-3.0, (tok + 1) % vocab)][: req.top_logprobs_num]
                           if req.top_logprobs_num else None)
                    out.output_logprobs = [(-0.05 * len(r.out), tok, top)]
            if r.first:
                out.prompt_tokens = len(ids)
                r.first = False
                if req.return_logprob and req.logprob_start_len >= 0:
                    out.input_logprobs = [(None if i == 0 else -1.0 * i, t, None)
                                          for i, t in enumerate(ids)
                                          if i >= req.logprob_start_len]
            if tok is None or len(r.out) >= sp.max_new_tokens:
                out.finished, out.finish_reason = True, {"type": "length",
                                                         "length": len(r.out)}
            elif tok in eos_ids and not sp.ignore_eos or tok in sp.stop_token_ids:
                out.finished, out.finish_reason = True, {"type": "stop", "matched": tok}
            if out.finished:
                del running[rid]
            step.append(out)
        if step:
            push.send_pyobj(step)
        if running:
            time.sleep(delay)
