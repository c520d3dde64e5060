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

if TYPE_CHECKING:  # torch only where it runs (the scheduler process)
    import torch

log = logging.getLogger(__name__)

BACKENDS = ("xgrammar", "none")
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object
# a JSON string's character in xgrammar's EBNF: as it writes a bounded one, and as JSON allows
_LAX_CHARS = r'[^\"\\\r\n]'
_STRICT_CHARS = r'[^\0-\x1f\"\\\r\n]'
KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag", "tool_call")
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


def _strict(xgr: Any, grammar: Any) -> Any:
    """`grammar` with its JSON strings closed to raw control characters: xgrammar 0.2 writes the
    characters of a string with maxLength / minLength as anything but a quote, a backslash, CR and
    LF, which lets U+0000-U+001F through (strict JSON refuses them: a forced tool call was read
    back as plain content, a response_format answer did not load)."""
    text = str(grammar)
    if _LAX_CHARS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LAX_CHARS, _STRICT_CHARS))


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
            return comp.compile_grammar(self._schema(JSON_OBJECT_SCHEMA))
        if spec.kind == "json_schema":
            return comp.compile_grammar(self._schema(spec.source))
        if spec.kind == "regex":
            return comp.compile_regex(spec.source)
        if spec.kind == "ebnf":
            return comp.compile_grammar(spec.source)
        if spec.kind == "tool_call":  # server/tools/chat_tools.py: forced tool calls
            return comp.compile_grammar(self._tool_call(json.loads(spec.source)))
        if spec.kind == "structural_tag":
            tag, xgr = json.loads(spec.source), self._xgr()
            if isinstance(tag, dict) and "structures" in tag and "format" not in tag:
                # SGLang's form: {"structures": [{begin, schema, end}], "triggers": [...]}
                items = [xgr.StructuralTagItem(
                    begin=s["begin"], end=s["end"],
                    schema=s["schema"] if isinstance(s["schema"], str) else json.dumps(s["schema"]))
                    for s in tag["structures"]]
                grammar = xgr.Grammar.from_structural_tag(items, list(tag.get("triggers") or []))
            else:
                grammar = xgr.Grammar.from_structural_tag(spec.source)
            return comp.compile_grammar(_strict(xgr, grammar))
        raise InvalidRequestError(f"unknown grammar kind {spec.kind!r}", spec.field)

    def _schema(self, source: str) -> Any:
        xgr = self._xgr()
        return _strict(xgr, xgr.Grammar.from_json_schema(source, any_whitespace=self.any_whitespace))

    def _tool_call(self, src: dict[str, Any]) -> Any:
        """One of the alternatives, each a fixed prefix, JSON following a schema and a fixed
        suffix (server/tools/tool_parsers.py: ToolParser.forced)."""
        g = self._xgr().Grammar
        alts = []
        for prefix, schema, suffix in src["alternatives"]:
            parts = [g.from_ebnf("root ::= " + json.dumps(prefix, ensure_ascii=False))] \
                if prefix else []
            parts.append(self._schema(json.dumps(schema)))
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
