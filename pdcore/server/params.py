"""Validation and conversion of request fields into scheduler requests (GenerateReq).

Length policy (documented in docs/http-api.md): a prompt of `context_length` tokens or
more is rejected (HTTP 400, field = the prompt field); otherwise `max_new_tokens` is clamped
(by planner.max_new_tokens, the one place it is decided) to the room left in the context
(`context_length - prompt_tokens`) and in the KV pool (`max_total_tokens - prompt_tokens`), and
such a request ends with finish_reason "length". A prompt that does not fit the KV pool at all
is rejected too: it could never be scheduled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcore.config import ServerArgs
from pdcore.errors import ForbiddenRouteError, InvalidRequestError
from pdcore.messages.info import EngineInfo
from pdcore.messages.io import GenerateReq, PDRoute, SamplingParams
from pdcore.route_auth import RequestGuard, RouteGuard
from pdcore.server.generation import Item
from pdcore.server.startup.sglang_flags import json_object_flag

MAX_N = 64
log = logging.getLogger(__name__)


def bad(message: str, field: str) -> InvalidRequestError:
    return InvalidRequestError(message, field)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]; the entries are bounded in limits.py


def _logit_bias(raw: dict[str, float] | None, field: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad(f"{field} keys must be token ids, got {key!r}", field) from None
        if token < 0:
            raise bad(f"{field} keys must be token ids >= 0, got {token}", field)
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise bad(f"{field}[{key}] must be in [-100, 100], got {value}", field)
        out[token] = float(value)
    return out


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@functools.lru_cache(maxsize=4)
def preferred_sampling(raw: str | None) -> dict[str, Any]:
    """--preferred-sampling-params as a dict (checked at start-up by ServerArgs.validate)."""
    return json_object_flag(raw, "--preferred-sampling-params")


def build_sampling(given: Mapping[str, Any], prefix: str = "",
                   names: dict[str, str] | None = None,
                   defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The one place a request's sampling options become the engine's SamplingParams, checked
    once. `given` maps SamplingParams field names to what the client sent (the wire schemas
    declare only JSON types: a None or absent field takes the default declared on
    SamplingParams; `stop` may be one string; `logit_bias` keys are token ids as strings, as
    OpenAI sends them). `max_new_tokens` comes decided (planner.max_new_tokens).
    Errors name `prefix + field` (`names` renames fields, e.g. OpenAI's min_tokens)."""
    names = names or {}
    # `defaults` (--preferred-sampling-params) fill what the request left out
    vals = {**(defaults or {}), **{k: v for k, v in given.items() if v is not None}}
    if vals.keys() - SAMPLING_FIELDS:
        raise TypeError(f"not sampling fields: {sorted(vals.keys() - SAMPLING_FIELDS)}")

    def f(name: str) -> str:
        return prefix + names.get(name, name)

    def finite(name: str, v: float) -> float:
        if not math.isfinite(v):
            raise bad(f"{f(name)} must be a finite number", f(name))
        return float(v)

    s = SamplingParams(**vals)
    for decl in dataclasses.fields(SamplingParams):  # the bounds declared on SamplingParams
        bounds, value = decl.metadata.get("bounds"), getattr(s, decl.name)
        number = finite(decl.name, value) if decl.type == "float" else value
        if bounds is not None and not bounds.holds(number):
            raise bad(f"{f(decl.name)} must be {bounds.text()}, got {value}", f(decl.name))
        if decl.type == "float":
            setattr(s, decl.name, number)
    if s.top_k == 0 or s.top_k < -1:
        raise bad(f"{f('top_k')} must be -1 (off) or >= 1, got {s.top_k}", f("top_k"))
    s.stop = [s.stop] if isinstance(s.stop, str) else list(s.stop)
    if any(not x for x in s.stop):
        raise bad(f"{f('stop')} must not contain empty strings", f("stop"))
    if any(t < 0 for t in s.stop_token_ids):
        raise bad(f"{f('stop_token_ids')} must be token ids >= 0", f("stop_token_ids"))
    s.stop_token_ids = list(s.stop_token_ids)
    s.logit_bias = _logit_bias(s.logit_bias, f("logit_bias"))
    return s


def needs_text(args: ServerArgs, what: str, field: str) -> None:
    """--skip-tokenizer-init: token ids in and out; text prompts and the OpenAI routes (which
    take and answer text) are refused with what to send instead."""
    if args.skip_tokenizer_init:
        raise bad(f"{what} needs the tokenizer, and this server runs with "
                  "--skip-tokenizer-init: send input_ids to /generate (the answer carries "
                  "output_ids), or restart the server without the flag", field)


def check_n(n: int, field: str = "n") -> int:
    if not 1 <= n <= MAX_N:
        raise bad(f"{field} must be in [1, {MAX_N}], got {n}", field)
    return n


def check_prompt(ids: list[int], info: EngineInfo, field: str,
                 truncate: bool = False) -> None:
    """`truncate` (--allow-auto-truncate): a prompt of context-length tokens or more is cut, in
    place, to its first context-length - 1 tokens instead of refused."""
    if not ids:
        raise bad(f"{field} is empty: give at least one token", field)
    vocab = info.vocab_size
    if vocab and any(not 0 <= t < vocab for t in ids):
        raise bad(f"{field} holds token ids outside [0, {vocab})", field)
    ctx = info.context_length
    if ctx and len(ids) >= ctx and truncate:
        log.warning("%s: %d tokens cut to %d to fit the context length %d "
                    "(--allow-auto-truncate)", field, len(ids), ctx - 1, ctx)
        del ids[ctx - 1:]
    if ctx and len(ids) >= ctx:
        raise bad(f"{field} is too long: {len(ids)} tokens, the context length is {ctx} "
                  "(prompt and output must fit); shorten it", field)
    pool = info.max_total_tokens
    if pool and len(ids) + 1 > pool:
        raise bad(f"{field} has {len(ids)} tokens but the KV pool holds only {pool}", field)


def per_item(value: Any, count: int, field: str) -> list[Any]:
    """A scalar applies to every item; a list must have one entry per item."""
    if isinstance(value, list):
        if len(value) != count:
            raise bad(f"{field} has {len(value)} entries for {count} requests", field)
        return list(value)
    return [value] * count


@dataclass
class PDInfo:
    route: PDRoute | None = None  # None: the request named no route
    routed_dp_rank: int | None = None


async def request_guard(request: Any) -> RequestGuard:
    """The server's route guard bound to this request's raw body (a route's signature covers
    the body: route_auth.body_digest)."""
    guard: RouteGuard = request.app.state.route_guard
    return guard.bind(await request.body())


def pd_items(body: Any, samples: list[int], args: ServerArgs,
             guard: RouteGuard | RequestGuard) -> list[PDInfo]:
    """Bootstrap fields per prompt; `samples[p]` is prompt p's n. A scalar applies to the whole
    request; a list has one entry per prompt, or one per sample (sum of samples), as
    sglang-router sends for a chat request with n > 1: a prompt then takes its first sample's
    entry. Either way a prompt's KV crosses once, in one room, whatever its n. On a prefill or
    decode server every route must pass `guard` (signed, or a trusted prefill address): else
    ForbiddenRouteError (403) before anything is queued."""
    count, total = len(samples), sum(samples)
    firsts = [sum(samples[:p]) for p in range(count)]

    def per_prompt(value: Any, field: str) -> list[Any]:
        if not isinstance(value, list):
            return [value] * count
        if len(value) == count:
            return list(value)
        if len(value) == total:
            return [value[i] for i in firsts]
        also = f" or one per sample ({total})" if total != count else ""
        raise bad(f"{field} has {len(value)} entries; give one per prompt ({count}){also}", field)

    hosts = per_prompt(body.bootstrap_host, "bootstrap_host")
    ports = per_prompt(body.bootstrap_port, "bootstrap_port")
    rooms = per_prompt(body.bootstrap_room, "bootstrap_room")
    sigs = per_prompt(body.bootstrap_sig, "bootstrap_sig")
    if args.disaggregation_mode != "null" and count > 1 and rooms[0] is not None:
        # a room carries one prompt's KV: two prompts in one room would run two transfers on it
        if not isinstance(body.bootstrap_room, list):
            raise bad(f"bootstrap_room must be a list with one room per prompt ({count}) for a "
                      "batch", "bootstrap_room")
        if len(set(rooms)) != count:
            raise bad("bootstrap_room holds the same room for two prompts; give each prompt its "
                      "own", "bootstrap_room")
    dp_rank = body.routed_dp_rank if body.routed_dp_rank is not None else body.data_parallel_rank
    out = []
    for h, p, r, sig in zip(hosts, ports, rooms, sigs):
        if r is not None and not 0 <= r < 2**64:
            raise bad("bootstrap_room must be in [0, 2^64)", "bootstrap_room")
        if p is not None and not 0 < p < 65536:
            raise bad("bootstrap_port must be in 1..65535", "bootstrap_port")
        if args.disaggregation_mode != "null":
            why = guard.check(r, h, p, sig, args.disaggregation_bootstrap_port)
            if why:
                raise ForbiddenRouteError(why, "bootstrap_host")
        if p is None and h is not None:
            p = args.disaggregation_bootstrap_port
        route = None
        if (h, p, r, body.disagg_prefill_dp_rank) != (None, None, None, None):
            route = PDRoute(h, p, r, body.disagg_prefill_dp_rank)
        out.append(PDInfo(route, dp_rank))
    return out


def make_req(rid: str, ids: list[int], sampling: SamplingParams, pd: PDInfo, *,
             return_logprob: bool = False, logprob_start_len: int = -1,
             top_logprobs_num: int = 0, stream: bool = False) -> GenerateReq:
    return GenerateReq(
        rid=rid, input_ids=list(ids), sampling=sampling, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, stream=stream,
        route=pd.route, routed_dp_rank=pd.routed_dp_rank,
    )


def sample_item(index: int, req: GenerateReq, leader: Item | None, mode: str) -> Item:
    """The item of one sample; `leader` is sample 0 of the same prompt (None for sample 0).
    A prefill server sends only sample 0 and answers it for every sample (P makes the prompt's
    KV and one token, once); a decode server serves every sample, the others forking from
    sample 0, which alone runs the KV transfer: they travel in sample 0's message (its
    `forks`), so its KV can never arrive before they do; a unified server runs each on its
    own."""
    if leader is None or mode == "null":
        return Item(index, req)
    if mode == "prefill":
        return Item(index, leader.req, copy_of=leader.index)
    req.route = dataclasses.replace(req.route or PDRoute(), fork_of=leader.req.rid)
    leader.req.forks.append(req)
    return Item(index, req)
