"""Report batches as large as engines send them (up to 1,024 steps, 512 requests a step) for every preset
and granularity: the loop learns from them and decides, without overflowing any index arithmetic.

Regression: method codes are int8 and a batch of 64 steps overflowed ``code * 2 * steps``
(goodput_model's acceptance histogram), which killed a batch-granular engine's stream.
"""

from __future__ import annotations

import numpy as np
import pytest

from policies.arms import Arm, Method
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.presets import load_preset, preset_names

ARMS = tuple(Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:3", "eagle3:4", "ngram:4", "off"))


def steps(n_steps: int, n_requests: int, granularity: Granularity, seed: int) -> list[StepObservation]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_steps):
        if granularity is Granularity.REQUEST_METHOD:
            meth = [Method.EAGLE3 if m else Method.NGRAM for m in rng.integers(0, 2, n_requests)]
        else:
            meth = [Method.EAGLE3] * n_requests
        k = (
            np.full(n_requests, 4)
            if granularity is Granularity.BATCH_STEP
            else rng.integers(0, 5, n_requests)
        )
        accepted = rng.integers(0, k + 1)
        out.append(
            StepObservation.build(
                time_s=i * 0.02,
                duration_s=0.02,
                traffic_class=[("chat", "code")[c] for c in rng.integers(0, 2, n_requests)],
                method=meth,
                k=k,
                drafted=k,
                accepted=accepted,
                batch_size=n_requests,
            )
        )
    return out


@pytest.mark.parametrize("granularity", list(Granularity))
@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_learns_from_1024_step_batches(preset: str, granularity: Granularity) -> None:
    engine = EngineInfo(
        engine_id="e", model="m", max_k=4, arms=ARMS, granularity=granularity, max_batch_size=512
    )
    loop = ControlLoop(spec=load_preset(preset), engine=engine, seed=0)
    for n_steps, n_requests in ((1024, 2), (64, 512), (200, 32)):
        loop.observe(StepBatch(steps=steps(n_steps, n_requests, granularity, seed=n_steps)))
        loop.decide(loop.totals.steps * 0.02 + 10.0)
    assert loop.totals.steps == 1024 + 64 + 200
