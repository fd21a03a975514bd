"""The goodput model refuses non-finite statistics (issue 15, finding 1).

A finite duration of 1e154 s squares to infinity in the cost model's normal equations, and NaN from
there on made every estimate, status and snapshot fail. The edge now bounds durations; the model
itself also refuses an update that would leave its statistics non-finite (keeping what it had), and
a saved state holding NaN or infinity, so no path can poison it.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from policies.arms import Method
from policies.context import Context
from policies.observation import StepBatch, StepObservation
from tests.policies.test_goodput_model import model


def _obs(duration_s: float, n: int = 4) -> StepObservation:
    return StepObservation.build(
        time_s=0.0,
        duration_s=duration_s,
        traffic_class=["chat"] * n,
        method=[Method.EAGLE3] * n,
        k=[2] * n,
        drafted=[2] * n,
        accepted=[1] * n,
    )


def _finite(m: object) -> None:
    json.dumps(m.state_dict(), allow_nan=False)  # type: ignore[attr-defined]
    for ctx in (Context.parse("1-1/*"), Context.parse("2-4/chat")):
        est = m.estimates(ctx)  # type: ignore[attr-defined]
        assert np.isfinite(est).all(), est


@pytest.mark.parametrize("huge", [1e154, 1e200, math.inf])
@pytest.mark.parametrize("batched", [False, True])
def test_an_overflowing_step_is_refused_and_the_model_keeps_what_it_had(huge: float, batched: bool) -> None:
    m = model()
    for _ in range(50):
        m.observe(StepBatch.of(_obs(0.02)), ["2-4"], per_class=True)
    before = m.state_dict()
    if batched:
        m.observe(StepBatch(steps=[_obs(0.02), _obs(huge), _obs(0.02)]), ["2-4"] * 3, per_class=True)
    else:
        m.observe(StepBatch.of(_obs(huge)), ["2-4"], per_class=True)
    assert m.refused_updates == 1
    after = m.state_dict()
    assert (after["xtx"], after["xty"], after["yy"], after["w"]) == (
        before["xtx"],
        before["xty"],
        before["yy"],
        before["w"],
    )
    _finite(m)
    # And it goes on learning from sane steps.
    m.observe(StepBatch.of(_obs(0.02)), ["2-4"], per_class=True)
    assert m.state_dict()["w"] > before["w"]


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("yy", math.nan, "yy: expected a finite number in [0, inf], got nan"),
        ("w", math.inf, "w: expected a finite number in [0, inf], got inf"),
        ("w", -1.0, "w: expected a finite number in [0, inf], got -1.0"),
        ("xty", [math.nan] * 7, "xty: every value must be finite and in [0, inf]"),
    ],
)
def test_a_saved_state_with_non_finite_statistics_is_refused(key: str, value: object, says: str) -> None:
    m = model()
    for _ in range(20):
        m.observe(StepBatch.of(_obs(0.02)), ["2-4"], per_class=True)
    state = m.state_dict()
    if key == "xty":
        value = [math.nan] * len(state["xty"])
    state[key] = value
    fresh = model()
    with pytest.raises(ValueError, match=re.escape(says)):
        fresh.load_state_dict(state)
    assert fresh.state_dict() == model().state_dict()  # nothing of the refused state was taken
