"""Constrained decoding: a request's grammar (JSON schema, JSON object, regex, EBNF, structural
tag) turned into a per-request matcher whose token bitmask the sampler applies.

The grammar backend is xgrammar (`--grammar-backend xgrammar`, SGLang's default) or `none`.
It is built lazily, on the first constrained request of a scheduler process, from the model's
tokenizer (xgrammar's TokenizerInfo, with the model's vocabulary size: the logits may be wider
than the tokenizer) and compiles each grammar once (an LRU of compiled grammars), ahead of
scheduling on a worker thread (runtime/grammar_gate.py holds the request until it is ready).

In PD the first output token is sampled on P under the grammar and D accepts it into its own
matcher before sampling the second (SampleState.observe), so P and D follow one grammar.
Each sample of n > 1 has its own SampleState and so its own matcher.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pdcore.messages.io import GrammarSpec
from pdcore.errors import InvalidRequestError

if TYPE_CHECKING:  # the HTTP process parses specs here without importing torch
    import torch

log = logging.getLogger(__name__)

BACKENDS = ("xgrammar", "none")
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object
KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag", "tool_call")
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused (400)
MAX_JSON_TEXT_DEPTH = 32  # JSON a client sends as text (a schema, a structural tag, tool-call
# arguments) nested deeper than this is refused (400), as the same JSON sent as an object is
COMPILED_KEPT = 128  # compiled grammars kept for reuse (LRU), per scheduler process
COMPILE_THREADS = 2  # one slow grammar leaves a thread for the others
# CPU seconds one matcher call (a token's mask, or accepting a token) may take; a request whose
# grammar passes it is failed with 400 (Constraint). Usual calls take well under a millisecond.
MAX_MATCH_CALL_S = 0.1


class GrammarUnavailable(InvalidRequestError):
    """The server was started without a grammar backend, or it is not installed."""


_CPP_PREFIX = re.compile(r"^\[[\d:]+\] [^:]+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(message: str) -> str:
    """xgrammar's C++ error text without its time stamp, source line and assertion."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return _CPP_PREFIX.sub("", first)[:300]


class Constraint:
    """One request's matcher. `fill` and `accept` are the sampler's and the scheduler's view.

    Each call is timed in CPU time of the calling thread (a busy host does not count): an
    ambiguous grammar (nested unbounded repetitions, `((a*)*)*b`, or an EBNF rule `x ::= x x`)
    makes xgrammar's Earley matcher slower with every token, 300 tokens of `((a*)*)*b` took 50 s
    of the scheduler's thread, every other request stalled. A call over MAX_MATCH_CALL_S sets
    `too_slow`; the sampler then fails the request with 400 (SampleState.ensure_constraint)."""

    def __init__(self, matcher: Any, field: str) -> None:
        self.m, self.field = matcher, field
        self.too_slow = 0.0  # CPU seconds of the call that passed the bound (0: none did)

    def _timed(self, start: float) -> None:
        spent = time.thread_time() - start
        if spent > MAX_MATCH_CALL_S and not self.too_slow:
            self.too_slow = spent

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        start = time.thread_time()
        self.m.fill_next_token_bitmask(bitmask, row)
        self._timed(start)

    def accept(self, token: int) -> bool:
        start = time.thread_time()
        ok = bool(self.m.accept_token(int(token)))
        self._timed(start)
        return ok

    @property
    def terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def jump_tokens(self) -> list[int]:
        """Tokens that spell what the grammar forces next (xgrammar's jump-forward tokens, which
        may tokenize it otherwise than the model would: drafts to verify, never taken as they
        are); empty when nothing is forced."""
        return [int(t) for t in self.m.find_jump_forward_tokens()]


class GrammarBackend:
    """Compiles grammars for one model's vocabulary and makes matchers; thread-safe building."""

    def __init__(self, name: str, tokenizer: Callable[[], Any], vocab_size: int,
                 eos_ids: Sequence[int], any_whitespace: bool = True) -> None:
        if name not in BACKENDS:
            raise ValueError(f"grammar backend {name!r}: expected one of {', '.join(BACKENDS)}")
        self.name, self.vocab_size = name, int(vocab_size)
        self._tokenizer, self._eos = tokenizer, sorted(int(e) for e in eos_ids)
        self.any_whitespace = any_whitespace
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._done: OrderedDict[GrammarSpec, Any] = OrderedDict()  # LRU of compiled grammars
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[GrammarSpec, Future] = {}
        self.compiled = 0  # grammars compiled
        self.compile_seconds = 0.0

    def _xgr(self) -> Any:
        if self.name == "none":
            raise GrammarUnavailable(
                "constrained decoding is off on this server (--grammar-backend none); start it "
                "with --grammar-backend xgrammar", "grammar")
        try:
            import xgrammar
        except ImportError as e:  # installed by scripts/setup.sh (pyproject.toml: why)
            raise GrammarUnavailable(f"the grammar backend xgrammar cannot be imported ({e}); "
                                     "pip install --no-deps 'xgrammar>=0.2.9,<0.3' (CPU: "
                                     "without triton) or pip install 'pdcore[grammar]'",
                                     "grammar") from None
        return xgrammar

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = self._xgr()
                t = time.monotonic()
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self._eos)
                # our own LRU keeps compiled grammars (bounded by count); xgrammar's cache off
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                log.info("grammar backend xgrammar ready for %d tokens in %.2fs",
                         self.vocab_size, time.monotonic() - t)
            return self._compiler

    def _compile(self, spec: GrammarSpec) -> Any:
        comp = self.compiler()
        if spec.kind == "json_object":  # a JSON object, as OpenAI and SGLang force it (the
            # builtin JSON grammar let any value through: langchain's json_mode got `[1]`)
            return comp.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=self.any_whitespace)
        if spec.kind == "json_schema":
            return comp.compile_json_schema(spec.source, any_whitespace=self.any_whitespace)
        if spec.kind == "regex":
            return comp.compile_regex(spec.source)
        if spec.kind == "ebnf":
            return comp.compile_grammar(spec.source)
        if spec.kind == "tool_call":  # server/chat_tools.py: forced tool calls
            return comp.compile_grammar(self._tool_call(json.loads(spec.source)))
        if spec.kind == "structural_tag":
            tag = json.loads(spec.source)
            if isinstance(tag, dict) and "structures" in tag and "format" not in tag:
                # SGLang's form: {"structures": [{begin, schema, end}], "triggers": [...]}
                xgr = self._xgr()
                items = [xgr.StructuralTagItem(
                    begin=s["begin"], end=s["end"],
                    schema=s["schema"] if isinstance(s["schema"], str) else json.dumps(s["schema"]))
                    for s in tag["structures"]]
                return comp.compile_structural_tag(items, list(tag.get("triggers") or []))
            return comp.compile_structural_tag(spec.source)
        raise InvalidRequestError(f"unknown grammar kind {spec.kind!r}", spec.field)

    def _tool_call(self, src: dict[str, Any]) -> Any:
        """One of the alternatives, each a fixed prefix, JSON following a schema and a fixed
        suffix (server/tool_parsers.py: ToolParser.forced)."""
        g = self._xgr().Grammar
        alts = []
        for prefix, schema, suffix in src["alternatives"]:
            parts = [g.from_ebnf("root ::= " + json.dumps(prefix, ensure_ascii=False))] \
                if prefix else []
            parts.append(g.from_json_schema(json.dumps(schema),
                                            any_whitespace=self.any_whitespace))
            if suffix:
                parts.append(g.from_ebnf("root ::= " + json.dumps(suffix, ensure_ascii=False)))
            alts.append(g.concat(*parts) if len(parts) > 1 else parts[0])
        return g.union(*alts) if len(alts) > 1 else alts[0]

    def compiled_grammar(self, spec: GrammarSpec) -> Any:
        """`spec` compiled (from the LRU when it was before); a grammar xgrammar refuses is the
        client's error (400). Thread-safe: `prepare` runs it off the scheduler's thread."""
        key = GrammarSpec(spec.kind, spec.source)  # the field name does not change the grammar
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key]
        t = time.monotonic()
        try:
            compiled = self._compile(spec)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError kinds
            msg = _clean(str(e)) or type(e).__name__
            raise InvalidRequestError(f"{spec.field} cannot be compiled: {msg}",
                                      spec.field) from None
        with self._lock:
            self.compiled += 1
            self.compile_seconds += time.monotonic() - t
            self._done[key] = compiled
            while len(self._done) > COMPILED_KEPT:
                self._done.popitem(last=False)
        return compiled

    def ready(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return GrammarSpec(spec.kind, spec.source) in self._done

    def prepare(self, spec: GrammarSpec) -> Future:
        """Compile `spec` on a worker thread (xgrammar releases the GIL while it compiles), so a
        slow grammar never stalls the scheduler's steps; the future raises what compiling
        raised."""
        key = GrammarSpec(spec.kind, spec.source)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
            fut = self._inflight.get(key)  # a burst of one schema compiles it once
            if fut is None or fut.cancelled():
                fut = self._pool.submit(self.compiled_grammar, spec)
                self._inflight[key] = fut
                fut.add_done_callback(lambda f, k=key: self._forget(k, f))
            return fut

    def _forget(self, key: GrammarSpec, fut: Future) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher for `spec` (compiled here when `prepare` did not run first)."""
        compiled = self.compiled_grammar(spec)
        return Constraint(self._xgr().GrammarMatcher(compiled), spec.field)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr().allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Disallowed tokens' logits -> -inf, in place (logits [R, V], bitmask [R, words])."""
        self._xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)


def load_client_json(text: str, field: str, max_depth: int = MAX_JSON_TEXT_DEPTH,
                     keep_text: bool = False) -> Any:
    """JSON a client sent inside a string, parsed with its nesting bounded: 400 naming `field`
    when it is nested deeper than `max_depth` levels, or when it is not JSON (unless
    `keep_text`: then the text itself is returned). json.loads recurses once per
    level: 2 KB of brackets raised RecursionError, which became a 500 that the router counted
    against the worker. The parse is C speed; the depth walk is iterative."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(f"{field} is nested too deeply; send JSON nested at most "
                                  f"{max_depth} levels", field) from None
    except ValueError as e:
        if keep_text:
            return text
        raise InvalidRequestError(f"{field} is not valid JSON: {e}", field) from None
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise InvalidRequestError(f"{field} is nested deeper than {max_depth} levels; send "
                                      f"JSON nested at most {max_depth} levels", field)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


def _check_structures(tag: Any, field: str) -> None:
    """SGLang's structural tag {"structures": [{begin, schema, end}], "triggers": [...]}: its
    shape, and each schema given as text bounded as the tag itself is."""
    if not isinstance(tag, dict) or "structures" not in tag or "format" in tag:
        return  # xgrammar's own form: a JSON document it checks itself
    structures, triggers = tag.get("structures"), tag.get("triggers", [])
    if not isinstance(structures, list) or not isinstance(triggers, list) or \
            not all(isinstance(t, str) for t in triggers):
        raise InvalidRequestError(f"{field}: structures and triggers must be lists (triggers "
                                  "of strings)", field)
    for i, s in enumerate(structures):
        where = f"{field}.structures[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or \
                not isinstance(s.get("end"), str) or not isinstance(s.get("schema"), (str, dict)):
            raise InvalidRequestError(f"{where} must be {{\"begin\": str, \"schema\": object, "
                                      "\"end\": str}", where)
        if isinstance(s["schema"], str):
            load_client_json(s["schema"], where + ".schema")


def _checked_text(kind: str, value: Any, field: str) -> str:
    if isinstance(value, dict) and kind in ("json_schema", "structural_tag"):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field} must be a string", field)
    if not value.strip():
        raise InvalidRequestError(f"{field} must not be empty", field)
    if len(value) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"{field} has {len(value)} characters; at most "
                                  f"{MAX_GRAMMAR_CHARS}", field)
    if kind in ("json_schema", "structural_tag"):
        parsed = load_client_json(value, field)
        if kind == "structural_tag":
            _check_structures(parsed, field)
    return value


def spec_from_fields(fields: dict[str, Any], prefix: str = "") -> GrammarSpec | None:
    """The one grammar named by json_schema / regex / ebnf / structural_tag in `fields` (None
    when none is), checked for size and, for JSON kinds, for being JSON. json_schema and
    structural_tag may hold a JSON object or its text."""
    named = [(k, fields[k]) for k in ("json_schema", "regex", "ebnf", "structural_tag")
             if fields.get(k) is not None]
    if not named:
        return None
    if len(named) > 1:
        keys = ", ".join(prefix + k for k, _ in named)
        raise InvalidRequestError(f"at most one of json_schema, regex, ebnf, structural_tag may "
                                  f"be set; got {keys}", prefix + named[1][0])
    kind, value = named[0]
    return GrammarSpec(kind, _checked_text(kind, value, prefix + kind), prefix + kind)


def spec_from_response_format(rf: Any, field: str = "response_format") -> GrammarSpec | None:
    """OpenAI's response_format: text (None), json_object, json_schema {name, schema, strict},
    and SGLang's structural_tag {structures, triggers}."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequestError(f"{field} must be an object with a string `type`", field)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", field)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError(f"{field}.json_schema must be an object with a `schema`",
                                      f"{field}.json_schema")
        schema = js.get("schema", js.get("schema_"))
        if schema is None:  # OpenAI: a json_schema without `schema` means any JSON object
            return GrammarSpec("json_object", "", field)
        where = f"{field}.json_schema.schema"
        return GrammarSpec("json_schema", _checked_text("json_schema", schema, where), where)
    if kind == "structural_tag":
        return GrammarSpec("structural_tag", _checked_text("structural_tag", dict(rf), field),
                           field)
    raise InvalidRequestError(f"{field}.type must be text, json_object, json_schema or "
                              f"structural_tag; got {kind!r}", f"{field}.type")
