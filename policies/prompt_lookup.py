"""vLLM's n-gram (prompt-lookup) drafting rule, stated directly: a pure function of the token history.

The plugin's incremental index (``controller.vllm.ngram.NgramIndex``) must give the same drafts, and
the simulator's trace importer scores n-gram counterfactuals with it, so the rule lives below both.
"""

from __future__ import annotations

import numpy as np

#: The plugin's n-gram sizes unless SPECCONTROL_NGRAM_MIN/MAX say otherwise (vLLM's own n-gram
#: drafter: prompt_lookup_min/max); ``trace record`` computes proposals with them by default.
DEFAULT_MIN_N, DEFAULT_MAX_N = 1, 3
#: The longest n-gram matched anywhere (plugin, importer, trace record): the plugin's index keeps n in
#: 6 bits of a position word.
MAX_NGRAM = 63


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


__all__ = ["DEFAULT_MAX_N", "DEFAULT_MIN_N", "MAX_NGRAM", "match_ngram"]
