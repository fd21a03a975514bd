"""The incremental n-gram index under what a busy or hostile engine gives it, compiled and not.

Two things must hold whatever the traffic: the index's drafts are vLLM's prompt-lookup drafts (checked
here against a brute-force rescan written from the rule itself: the longest suffix n-gram of
``min_n..max_n`` tokens found earlier in prompt + output, its earliest occurrence, the at most K tokens
after it, never past ``max_model_len``), and its memory follows the requests it holds, not the
requests it has seen. The traffic: token ids 0, vocab - 1, 2**31 - 1, -2**31 and vLLM's -1
placeholders; empty prompts; steps that bring no tokens; requests preempted and resumed (their
history restarts shorter, then regrows); slots reused by new requests; ``max_model_len`` at the
history's length and just past it; thousands of short requests churning through a few slots.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.vllm.ngram import NgramIndex

pytestmark = pytest.mark.usefixtures("kernels")

#: Token ids at the edges: vLLM's -1 placeholder, the int32 extremes, 0, a vocabulary's last id.
EDGE_IDS = (-1, -(2**31), 0, 1, 151_935, 2**31 - 1)


def brute_draft(h: list[int], min_n: int, max_n: int, max_model_len: int, k: int) -> list[int]:
    """vLLM's rule by rescanning: the longest suffix n-gram that occurred earlier (ending before the
    last token), its earliest occurrence; at most ``k`` tokens after it, none past max_model_len."""
    total = len(h)
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = h[total - n :]
        for start in range(total - n):  # start + n <= total - 1
            if h[start : start + n] == suffix:
                return h[start + n : start + n + k]
    return []


def _step(ix: NgramIndex, new: dict[int, list[int]]) -> None:
    slots = np.array(list(new), dtype=np.int64)
    tokens = np.array([t for toks in new.values() for t in toks], dtype=np.int32)
    offsets = np.cumsum([0, *map(len, new.values())]).astype(np.int64)
    ix.step(slots, tokens, offsets, np.ones(len(slots), dtype=np.bool_))


@st.composite
def traffic(draw: st.DrawFn) -> tuple[int, int, int, int, list[int], int]:
    min_n = draw(st.integers(1, 3))
    max_n = draw(st.integers(min_n, 5))
    max_k = draw(st.sampled_from([1, 2, 4, 8]))
    alphabet = draw(st.sampled_from([2, 3, 6]))  # how many of EDGE_IDS a history uses
    prompts = draw(st.lists(st.sampled_from([0, 1, 2, 40, 300, 1500]), min_size=1, max_size=4))
    seed = draw(st.integers(0, 2**32 - 1))
    return min_n, max_n, max_k, alphabet, prompts, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traffic())
def test_drafts_equal_a_rescan_under_hostile_traffic(case: tuple[int, int, int, int, list[int], int]) -> None:
    """Each step every slot brings 0-5 tokens; now and then a request is preempted and resumed (its
    history restarts a few tokens shorter), or leaves and a new one takes its slot (an id reused);
    ``max_model_len`` sits at or just past the longest history, so drafts are cut to nothing and to
    one token. After every step each slot's draft equals the rescan's."""
    min_n, max_n, max_k, alphabet, prompts, seed = case
    rng = np.random.default_rng(seed)
    ids = np.array(EDGE_IDS[:alphabet], dtype=np.int64)

    def draw_tokens(n: int) -> list[int]:
        return [int(t) for t in rng.choice(ids, n)]

    hist = {s: draw_tokens(p) for s, p in enumerate(prompts)}
    longest = max(map(len, hist.values())) + 40 * 5
    max_model_len = int(rng.choice([1 << 30, longest, longest + 1, max(map(len, hist.values())) + 3]))
    ix = NgramIndex(max_k=max_k, min_n=min_n, max_n=max_n, max_model_len=max_model_len, capacity=1)
    for s, h in hist.items():
        ix.start(s, h)
    for step in range(40):
        for s in hist:
            roll = rng.random()
            if roll < 0.05:  # preempted and resumed: vLLM dropped its last tokens
                hist[s] = hist[s][: max(0, len(hist[s]) - int(rng.integers(1, 6)))]
                ix.start(s, hist[s])
            elif roll < 0.08:  # finished; a new request (an id reused) takes the slot
                ix.release(s)
                hist[s] = draw_tokens(int(rng.choice([0, 1, 30])))
                ix.start(s, hist[s])
        new = {s: draw_tokens(int(rng.integers(0, 6))) for s in hist}
        _step(ix, new)
        for s, toks in new.items():
            hist[s] += toks
            assert ix.tokens(s).tolist() == hist[s]
            want = brute_draft(hist[s], min_n, max_n, max_model_len, max_k)
            assert ix.draft(s).tolist() == want, (step, s, len(hist[s]))


@pytest.mark.parametrize("extra", [0, 1, 8])
def test_a_long_history_at_max_model_len(extra: int) -> None:
    """A 128k-token history (a long-context model's whole window), drafting where the model has 0, 1
    or 8 positions left: the draft never runs past max_model_len."""
    rng = np.random.default_rng(7)
    h = [int(t) for t in rng.integers(0, 50, 128 * 1024)]
    ix = NgramIndex(max_k=8, max_model_len=len(h) + extra)
    ix.start(0, h)
    _step(ix, {0: []})
    assert ix.draft(0).tolist() == brute_draft(h, 1, 3, len(h) + extra, 8)
    assert len(ix.draft(0)) == min(extra, 8)


def test_the_table_follows_live_requests_not_requests_seen() -> None:
    """2,000 requests of 30-150 tokens (ids of a 32k vocabulary) pass through 8 slots, each prefilled,
    then decoding 3 tokens and leaving. Every rebuild of the table drops the finished requests'
    entries; it must also be sized by the entries that survive it: sized by all it held (finished
    ones included) it doubled at each rebuild, without bound (2**26 rows, 1.5 GiB, after 20,000
    such requests)."""
    rng = np.random.default_rng(3)
    ix = NgramIndex(max_k=4, capacity=8)
    most = 0
    for r in range(2000):
        s = r % 8
        ix.start(s, rng.integers(0, 32_000, int(rng.integers(30, 150))).astype(np.int32))
        for _ in range(3):
            _step(ix, {s: [int(rng.integers(0, 32_000))]})
        ix.release(s)
        most = max(most, len(ix.arrays()[2]))
    # 8 live requests of at most 153 tokens hold at most 8 * 153 * 3 entries; the table stays within
    # a power of two of 4x that (plus one request's worth being added).
    assert most <= 1 << 15, most
    assert len(ix.arrays()[1]) == 1 << 16  # the arena never needed to grow either
