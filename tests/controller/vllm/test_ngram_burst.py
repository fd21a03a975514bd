"""The n-gram index gives back the memory a burst of long requests took, and does not thrash.

A burst of long requests (64 live at 4,096 tokens compiled, 32 as Python) grows the arena
and the table to what they need (at 64 x 128k tokens: a 126 MiB arena and a 3 GiB table). Once the
burst drains and short requests (16 live, 100-400 tokens) pass, both must come back to the size the
live requests need, not stay at the peak until stale entries happen to fill half the table (after
about 15,000 short requests at that size) or, for the arena, forever. A long request still live keeps
its history and its drafts through the shrink. Live counts moving within a factor of two never shrink
anything, so growth and shrinking cannot alternate.

Sizes are read off the index's arrays (``NgramIndex.arrays``): the arena's tokens and the table's rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from controller.vllm import ngram
from controller.vllm.ngram import NgramIndex
from policies.prompt_lookup import match_ngram

pytestmark = pytest.mark.usefixtures("kernels")

MAX_K = 4
NN = 3  # n-gram sizes 1..3: at most 3 table entries a token


def _sizes(ix: NgramIndex) -> tuple[int, int]:
    _, pool, table, _, _, _ = ix.arrays()
    return len(pool), len(table)


def _live_tokens(ix: NgramIndex, slots: list[int]) -> int:
    return sum(len(ix.tokens(s)) for s in slots)


def _step(ix: NgramIndex, slots: list[int], rng: np.random.Generator) -> None:
    sl = np.array(slots, dtype=np.int64)
    toks = rng.integers(0, 50, len(sl), dtype=np.int32)  # small vocabulary: drafts match often
    ix.step(sl, toks, np.arange(len(sl) + 1, dtype=np.int64), np.ones(len(sl), dtype=bool))


def _drafts_are_the_rescans(ix: NgramIndex, slots: list[int]) -> None:
    for s in slots:
        toks = ix.tokens(s).copy()
        assert ix.draft(s).tolist() == match_ngram(toks, 1, NN, 1 << 30, MAX_K).tolist(), s


def test_a_drained_burst_gives_its_memory_back(kernels: str) -> None:
    n_long, long_len = (64, 4096) if kernels == "numba" else (32, 4096)
    rng = np.random.default_rng(7)
    ix = NgramIndex(max_k=MAX_K, max_n=NN, capacity=128)
    first = _sizes(ix)
    for s in range(n_long):
        ix.start(s, rng.integers(0, 50_000, long_len, dtype=np.int32))
    _step(ix, list(range(n_long)), rng)
    peak_pool, peak_table = _sizes(ix)
    assert peak_pool >= n_long * long_len and peak_table >= 2 * n_long * long_len  # the burst's size
    keep = [0, 1]  # two long requests outlive the burst
    for s in range(2, n_long):
        ix.release(s)
    # short requests pass, 16 live, until 4x the burst's count have finished
    live: dict[int, int] = {}
    done = 0
    free = list(range(n_long, 128))
    while done < 4 * n_long:
        while len(live) < 16:
            s = free.pop()
            ix.start(s, rng.integers(0, 50, int(rng.integers(100, 400)), dtype=np.int32))
            live[s] = int(rng.integers(5, 40))
        _step(ix, [*keep, *live], rng)
        for s in [s for s, left in live.items() if left <= 1]:
            ix.release(s)
            del live[s]
            free.append(s)
            done += 1
        live = {s: left - 1 for s, left in live.items()}
    pool, table = _sizes(ix)
    slots = [*keep, *live]
    tokens = _live_tokens(ix, slots)
    # back to what the live requests need (each region holds at most 2x its tokens, plus a step's)
    assert pool <= max(first[0], 4 * 2 * (tokens + 64 * len(slots))), (pool, tokens, peak_pool)
    assert table <= max(first[1], 8 * 4 * NN * tokens), (table, tokens, peak_table)
    assert pool < peak_pool and table < peak_table
    _drafts_are_the_rescans(ix, slots)
    _step(ix, slots, rng)
    _drafts_are_the_rescans(ix, slots)
    for s in slots:
        ix.release(s)
    for _ in range(16):  # a quiet engine: what is left goes back to the initial sizes
        ix.start(0, [1, 2, 3])
        ix.release(0)
    assert _sizes(ix) == first


def _oscillate(kernels: str) -> list[tuple[int, int]]:
    """Requests of 2,000 tokens come and go, 16 live for 40 steps, then 8 for 40, and so on: the
    arena's and the table's sizes after every step."""
    rng = np.random.default_rng(3)
    ix = NgramIndex(max_k=MAX_K, max_n=NN, capacity=64)
    live: list[int] = []
    free = list(range(64))
    sizes = []
    for it in range(600 if kernels == "numba" else 200):
        target = 16 if (it // 40) % 2 == 0 else 8
        while len(live) < target:
            s = free.pop()
            ix.start(s, rng.integers(0, 50_000, 2000, dtype=np.int32))
            live.append(s)
        while len(live) > target or (live and rng.random() < 0.1):
            s = live.pop(int(rng.integers(len(live))))
            ix.release(s)
            free.append(s)
        _step(ix, live, rng)
        sizes.append(_sizes(ix))
    _drafts_are_the_rescans(ix, live)
    return sizes


def test_live_counts_within_a_factor_of_two_never_shrink(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Live requests moving between 8 and 16: the sizes step for step are those of an index that
    never shrinks on its own (only its half-load rebuilds, sized by the entries live, change them),
    so growing and shrinking do not alternate."""
    with_trim = _oscillate(kernels)
    monkeypatch.setattr(ngram, "_TRIM_EVERY", 1 << 62)
    assert with_trim == _oscillate(kernels)
