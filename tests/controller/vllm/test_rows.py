"""The plugin's per-request rows (``controller.vllm.rows.columns_row``) always pass the sidecar's rules.

Whatever plan a slot recorded (none, off, EAGLE-3, n-gram, any K) and whatever vLLM then drafted and
sampled, the row reported is one the sidecar takes (``controller.validation``): K within max_k, drafted
within K, accepted within drafted, and an ``off`` row with no draft at all (the sidecar refuses an
"off" row that claims drafts: it would inflate acceptance). Runs with or without numba.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.vllm.rows import PLAN_K, PLAN_METHOD, PLAN_PROPOSAL, columns_row
from policies.arms import METHOD_CODES, Method
from policies.observation import NOT_SCORED

MAX_K = 8
_OFF = METHOD_CODES[Method.OFF]
_CODES = [-1, *METHOD_CODES.values()]


@settings(max_examples=400, deadline=None)
@given(
    plan=st.sampled_from(_CODES),
    plan_k=st.integers(0, MAX_K),
    drafted=st.integers(0, MAX_K),
    sampled=st.integers(0, MAX_K + 1),
    cf=st.integers(NOT_SCORED, MAX_K),
    configured=st.sampled_from([METHOD_CODES[Method.EAGLE3], METHOD_CODES[Method.NGRAM]]),
    proposal=st.integers(-1, 64),
)
def test_every_reported_row_is_one_the_sidecar_takes(
    plan: int, plan_k: int, drafted: int, sampled: int, cf: int, configured: int, proposal: int
) -> None:
    verifying = np.full((4, 3), -1, dtype=np.int64)
    verifying[2, PLAN_METHOD], verifying[2, PLAN_K], verifying[2, PLAN_PROPOSAL] = plan, plan_k, proposal
    sampled = min(sampled, drafted + 1)  # vLLM samples at most the draft and one bonus token
    method, k, accepted, cf_out, prop_out = columns_row(
        verifying, 2, sampled, drafted, cf, configured, MAX_K, 0
    )
    assert 0 <= k <= MAX_K and drafted <= k and 0 <= accepted <= drafted
    if method == _OFF:
        assert k == 0 and drafted == 0 and accepted == 0
    assert method in METHOD_CODES.values()
    assert cf_out <= MAX_K and prop_out <= MAX_K
    assert verifying[2, PLAN_METHOD] == -1  # the plan is read once


def test_drafts_under_an_off_plan_are_reported_as_the_engines_drafter() -> None:
    verifying = np.full((1, 3), -1, dtype=np.int64)
    verifying[0, PLAN_METHOD], verifying[0, PLAN_K] = _OFF, 0
    eagle = METHOD_CODES[Method.EAGLE3]
    method, k, accepted, _, _ = columns_row(verifying, 0, 3, 4, NOT_SCORED, eagle, MAX_K, 0)
    assert (method, k, accepted) == (eagle, 4, 2)
