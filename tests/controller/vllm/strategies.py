"""Hypothesis strategies shared by the worker drafters' tests (``DraftMerger``, ``DeviceDrafter``)."""

from __future__ import annotations

from hypothesis import strategies as st

#: One batch step of up to 6 rows, as a tuple: the sampled rows (6 x (k + 1), -1: a rejected slot),
#: bit masks of the rows on n-gram, discarded (partial prefills), finished before the step, restarted
#: (resumed after preemption); the rows in the batch (1..6); the rows sampled (0..6, the rest did not step).
BatchStep = tuple[list[list[int]], int, int, int, int, int, int]


def batch_steps(k: int) -> st.SearchStrategy[list[BatchStep]]:
    return st.lists(
        st.tuples(
            st.lists(st.lists(st.integers(-1, 4), min_size=k + 1, max_size=k + 1), min_size=6, max_size=6),
            st.integers(0, 63),
            st.integers(0, 63),
            st.integers(0, 63),
            st.integers(0, 63),
            st.integers(1, 6),
            st.integers(0, 6),
        ),
        min_size=1,
        max_size=30,
    )
