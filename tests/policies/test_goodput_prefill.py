"""The goodput model's cost fit counts the prefill tokens a step carries, so prefill is not blamed on drafts."""

import dataclasses

import numpy as np
import pytest

from policies.algorithms import GoodputModel
from policies.arms import Arm
from policies.observation import StepBatch
from tests.policies.test_goodput_model import ARMS, cost_ms, model, steps

PREFILL_MS_PER_TOKEN = 0.05  # prompt tokens cost what verified tokens cost: one forward over both


def run(m: GoodputModel, report_prefill: bool) -> None:
    """Short drafts while nothing is prefilled, then long drafts during a burst of new prompts."""
    rng = np.random.default_rng(3)
    for arm, prefill in ((Arm.parse("eagle3:1"), 0), (Arm.parse("eagle3:4"), 400), (Arm.parse("off"), 0)):
        for batch in (4, 8):
            for _ in range(30):
                obs = steps(rng, arm, batch, 0.6)
                obs = dataclasses.replace(
                    obs,
                    duration_s=obs.duration_s + prefill * PREFILL_MS_PER_TOKEN / 1e3,
                    prefill_tokens=prefill if report_prefill else 0,
                )
                m.observe(StepBatch.of(obs), ["x"], per_class=False)


def predicted_ms(m: GoodputModel, arm: str, batch: int) -> float:
    return float(m._costs(m._theta(sample=False), float(batch), np.array([ARMS.index(Arm.parse(arm))]))[0])


def test_prefill_time_is_not_charged_to_long_drafts() -> None:
    m = model(ridge=1e-6)
    run(m, report_prefill=True)
    want = cost_ms(8, 4, 8 * 5)
    assert predicted_ms(m, "eagle3:4", 8) == pytest.approx(want, rel=0.03)
    # Unreported, the burst's 20 ms land on the long drafts (what the field makes avoidable).
    blind = model(ridge=1e-6)
    run(blind, report_prefill=False)
    assert predicted_ms(blind, "eagle3:4", 8) > 1.5 * want
