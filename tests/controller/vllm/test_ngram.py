"""The incremental n-gram index against the full-history rescan (vLLM's rule), compiled and not."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.vllm.ngram import NgramIndex
from policies.observation import NOT_SCORED
from policies.prompt_lookup import match_ngram

pytestmark = pytest.mark.usefixtures("kernels")


def one(ix: NgramIndex, slot: int, new: list[int], propose: bool = True) -> int:
    cf = ix.step(
        np.array([slot], dtype=np.int64),
        np.array(new, dtype=np.int32),
        np.array([0, len(new)], dtype=np.int64),
        np.array([propose]),
    )
    return int(cf[0])


def test_match_takes_longest_suffix_earliest_occurrence() -> None:
    t = np.array([5, 1, 2, 9, 1, 2, 7, 1, 2], dtype=np.int32)
    # suffix [1, 2] first occurs at 1 -> the draft is what followed it
    assert match_ngram(t, 1, 3, 1 << 20, 4).tolist() == [9, 1, 2, 7]
    assert match_ngram(t, 1, 3, 1 << 20, 2).tolist() == [9, 1]
    assert match_ngram(np.array([1, 2, 3], dtype=np.int32), 1, 3, 1 << 20, 4).tolist() == []
    # never beyond the model length
    assert match_ngram(t, 1, 3, len(t) + 1, 4).tolist() == [9]
    ix = NgramIndex(max_k=4)
    ix.start(3, t)
    one(ix, 3, [])
    assert ix.draft(3).tolist() == [9, 1, 2, 7]


def test_counterfactual_scored_once_following_tokens_known() -> None:
    ix = NgramIndex(max_k=4)
    ix.start(0, [7, 8, 9, 7, 8])
    assert one(ix, 0, []) == NOT_SCORED
    assert ix.draft(0).tolist() == [9, 7, 8]
    # the next verified step emitted one token that matches: not final yet
    assert one(ix, 0, [9]) == NOT_SCORED
    assert one(ix, 0, [7, 5]) == 2  # 9, 7 matched, then 5 != 8


def test_counterfactual_full_match_and_empty_draft() -> None:
    ix = NgramIndex(max_k=2)
    ix.start(0, [1, 2, 1])
    one(ix, 0, [])
    assert ix.draft(0).tolist() == [2, 1]
    assert one(ix, 0, [2, 1, 4]) == 2
    ix.start(1, [1, 2, 3])
    one(ix, 1, [])
    assert ix.draft(1).tolist() == []
    assert one(ix, 1, [4]) == 0  # n-gram would have drafted nothing
    ix.release(1)
    assert not ix.live(1) and ix.live(0) and len(ix) == 1
    assert ix.draft(1).tolist() == []


def test_history_grows_past_its_region_and_the_arena() -> None:
    ix = NgramIndex(max_k=4, capacity=1)
    ix.start(0, [0])
    ix.start(1, [5, 6])
    for i in range(500):
        one(ix, 0, [i % 7, (i + 1) % 7])
    assert len(ix.tokens(0)) == 1001 and ix.tokens(1).tolist() == [5, 6]
    assert ix.tokens(0)[-2:].tolist() == [499 % 7, 500 % 7]
    assert ix.draft(0).tolist() == match_ngram(ix.tokens(0), 1, 3, 1 << 30, 4).tolist()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(max_k=4, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="max_k"):
        NgramIndex(max_k=0)


@dataclass
class Ref:
    """The rule as the plugin applied it before the index: rescan, and the pending draft's score."""

    tokens: list[int]
    pending: list[int] | None = None
    pending_start: int = 0
    draft: list[int] = field(default_factory=list)

    def extend(self, new: list[int]) -> int:
        self.tokens += new
        if self.pending is None or not new:
            return NOT_SCORED
        d = self.pending
        seen = self.tokens[self.pending_start : self.pending_start + len(d)]
        prefix = next((i for i, (a, b) in enumerate(zip(d, seen, strict=False)) if a != b), len(seen))
        if prefix < len(seen) or len(seen) == len(d):
            self.pending = None
            return prefix
        return NOT_SCORED

    def propose(self, min_n: int, max_n: int, max_model_len: int, k: int) -> None:
        t = np.array(self.tokens, dtype=np.int32)
        self.draft = match_ngram(t, min_n, max_n, max_model_len, k).tolist()
        if self.pending is None:
            self.pending, self.pending_start = list(self.draft), len(self.tokens)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, int, int, int, list[list[tuple[int, list[int], bool]]]]:
    min_n = draw(st.integers(1, 3))
    max_n = draw(st.integers(min_n, 5))
    max_k = draw(st.integers(1, 8))
    max_model_len = draw(st.sampled_from([1 << 30, 40]))
    # A small alphabet repeats (long matches); the full int32 range checks any vocabulary works.
    vocab = draw(st.sampled_from([2, 3, 5, 50, 2**31 - 1]))
    tok = st.integers(0, vocab - 1)
    steps = draw(
        st.lists(
            st.lists(st.tuples(st.integers(0, 5), st.lists(tok, max_size=5), st.booleans()), max_size=6),
            min_size=1,
            max_size=30,
        )
    )
    return min_n, max_n, max_k, max_model_len, vocab, steps


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.data())
def test_index_drafts_and_scores_as_the_rescan(
    case: tuple[int, int, int, int, int, list[list[tuple[int, list[int], bool]]]], data: st.DataObject
) -> None:
    """Requests arrive (with a history), step in batches with 0-5 new tokens, finish and leave, and
    their slots are reused; small starting sizes make the arena compact and the table rebuild."""
    min_n, max_n, max_k, max_model_len, vocab, steps = case
    ix = NgramIndex(max_k=max_k, min_n=min_n, max_n=max_n, max_model_len=max_model_len, capacity=1)
    ix._pool = ix._pool[:8]  # start tiny: every growth path runs
    refs: dict[int, Ref] = {}
    for batch in steps:
        rows: dict[int, tuple[list[int], bool]] = {}
        for slot, new, leave in batch:
            if slot not in refs:
                history = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40), label="history")
                ix.start(slot, history)
                refs[slot] = Ref(list(history))
                new = []
            rows[slot] = (new, leave)
        slots = np.array(list(rows), dtype=np.int64)
        news = [n for n, _ in rows.values()]
        offsets = np.cumsum([0, *map(len, news)]).astype(np.int64)
        tokens = np.array([t for n in news for t in n], dtype=np.int32)
        propose = np.array([not leave for _, leave in rows.values()])
        cf = ix.step(slots, tokens, offsets, propose)
        for j, (slot, (new, leave)) in enumerate(rows.items()):
            ref = refs[slot]
            assert int(cf[j]) == ref.extend(new)
            assert ix.tokens(slot).tolist() == ref.tokens
            if leave:
                ix.release(slot)
                del refs[slot]
            else:
                ref.propose(min_n, max_n, max_model_len, max_k)
                assert ix.draft(slot).tolist() == ref.draft
    assert len(ix) == len(refs)


def test_index_drafts_as_vllms_own_matcher() -> None:
    """Where vLLM is installed: the index's drafts equal vLLM's prompt-lookup matcher's."""
    proposer = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    find = proposer._find_longest_matched_ngram_and_propose_tokens
    rng = np.random.default_rng(7)
    for case in range(300):
        min_n, max_n, k = int(rng.integers(1, 3)), int(rng.integers(2, 5)), int(rng.integers(1, 8))
        max_n = max(min_n, max_n)
        tokens = rng.integers(0, (3, 20, 50_000)[case % 3], int(rng.integers(1, 400))).astype(np.int32)
        ix = NgramIndex(max_k=k, min_n=min_n, max_n=max_n, capacity=1)
        cut = int(rng.integers(0, len(tokens)))
        ix.start(0, tokens[:cut])
        rest = tokens[cut:]
        for a in range(0, max(len(rest), 1), 3):
            one(ix, 0, rest[a : a + 3].tolist())
            want = find(tokens[: cut + len(rest[: a + 3])], min_n, max_n, 1 << 20, k)
            assert ix.draft(0).tolist() == np.asarray(want).tolist(), f"case {case}"
