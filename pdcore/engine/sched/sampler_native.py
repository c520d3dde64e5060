"""The batch's sampling in one native call (engine/native/sampler.h): each row's grammar
bitmask, penalties, logit bias and bans, then temperature, top-k, softmax, min-p, top-p and the
draw at the request's uniform, one row per task, three passes over a row and no allocation.
sampler.py's torch path is the same rule and runs where the native kernels are not built.

The edits a row needs are handed over as arrays the request keeps up to date token by token
(`Edits`): its seen tokens (repetition penalty), its output counts (frequency / presence), its
bias and bans; a step concatenates them, it does not rebuild them from sets.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdcore.engine import native

if TYPE_CHECKING:
    from pdcore.constrained.backend import GrammarBackend

SampleState = Any  # sampler.SampleState (which imports this module)

# sampler.h's knobs columns and edit kinds
KNOB_COLS = 7
EDIT_REPEAT, EDIT_COUNT, EDIT_BIAS, EDIT_BAN = 0, 1, 2, 3


class Edits:
    """One request's edits to its logits, as arrays grown one token at a time."""

    def __init__(self, seen: set[int] | None, bias: dict[int, float]) -> None:
        self.seen = array("q", sorted(seen)) if seen is not None else None
        self.count_tok: array | None = None
        self.count_val: array | None = None
        self._count_at: dict[int, int] = {}
        self.bias_tok = np.fromiter(bias, np.int64, len(bias)) if bias else None
        self.bias_val = np.array(list(bias.values()), np.float32) if bias else None

    def track_counts(self) -> None:
        self.count_tok, self.count_val = array("q"), array("f")

    def observe(self, token: int, new_to_seen: bool) -> None:
        if self.seen is not None and new_to_seen:
            self.seen.append(token)
        if self.count_tok is not None:
            at = self._count_at.get(token)
            if at is None:
                self._count_at[token] = len(self.count_tok)
                self.count_tok.append(token)
                self.count_val.append(1.0)  # type: ignore[union-attr]
            else:
                self.count_val[at] += 1.0  # type: ignore[index]


def op():
    """The native operator, or None where the kernels are not built (the torch path runs)."""
    return native.op("sample_rows")


def _row_edits(st: SampleState, toks: list, kinds: list, vals: list) -> int:
    """Appends st's edits (in sampler.h's order) to the lists; returns how many."""
    ed, p, n = st.edits, st.params, 0

    def put(tok: np.ndarray, kind: int, val: np.ndarray | float) -> None:
        nonlocal n
        toks.append(tok)
        kinds.append(np.full(len(tok), kind, np.int32))
        vals.append(val if isinstance(val, np.ndarray) else np.full(len(tok), val, np.float32))
        n += len(tok)

    if ed is not None and ed.seen is not None and len(ed.seen):
        put(np.frombuffer(ed.seen, np.int64), EDIT_REPEAT, p.repetition_penalty)
    if ed is not None and ed.count_tok is not None and len(ed.count_tok):
        put(np.frombuffer(ed.count_tok, np.int64),
            EDIT_COUNT, np.frombuffer(ed.count_val, np.float32).copy())  # type: ignore[arg-type]
    if ed is not None and ed.bias_tok is not None:
        put(ed.bias_tok, EDIT_BIAS, ed.bias_val)  # type: ignore[arg-type]
    if st.banned:
        put(np.array(st.banned, np.int64), EDIT_BAN, 0.0)
    return n


def run(o, logits: torch.Tensor, states: list[SampleState], us: torch.Tensor, *,
        bitmask: torch.Tensor | None = None, mask_rows: list[int] | None = None,
        probs: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> list[int]:
    """One token per row of logits [R, V] for states[r] (greedy rows: the argmax of the edited
    row), -1 for a row with nothing to draw. `us`: one uniform per row (greedy rows' unused);
    mask_rows[r]: the bitmask row of a constrained row, -1 for none. `probs` [R, V] float32
    receives each row's kept probabilities (tests), `lse` [R] float64 each raw row's
    log-sum-exp (logprobs: the model's distribution)."""
    n, v = logits.shape
    knobs = np.empty((n, KNOB_COLS), np.float64)
    toks: list = []
    kinds: list = []
    vals: list = []
    ptr = np.zeros(n + 1, np.int64)
    u = us.to(torch.float64).numpy()
    for r, st in enumerate(states):
        p = st.params
        greedy = p.greedy
        knobs[r] = (0.0 if greedy else np.float32(p.temperature),
                    p.top_k if 0 < p.top_k < v else 0,
                    np.float64(np.float32(p.top_p)) if p.top_p < 1.0 else 1.0,
                    p.min_p, u[r] if not greedy else 0.0,
                    p.frequency_penalty, p.presence_penalty)
        ptr[r + 1] = ptr[r] + (0 if st.plain_greedy else _row_edits(st, toks, kinds, vals))
    if toks:
        et = torch.from_numpy(np.concatenate(toks))
        ek = torch.from_numpy(np.concatenate(kinds))
        ev = torch.from_numpy(np.concatenate(vals).astype(np.float32, copy=False))
    else:
        et = torch.empty(0, dtype=torch.long)
        ek = torch.empty(0, dtype=torch.int32)
        ev = torch.empty(0, dtype=torch.float32)
    mr = torch.tensor(mask_rows if mask_rows is not None else [-1] * n, dtype=torch.long)
    bm = bitmask if bitmask is not None else torch.empty(0, 0, dtype=torch.int32)
    x = logits if logits.dtype == torch.float32 and logits.stride(1) == 1 else \
        logits.float().contiguous()
    return o(x, torch.from_numpy(knobs), mr, bm, torch.from_numpy(ptr), et, ek, ev,
             probs, lse).tolist()


def bitmask_for(states: list[SampleState], rows: list[int], grammar: GrammarBackend | None,
                vocab: int) -> tuple[torch.Tensor | None, list[int]]:
    """The batch's grammar bitmask (one row per constrained request of `rows`) and each row's
    index in it (-1: unconstrained); None where xgrammar's mask does not cover the vocabulary
    (then the torch path masks)."""
    mask_rows = [-1] * len(states)
    if not rows:
        return None, mask_rows
    assert grammar is not None
    bitmask = grammar.bitmask(len(rows))
    if bitmask.dtype != torch.int32 or bitmask.shape[1] * 32 < vocab:
        raise ValueError("bitmask")
    for j, i in enumerate(rows):
        states[i].constraint.fill(bitmask, j)  # type: ignore[union-attr]
        mask_rows[i] = j
    return bitmask, mask_rows
