"""n-gram drafts and their counterfactual acceptance, from each request's own token history.

n-gram drafting is a pure function of the token history, so the plugin computes the n-gram draft of
every request every step (in the engine-core process, from the tokens the scheduler already holds).
That one draft serves twice: it is the draft the composite drafter hands the scheduler where the rule
picks n-gram, and, where another method was verified, it is scored against the tokens that follow
("counterfactual acceptance", exact under greedy decoding) once they are known.

In the engine the matcher is vLLM's own (``_find_longest_matched_ngram_and_propose_tokens``, numba);
``match_ngram`` is the same rule in numpy for tests and for engines without numba.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from policies.observation import NOT_SCORED

#: (tokens, min_n, max_n, max_model_len, k) -> draft
Matcher = Callable[[np.ndarray, int, int, int, int], np.ndarray]


def match_ngram(tokens: np.ndarray, min_n: int, max_n: int, max_model_len: int, k: int) -> np.ndarray:
    """vLLM's prompt-lookup rule: the longest suffix n-gram (min_n..max_n) seen earlier, earliest
    occurrence first; the draft is the (at most k) tokens that followed it."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return tokens[:0]
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # A match must end before the last token (it cannot be the suffix itself).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start : start + min(k, total - start)]
    return tokens[:0]


@dataclass(slots=True)
class _History:
    tokens: np.ndarray
    n: int
    pending_start: int = -1  # history length when the pending counterfactual draft was made
    pending: np.ndarray | None = None
    draft: np.ndarray | None = None  # this step's n-gram draft (for the composite drafter)


class NgramScorer:
    """Per-request token histories, current n-gram drafts and counterfactual scoring."""

    def __init__(
        self,
        *,
        max_k: int,
        min_n: int = 1,
        max_n: int = 3,
        max_model_len: int = 1 << 30,
        matcher: Matcher = match_ngram,
    ) -> None:
        self.max_k = max_k
        self.min_n, self.max_n = min_n, max_n
        self.max_model_len = max_model_len
        self.matcher = matcher
        self._h: dict[str, _History] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._h

    def __len__(self) -> int:
        return len(self._h)

    def start(self, request_id: str, tokens: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(tokens, dtype=np.int32)
        buf = np.zeros(max(64, 2 * len(arr)), dtype=np.int32)
        buf[: len(arr)] = arr
        self._h[request_id] = _History(buf, len(arr))

    def extend(self, request_id: str, new_tokens: Sequence[int]) -> int:
        """Append a step's tokens; returns the counterfactual count this resolved, or NOT_SCORED."""
        h = self._h[request_id]
        m = len(new_tokens)
        if h.n + m > len(h.tokens):
            grown = np.zeros(max(2 * len(h.tokens), h.n + m), dtype=np.int32)
            grown[: h.n] = h.tokens[: h.n]
            h.tokens = grown
        h.tokens[h.n : h.n + m] = new_tokens
        h.n += m
        if h.pending is None:
            return NOT_SCORED
        d = h.pending
        seen = h.tokens[h.pending_start : min(h.n, h.pending_start + len(d))]
        same = d[: len(seen)] == seen
        prefix = int(np.argmin(same)) if not same.all() else len(seen)
        if prefix < len(seen) or len(seen) == len(d):
            h.pending = None
            return prefix
        return NOT_SCORED  # every token so far matched; wait for the rest

    def tokens(self, request_id: str) -> np.ndarray:
        h = self._h[request_id]
        return h.tokens[: h.n]

    def propose(self, request_id: str) -> np.ndarray:
        """This step's n-gram draft (up to max_k); it becomes the pending counterfactual if none is."""
        h = self._h[request_id]
        d = np.asarray(
            self.matcher(h.tokens[: h.n], self.min_n, self.max_n, self.max_model_len, self.max_k),
            dtype=np.int32,
        )
        h.draft = d
        if h.pending is None:  # an empty draft scores 0: n-gram would have drafted nothing
            h.pending, h.pending_start = d.copy(), h.n
        return d

    def draft(self, request_id: str) -> np.ndarray | None:
        h = self._h.get(request_id)
        return None if h is None else h.draft

    def release(self, request_id: str) -> None:
        self._h.pop(request_id, None)
