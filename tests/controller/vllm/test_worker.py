"""The worker-side n-gram merge (async scheduling): histories from sampled rows, whole-row replacement
only for requests named on n-gram, checked against the n-gram rule on the full history."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.vllm.worker import DraftMerger
from policies.prompt_lookup import match_ngram

K = 4


def _merger() -> DraftMerger:
    return DraftMerger(max_k=K, min_n=1, max_n=3, max_model_len=1 << 20)


def test_rows_on_ngram_replaced_others_kept_short_drafts_padded() -> None:
    m = _merger()
    prompts = {"a": [5, 6, 7, 5, 6], "b": [1, 2, 3], "c": [9, 8]}
    m.observe(["a", "b", "c"], [[7, -1, -1], [4, -1, -1], [9, -1, -1]], [False] * 3, prompts.get)
    eagle = np.full((3, K), 100, dtype=np.int64)
    out = m.merge(["a", "b", "c"], eagle, {"a", "b", "c"})
    assert out is not None
    # a: 5 6 7 5 6 7: the suffix 5 6 7 first occurs at 0 and is followed by 5 6 7
    assert out[0].tolist() == [5, 6, 7, 7]  # three tokens, padded with the last
    assert out[1].tolist() == [100] * K  # 1 2 3 4: no match, EAGLE's row stays
    assert out[2].tolist() == [8, 9, 9, 9]  # 9 8 9: "9" first seen at 0, followed by 8 9
    assert eagle.tolist() == [[100] * K] * 3  # the input is not modified
    assert m.merge(["a", "b", "c"], eagle, {"b"}) is None  # nothing changes: no copy
    assert m.merge(["a", "b", "c"], eagle, set()) is None


def test_discarded_rows_finished_and_restarted_requests() -> None:
    m = _merger()
    prompts = {"a": [1, 2, 1, 2], "b": [3, 3, 3]}
    # a is a partial prefill this step: not started, its sampled token thrown away
    m.observe(["a", "b"], [[77], [3]], [True, False], prompts.get)
    assert len(m) == 1
    m.observe(["a", "b"], [[1], [3]], [False, False], prompts.get)
    assert len(m) == 2
    out = m.merge(["a"], np.zeros((1, K), dtype=np.int64), {"a"})
    assert out is not None and out[0].tolist() == [2, 1, 1, 1]  # 1 2 1 2 1: "1 2 1" first at 0
    m.observe([], [], [], prompts.get, finished=["b"])
    assert len(m) == 1
    # a restarted request is rebuilt from what the runner knows
    m.observe(["a"], [[9]], [False], lambda r: [9, 4], restarted=["a"])
    out = m.merge(["a"], np.zeros((1, K), dtype=np.int64), {"a"})
    assert out is not None and out[0].tolist() == [4, 9, 9, 9]  # 9 4 9: "9" first at 0
    # prompt embeddings: no token ids, never on n-gram
    m.observe(["e"], [[1]], [False], lambda r: None)
    assert m.merge(["e"], np.zeros((1, K), dtype=np.int64), {"e"}) is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=30),
    st.lists(st.lists(st.integers(-1, 5), min_size=1, max_size=K + 1), min_size=1, max_size=40),
    st.integers(1, 8),
)
def test_merge_equals_the_rule_on_the_full_history(prompt: list[int], steps: list[list[int]], n: int) -> None:
    """n requests with the same stream but offset prompts: every step, every row equals vLLM's rule on
    the request's full history (prompt plus accepted tokens), or EAGLE's row where the rule drafts nothing."""
    m = _merger()
    ids = [f"r{i}" for i in range(n)]
    hist = {r: [i, *prompt] for i, r in enumerate(ids)}
    base = {r: list(h) for r, h in hist.items()}
    for row in steps:
        m.observe(ids, [row] * n, [False] * n, base.get)
        for r in ids:
            hist[r] += [t for t in row if t >= 0]
        eagle = np.full((n, K), -7, dtype=np.int64)
        on = set(ids[::2])
        out = m.merge(ids, eagle, on)
        got = eagle if out is None else out
        for i, r in enumerate(ids):
            want = (
                match_ngram(np.array(hist[r], dtype=np.int32), 1, 3, 1 << 20, K).tolist() if r in on else []
            )
            if want:
                assert got[i].tolist() == want + [want[-1]] * (K - len(want))
            else:
                assert got[i].tolist() == [-7] * K
