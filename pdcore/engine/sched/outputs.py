"""The scheduler's messages to the HTTP side: what each request has produced since its last one
(TokenOut)."""

from __future__ import annotations

from pdcore.messages.io import TokenOut
from pdcore.engine.sched.request import Phase, Req


def take_output(req: Req) -> TokenOut | None:
    """What a request has to send now (tokens, prompt stats once, the end), or None; its pending
    parts are handed over."""
    done = req.phase is Phase.FINISHED
    if req.phase is Phase.HELD or (not req.pending_tokens and not done):
        return None
    msg = TokenOut(req.rid, req.pending_tokens, req.pending_out_logprobs)
    req.pending_tokens, req.pending_out_logprobs = [], []
    if not req.sent_prompt_stats:
        msg.prompt_tokens, msg.cached_tokens = len(req.prompt), req.cached_tokens
        if req.wants_prompt_logprobs:
            head = [(None, req.prompt[0], None)] if req.logprob_start_len == 0 else []
            msg.input_logprobs = head + req.pending_in_logprobs
        req.sent_prompt_stats = True
    if done:
        msg.finished, msg.finish_reason = True, req.finish_reason
        msg.spec_verify_ct = req.spec.verify_ct if req.spec is not None else 0
        msg.error, msg.error_status, msg.error_code = req.error, req.error_status, req.error_code
    return msg
