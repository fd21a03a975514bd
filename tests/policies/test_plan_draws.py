"""A bucket whose contexts were all idle gets only its plan's random draws (``Learner.plan_draws``),
and its greedy plan only when something reads it: the decisions must be exactly those of planning
every bucket both ways, round after round (same directives, same random stream)."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policies.algorithms.base import Learner
from policies.arms import Arm, Method
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.presets import load_preset

ARMS = tuple(Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:3", "eagle3:4", "ngram:4", "off"))


def report(rng: np.random.Generator, t: float, batch: int, granularity: Granularity) -> StepBatch:
    steps = []
    for i in range(4):
        per_request = granularity is not Granularity.BATCH_STEP
        k = rng.integers(0, 5, batch) if per_request else np.full(batch, 2)
        method = (
            [(Method.EAGLE3, Method.NGRAM)[m] for m in rng.integers(0, 2, batch)]
            if granularity is Granularity.REQUEST_METHOD
            else [Method.EAGLE3] * batch
        )
        steps.append(
            StepObservation.build(
                time_s=t + i * 0.01,
                duration_s=float(0.01 + 0.002 * k.max() + rng.random() * 0.002),
                traffic_class=[("chat", "code", "math")[c] for c in rng.integers(0, 3, batch)],
                method=method,
                k=k,
                drafted=k,
                accepted=rng.integers(0, k + 1),
                batch_size=batch,
            )
        )
    return StepBatch(steps=steps)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    granularity=st.sampled_from(list(Granularity)),
    batches=st.lists(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 200]), min_size=3, max_size=12),
)
@example(seed=3234, granularity=Granularity.REQUEST_METHOD, batches=[1, 1, 1])  # NaN estimates compared
def test_draws_only_for_idle_buckets_decides_as_planning_every_bucket(
    seed: int, granularity: Granularity, batches: list[int]
) -> None:
    engine = EngineInfo(
        engine_id="e", model="m", max_k=4, arms=ARMS, granularity=granularity, max_batch_size=256
    )
    lazy = ControlLoop(spec=load_preset("default"), engine=engine, seed=seed)
    full = ControlLoop(spec=load_preset("default"), engine=engine, seed=seed)
    # The reference plans every bucket in full and drops the plan (Learner's own plan_draws).
    full.learner.plan_draws = lambda b, c, a: Learner.plan_draws(full.learner, b, c, a)  # type: ignore[method-assign]
    rng_a, rng_b = np.random.default_rng(seed), np.random.default_rng(seed)
    t = 0.0
    for batch in batches:  # one load level per round: the other buckets sit idle
        lazy.observe(report(rng_a, t, batch, granularity))
        full.observe(report(rng_b, t, batch, granularity))
        t += 1.5
        a, b = lazy.decide(t), full.decide(t)
        assert a == b
        # Field by field: a change's estimate may be NaN (no estimate), which == never matches.
        assert [(c.context, c.before, c.after) for c in lazy.last_changes] == [
            (c.context, c.before, c.after) for c in full.last_changes
        ]
        np.testing.assert_array_equal(
            [c.estimate for c in lazy.last_changes], [c.estimate for c in full.last_changes]
        )
    assert lazy.learner.rng.bit_generator.state == full.learner.rng.bit_generator.state
