"""The per-class oracle on a trace of many traffic classes (a class per user, or per request).

What must hold: its coordinate ascent, each trial a replay of the whole trace, tries a bounded number
of classes (``MAX_ORACLE_CLASSES``, those of the most output tokens), so its work grows with the trace
and not with classes x trace: a trace of 600 one-request classes took 28 s where 2 classes took 1.6 s,
and one of 20,000 hours. The classes tried are chosen as before where there are no more than that, and
the oracle stays at least the best single arm it starts from.
"""

from __future__ import annotations

import numpy as np
import pytest

import sim.oracle as oracle
from policies.arms import Method
from sim.costmodel import load_profile
from sim.oracle import MAX_ORACLE_CLASSES, compute_oracles
from sim.trace import Trace


def _trace(n: int, classes: int) -> Trace:
    out = np.full(n, 4, np.int64)
    out[0] = 40  # class c0 holds the most output tokens
    acc = np.concatenate([np.full(int(o), i % 5, np.int32) for i, o in enumerate(out)])
    return Trace(
        max_k=4,
        methods=(Method.EAGLE3, Method.NGRAM),
        ids=tuple(f"r{i}" for i in range(n)),
        classes=tuple(f"c{i % classes}" for i in range(n)),
        prompt_tokens=np.full(n, 10, np.int64),
        output_tokens=out,
        arrival_s=np.full(n, np.nan),
        acc={Method.EAGLE3: acc, Method.NGRAM: np.zeros_like(acc)},
    )


def test_the_per_class_ascent_tries_a_bounded_number_of_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = oracle.schedule_closed

    def counted(*a: object, **k: object) -> object:
        nonlocal calls
        if k.get("label") == "oracle per class":
            calls += 1
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(oracle, "schedule_closed", counted)
    tr = _trace(3 * MAX_ORACLE_CLASSES, 3 * MAX_ORACLE_CLASSES)
    o = compute_oracles(tr, load_profile("llama-3.1-8b-h100"), 4, per_step=False)
    # one run from the start, then two passes of every other candidate arm for each class tried
    assert calls <= 1 + 2 * MAX_ORACLE_CLASSES * 5  # was 1 + 2 x 96 x 5
    assert len(o.per_class_arms) == 3 * MAX_ORACLE_CLASSES  # every class still has its arm
