"""The incremental n-gram index against the full-history rescan at serving sizes, compiled and not.

tests/controller/vllm/test_ngram.py holds the index to the rescan on histories of tens of tokens; the
plugin runs it on thousands. Here 8-64 requests with 1,000-4,000-token histories step in batches (0-8
new tokens a row, drafts accepted, copied from earlier or fresh), index without drafting, finish, are
restarted (resumed after preemption) and new ones reuse their slots, so the arena compacts and grows,
the table rebuilds and grows (dropping finished requests' entries), and long probe runs form. Small
alphabets (2-8 symbols, small or large ids) repeat n-grams everywhere; large ids (up to 2**31 - 1) give
a big table, with matches from text copied within and across requests (the same n-grams in many slots).
After every step each request's draft and counterfactual count equal the rescan's.

Hypothesis draws the sizes and the mix; a seeded generator draws the tokens and the batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.vllm.ngram import NgramIndex, room, step_row
from policies.observation import NOT_SCORED
from policies.prompt_lookup import MAX_NGRAM, match_ngram

pytestmark = pytest.mark.usefixtures("kernels")

TOP = 2**31  # token ids below this (int32)


class Ref:
    """One request as the rescan sees it: its history, pending draft (to score) and latest draft."""

    def __init__(self, history: np.ndarray) -> None:
        self.buf = np.empty(max(64, 2 * len(history)), dtype=np.int32)
        self.n = len(history)
        self.buf[: self.n] = history
        self.pending: np.ndarray | None = None
        self.pending_start = 0
        self.draft = self.buf[:0]

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.n]

    def extend(self, new: np.ndarray) -> int:
        if self.n + len(new) > len(self.buf):
            buf = np.empty(2 * (self.n + len(new)), dtype=np.int32)
            buf[: self.n] = self.tokens
            self.buf = buf
        self.buf[self.n : self.n + len(new)] = new
        self.n += len(new)
        if self.pending is None or not len(new):
            return NOT_SCORED
        d = self.pending
        seen = self.buf[self.pending_start : min(self.n, self.pending_start + len(d))]
        differ = np.flatnonzero(d[: len(seen)] != seen)
        if len(differ) or len(seen) == len(d):
            self.pending = None
            return int(differ[0]) if len(differ) else len(seen)
        return NOT_SCORED

    def propose(self, min_n: int, max_n: int, max_model_len: int, k: int) -> None:
        self.draft = match_ngram(self.tokens, min_n, max_n, max_model_len, k).copy()
        if self.pending is None:
            self.pending, self.pending_start = self.draft, self.n


#: How often, a row per step: it brings no tokens (a repeated draft at the same position), it finishes,
#: it indexes its tokens without drafting, its new tokens start with its draft (some accepted); a live
#: request restarts with its history (preempted, resumed).
EMPTY, LEAVE, INDEX_ONLY, ACCEPT, RESTART = 0.2, 0.03, 0.1, 0.5, 0.01


@dataclass(frozen=True)
class Case:
    min_n: int
    max_n: int
    max_k: int
    max_model_len: int
    alphabet: int  # 0: any id below 2**31; else this many symbols
    big_ids: bool  # a small alphabet's symbols are large ids
    slots: int
    history: tuple[int, int]  # a history's length range
    steps: int
    copy: float  # how often text is copied from earlier (the matches, for large ids)
    busy: float  # how often a live request is in a step's batch
    arrive: float  # how often a free slot takes a new request in a step
    rows: bool  # drive the index as the hot path does (``room``, ``make_room``, ``step_row``)
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    # n-gram sizes over their range; the long ones (to 63) cost O(max_n**2) a token as plain Python, so
    # a few sizes of them at a time, in one case of four.
    if draw(st.integers(0, 3)):
        min_n = draw(st.integers(1, 4))
        max_n = draw(st.integers(min_n, min_n + 5))
    else:
        max_n = draw(st.integers(MAX_NGRAM - 3, MAX_NGRAM))
        min_n = draw(st.integers(max_n - 2, max_n))
    lo = draw(st.integers(1000, 4000))
    hi = draw(st.integers(lo, 4000))
    return Case(
        min_n=min_n,
        max_n=max_n,
        max_k=draw(st.one_of(st.integers(1, 10), st.sampled_from([16, 32, 64]))),
        # or a model length the requests reach: drafts shrink to it, then stop
        max_model_len=draw(st.one_of(st.just(1 << 30), st.integers(lo, hi + 300))),
        alphabet=draw(st.sampled_from([0, 2, 3, 4, 5, 8])),
        big_ids=draw(st.booleans()),
        slots=draw(st.integers(8, 64)),
        history=(lo, hi),
        steps=draw(st.integers(10, 60)),
        copy=draw(st.sampled_from([0.3, 0.8])),
        busy=draw(st.sampled_from([0.3, 1.0])),
        arrive=draw(st.sampled_from([0.05, 0.5])),
        rows=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


class Tokens:
    """Token text for one case: fresh symbols, and stretches copied from earlier (in the request, or
    from a corpus every request shares)."""

    def __init__(self, case: Case, rng: np.random.Generator) -> None:
        self.case, self.rng = case, rng
        if case.alphabet and case.big_ids:
            self.symbols = rng.integers(0, TOP, case.alphabet).astype(np.int32)
            self.symbols[0] = TOP - 1  # the largest id
        elif case.alphabet:
            self.symbols = np.arange(case.alphabet, dtype=np.int32)
        else:
            self.symbols = None
        self.corpus = self.text(8000, None)

    def fresh(self, m: int) -> np.ndarray:
        if self.symbols is None:
            return self.rng.integers(0, TOP, m).astype(np.int32)
        return self.symbols[self.rng.integers(0, len(self.symbols), m)]

    def text(self, length: int, corpus: np.ndarray | None) -> np.ndarray:
        out = np.empty(length, dtype=np.int32)
        n = 0
        while n < length:
            m = min(int(self.rng.integers(1, 64)), length - n)
            src = corpus if corpus is not None and self.rng.random() < 0.5 else out[:n]
            if self.rng.random() < self.case.copy and len(src) > m:
                a = int(self.rng.integers(0, len(src) - m))
                out[n : n + m] = src[a : a + m]
            else:
                out[n : n + m] = self.fresh(m)
            n += m
        return out

    def history(self) -> np.ndarray:
        lo, hi = self.case.history
        return self.text(int(self.rng.integers(lo, hi + 1)), self.corpus)

    def new(self, ref: Ref) -> np.ndarray:
        """A row's new tokens: none (a step that samples nothing) or 1-8, its draft's first ones (the
        draft accepted) or copied from its history or fresh."""
        m = int(self.rng.integers(1, 9)) if self.rng.random() >= EMPTY else 0
        if m and self.rng.random() < ACCEPT and len(ref.draft):
            took = ref.draft[: int(self.rng.integers(0, len(ref.draft) + 1))][:m]
            return np.concatenate([took, self.fresh(m - len(took))])
        if m and self.rng.random() < self.case.copy and ref.n > m:
            a = int(self.rng.integers(0, ref.n - m))
            return ref.tokens[a : a + m].copy()
        return self.fresh(m)


def step_by_rows(
    ix: NgramIndex, slots: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, propose: np.ndarray
) -> np.ndarray:
    """``NgramIndex.step`` as a caller's own kernel does it: ``room`` for the batch (``make_room``
    until it fits), then ``step_row`` for each row."""
    sizes = offsets[1:] - offsets[:-1]
    while not room(*ix.arrays()[:4], slots, sizes, ix.max_n - ix.min_n + 1):
        ix.make_room()
    arrays = ix.arrays()
    return np.array(
        [
            step_row(*arrays, int(s), tokens, int(offsets[j]), int(offsets[j + 1]), bool(propose[j]), ix.min_n, ix.max_n, ix.max_model_len)
            for j, s in enumerate(slots)
        ],
        dtype=np.int32,
    )  # fmt: skip


def run(case: Case) -> None:
    rng = np.random.default_rng(case.seed)
    text = Tokens(case, rng)
    k, min_n, max_n, mml = case.max_k, case.min_n, case.max_n, case.max_model_len
    ix = NgramIndex(max_k=k, min_n=min_n, max_n=max_n, max_model_len=mml, capacity=1)
    refs: dict[int, Ref] = {}

    def start(slot: int, history: np.ndarray) -> None:
        ix.start(slot, history)
        refs[slot] = Ref(history)

    for slot in rng.permutation(case.slots)[: max(1, int(case.slots * rng.uniform(0.5, 1.0)))]:
        start(int(slot), text.history())
    for step in range(case.steps):
        for slot in range(case.slots):
            if slot not in refs and rng.random() < case.arrive:
                start(slot, text.history())
            elif slot in refs and rng.random() < RESTART:
                start(slot, refs[slot].tokens.copy())
        batch = [s for s in rng.permutation(case.slots).tolist() if s in refs and rng.random() < case.busy]
        if not batch:
            continue
        news = [text.new(refs[s]) for s in batch]
        leave = rng.random(len(batch)) < LEAVE
        propose = ~leave & (rng.random(len(batch)) >= INDEX_ONLY)
        slots = np.array(batch, dtype=np.int64)
        offsets = np.cumsum([0, *map(len, news)]).astype(np.int64)
        tokens = np.concatenate(news).astype(np.int32)
        cf = (step_by_rows if case.rows else NgramIndex.step)(ix, slots, tokens, offsets, propose)
        drafts, lens = ix.drafts(slots)
        for j, slot in enumerate(batch):
            ref = refs[slot]
            where = f"step {step}, slot {slot}, length {ref.n}"
            assert int(cf[j]) == ref.extend(news[j]), where
            assert len(ix.tokens(slot)) == ref.n and np.array_equal(
                ix.tokens(slot)[-16:], ref.tokens[-16:]
            ), where
            if leave[j]:
                assert np.array_equal(ix.tokens(slot), ref.tokens), where
                ix.release(slot)
                del refs[slot]
            elif propose[j]:
                ref.propose(min_n, max_n, mml, k)
                assert ix.draft(slot).tolist() == ref.draft.tolist(), where
                assert drafts[j, : lens[j]].tolist() == ref.draft.tolist(), where
    assert len(ix) == len(refs)
    for slot, ref in refs.items():
        assert np.array_equal(ix.tokens(slot), ref.tokens), slot


def test_long_histories_draft_and_score_as_the_rescan(kernels: str) -> None:
    # As plain Python a case takes 0.1-6 s (mostly indexing the histories); compiled, about 0.1 s.
    @settings(
        max_examples=10 if kernels == "python" else 60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(cases())
    def check(case: Case) -> None:
        run(case)

    check()
