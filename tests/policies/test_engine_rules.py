"""The engine-side clamp (policies/engine_rules.py): one row rule, ``clamp_row``, that the plugin's
compiled plan kernel calls per request and ``clamp_plan`` runs over a whole plan (the simulator, the
plugin's uncompiled path). Both forms agree on every input, compiled and not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arms import METHOD_CODES, METHODS_BY_CODE, OFF, Arm, Method
from policies.engine_rules import (
    clamp_plan,
    clamp_row,
    drafter_k_guess,
    drafter_k_row,
    safe_default_directive,
    startup_table_directive,
)

pytestmark = pytest.mark.usefixtures("kernels")

_CODES = st.integers(0, len(METHODS_BY_CODE) - 1)
_OFF, _NGRAM = METHOD_CODES[Method.OFF], METHOD_CODES[Method.NGRAM]
_I32 = np.iinfo(np.int32)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.tuples(_CODES, st.integers(int(_I32.min), int(_I32.max))), max_size=600),
    configured=st.sampled_from(list(Method)),
    composite=st.booleans(),
    max_k=st.integers(1, 64),
)
def test_the_plan_form_is_the_row_rule_on_every_row(
    rows: list[tuple[int, int]], configured: Method, composite: bool, max_k: int
) -> None:
    methods = np.array([m for m, _ in rows], dtype=np.int8)
    ks = np.array([k for _, k in rows], dtype=np.int32)
    out_m, out_k = clamp_plan(methods, ks, configured=configured, composite=composite, max_k=max_k)
    assert out_m.dtype == methods.dtype and out_k.dtype == ks.dtype
    want = [clamp_row(int(m), int(k), METHOD_CODES[configured], composite, max_k) for m, k in rows]
    assert list(zip(out_m.tolist(), out_k.tolist(), strict=True)) == want
    # What the rule is: a playable method or off; K in 1..max_k, or off with K = 0.
    playable = {_OFF, METHOD_CODES[configured]} | ({_NGRAM} if composite else set())
    for (m, k), (om, ok) in zip(rows, want, strict=True):
        assert om in playable
        assert (om == _OFF) == (ok == 0) and 0 <= ok <= max_k
        if om != _OFF:
            assert ok == min(k, max_k) and (om == m or m not in playable)


def test_edges() -> None:
    e3, pe = METHOD_CODES[Method.EAGLE3], METHOD_CODES[Method.P_EAGLE]
    assert clamp_row(_NGRAM, 3, e3, False, 8) == (e3, 3)  # no composite drafter: n-gram is not drafted
    assert clamp_row(_NGRAM, 3, e3, True, 8) == (_NGRAM, 3)
    assert clamp_row(pe, 9, e3, True, 8) == (e3, 8)  # another method falls back, K capped
    assert clamp_row(e3, 0, e3, True, 8) == (_OFF, 0) == clamp_row(e3, -1, e3, True, 8)
    assert clamp_row(_OFF, 5, e3, True, 8) == (_OFF, 0)
    assert clamp_row(e3, 4, _OFF, False, 8) == (_OFF, 0)  # an engine without speculation drafts nothing
    m, k = clamp_plan(
        np.zeros(0, np.int8), np.zeros(0, np.int64), configured=Method.EAGLE3, composite=True, max_k=4
    )
    assert m.shape == k.shape == (0,)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            _CODES, st.integers(int(_I32.min), int(_I32.max)), st.integers(-1, len(METHODS_BY_CODE) - 1)
        ),
        max_size=600,
    ),
    configured=st.sampled_from([Method.EAGLE3, Method.P_EAGLE]),
    composite=st.booleans(),
    max_k=st.integers(1, 64),
)
def test_the_drafter_k_guess_is_the_largest_k_of_the_configured_drafters_rows_not_in_a_span(
    rows: list[tuple[int, int, int]], configured: Method, composite: bool, max_k: int
) -> None:
    # Synchronous scheduling's guess of the K the configured drafter runs at (batches of up to 600
    # rows, K across int32): each row's class arm as the engine plays it, where that is the
    # configured drafter and the row's pending plan is not n-gram's; 0 for none.
    methods = np.array([m for m, _, _ in rows], dtype=np.int8)
    ks = np.array([k for _, k, _ in rows], dtype=np.int32)
    pending = np.array([p for _, _, p in rows], dtype=np.int8)
    got = drafter_k_guess(methods, ks, pending, configured=configured, composite=composite, max_k=max_k)
    code = METHOD_CODES[configured]

    def row_k(m: int, k: int, p: int) -> int:
        cm, ck = clamp_row(m, k, code, composite, max_k)
        return ck if p != _NGRAM and cm == code else 0

    want = [row_k(m, k, p) for m, k, p in rows]
    assert got == max(want, default=0) and 0 <= got <= max_k
    assert [drafter_k_row(m, k, p, code, composite, max_k) for m, k, p in rows] == want


@settings(max_examples=200, deadline=None)
@given(
    max_k=st.integers(1, 8),
    runs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 10)), min_size=1, max_size=12),
    method=st.sampled_from([Method.EAGLE3, Method.P_EAGLE, Method.NGRAM]),
)
def test_the_start_up_table_is_the_engines_own_at_every_batch_size(
    max_k: int, runs: list[tuple[int, int]], method: Method
) -> None:
    # vLLM's dynamic_sd_lookup (index = batch size): runs of equal K, the last open-ended. The engine
    # on its own must play exactly that (K capped at its max), for any class.
    lookup = [max_k] + [k for n, k in runs for _ in range(n)]
    d = startup_table_directive(lookup, method, max_k=max_k)
    assert d.version == 0
    for bs in range(1, len(lookup) + 5):
        want = min(lookup[min(bs, len(lookup) - 1)], max_k)
        assert d.k_for_batch(bs, max_k) == want
        assert d.arm_for("any-class", bs) == (Arm(method, want) if want else OFF)


def test_a_start_up_table_of_one_k_is_the_one_arm_safe_default() -> None:
    assert startup_table_directive([4] * 9, Method.EAGLE3, max_k=4) == safe_default_directive(
        Arm(Method.EAGLE3, 4), max_k=4
    )
    with pytest.raises(ValueError, match="lookup"):
        startup_table_directive([3], Method.EAGLE3, max_k=4)
