from __future__ import annotations

import numpy as np

from controller.vllm.ngram import NgramScorer, match_ngram
from policies.observation import NOT_SCORED


def test_match_takes_longest_suffix_earliest_occurrence() -> None:
    t = np.array([5, 1, 2, 9, 1, 2, 7, 1, 2], dtype=np.int32)
    # suffix [1, 2] first occurs at 1 -> the draft is what followed it
    assert match_ngram(t, 1, 3, 1 << 20, 4).tolist() == [9, 1, 2, 7]
    assert match_ngram(t, 1, 3, 1 << 20, 2).tolist() == [9, 1]
    assert match_ngram(np.array([1, 2, 3], dtype=np.int32), 1, 3, 1 << 20, 4).tolist() == []
    # never beyond the model length
    assert match_ngram(t, 1, 3, len(t) + 1, 4).tolist() == [9]


def test_counterfactual_scored_once_following_tokens_known() -> None:
    s = NgramScorer(max_k=4)
    s.start("r", [7, 8, 9, 7, 8])
    assert s.propose("r").tolist() == [9, 7, 8]
    # the next verified step emitted one token that matches: not final yet
    assert s.extend("r", [9]) == NOT_SCORED
    assert s.extend("r", [7, 5]) == 2  # 9, 7 matched, then 5 != 8
    s.propose("r")
    assert s.draft("r") is not None


def test_counterfactual_full_match_and_empty_draft() -> None:
    s = NgramScorer(max_k=2)
    s.start("a", [1, 2, 1])
    assert s.propose("a").tolist() == [2, 1]
    assert s.extend("a", [2, 1, 4]) == 2
    s.start("b", [1, 2, 3])
    assert s.propose("b").tolist() == []
    assert s.extend("b", [4]) == 0  # n-gram would have drafted nothing
    s.release("b")
    assert "b" not in s and len(s) == 1


def test_history_grows_past_its_buffer() -> None:
    s = NgramScorer(max_k=4)
    s.start("r", [0])
    for i in range(500):
        s.extend("r", [i % 7, (i + 1) % 7])
    assert len(s.tokens("r")) == 1001
    assert s.tokens("r")[-2:].tolist() == [499 % 7, 500 % 7]
