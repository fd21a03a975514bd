"""Page-Hinkley drift detection and the re-exploration it triggers (seeded)."""

import numpy as np
import pytest

from policies.algorithms import GoodputModel
from policies.arms import Arm, Method
from policies.context import Context
from policies.drift import DRIFT_FIELDS, PageHinkley
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.spec import parse_policy

DEFAULTS = {k: p.default for k, p in DRIFT_FIELDS.items()}
ARMS = tuple(Arm.parse(a) for a in ("eagle3:2", "eagle3:4", "ngram:4", "off"))
COMPOSITE = EngineInfo("e1", "m", 4, ARMS, Granularity.REQUEST_METHOD)
STOCK = EngineInfo("e2", "m", 4, tuple(a for a in ARMS if a.method is not Method.NGRAM))


def detector() -> PageHinkley:
    return PageHinkley(float(DEFAULTS["delta"]), float(DEFAULTS["threshold"]), int(DEFAULTS["min_samples"]))


@pytest.mark.parametrize("seed", range(5))
def test_no_false_alarm_on_a_stationary_stream(seed: int) -> None:
    # 20,000 Bernoulli(0.6) samples one at a time with the default parameters: no alarm.
    rng = np.random.default_rng(seed)
    d = detector()
    assert not any(d.add(float(x), 1) for x in rng.random(20_000) < 0.6)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("before", "after"), [(0.6, 0.3), (0.3, 0.6)])
def test_detects_a_mean_shift_within_300_samples(seed: int, before: float, after: float) -> None:
    rng = np.random.default_rng(100 + seed)
    d = detector()
    assert not any(d.add(float(x), 1) for x in rng.random(2_000) < before)
    fired = [d.add(float(x), 1) for x in rng.random(300) < after]
    assert any(fired)


def test_batched_samples_count_as_rows() -> None:
    # A step of 32 rows weighs 32 samples: the shift is found within 10 steps of batch 32.
    rng = np.random.default_rng(7)
    d = detector()
    assert not any(d.add(float((rng.random(32) < 0.6).sum()), 32) for _ in range(200))
    assert any(d.add(float((rng.random(32) < 0.3).sum()), 32) for _ in range(10))


def policy(algorithm: str, drift: str = "{detector: page_hinkley}") -> str:
    return (
        "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: t}\n"
        f"spec:\n  algorithm: {{name: {algorithm}}}\n  min_dwell_s: 0\n  drift: {drift}\n"
    )


def eagle_step(rng: np.random.Generator, p_first: float, k: int = 4, batch: int = 8) -> StepObservation:
    acc = np.where(rng.random(batch) < p_first, rng.integers(1, k + 1, size=batch), 0)
    return StepObservation.build(
        time_s=0.0,
        duration_s=0.02,
        traffic_class=["chat"] * batch,
        method=[Method.EAGLE3] * batch,
        k=[k] * batch,
        drafted=[k] * batch,
        accepted=acc,
    )


def test_goodput_model_shrinks_the_drifted_class_method_counts() -> None:
    loop = ControlLoop(spec=parse_policy(policy("goodput_model")), engine=COMPOSITE)
    assert isinstance(loop.learner, GoodputModel)
    rng = np.random.default_rng(3)
    for _ in range(100):
        loop.observe(StepBatch.of(eagle_step(rng, 0.8)))
    assert loop.totals.drift_alarms == 0
    trials_before = loop.learner._acc[("chat", 0)][0, 0]
    n = 0
    while loop.totals.drift_alarms == 0 and n < 40:
        loop.observe(StepBatch.of(eagle_step(rng, 0.2)))
        n += 1
    assert loop.totals.drift_alarms >= 1
    assert {(c, m) for _, c, m in loop.drift_events} <= {("chat", Method.EAGLE3), ("*", Method.EAGLE3)}
    # 0.1 of the weight is kept: far fewer trials than before the alarm, so the posterior is wide.
    assert loop.learner._acc[("chat", 0)][0, 0] < 0.2 * trials_before + 8 * n


def test_tabular_learner_forgets_the_drifted_arms_only() -> None:
    loop = ControlLoop(
        spec=parse_policy(policy("epsilon_greedy", "{detector: page_hinkley, shrink: 0}")), engine=STOCK
    )
    rng = np.random.default_rng(4)
    loop.decide(0.0)
    off_row = StepObservation.build(
        time_s=0.0,
        duration_s=0.01,
        traffic_class=["chat"] * 8,
        method=[Method.OFF] * 8,
        k=[0] * 8,
        drafted=[0] * 8,
        accepted=[0] * 8,
    )
    for r in range(1, 60):
        loop.observe(StepBatch.of(eagle_step(rng, 0.8)))
        loop.observe(StepBatch.of(off_row))
        loop.decide(float(r))
    table = loop.learner.tables[Context.parse("5-8/*")]
    e4, off = loop.arms.index(Arm.parse("eagle3:4")), loop.arms.index(Arm.parse("off"))
    assert table.n[e4] > 0 and table.n[off] > 0
    off_weight = table.n[off]
    while loop.totals.drift_alarms == 0:
        loop.observe(StepBatch.of(eagle_step(rng, 0.2)))
    assert table.n[e4] == 0 and table.n[off] == off_weight


def test_disabled_by_default_and_state_round_trips() -> None:
    base = parse_policy(policy("goodput_model", "{}"))
    assert base.drift["detector"] == "none" and ControlLoop(spec=base, engine=COMPOSITE).drift is None
    loop = ControlLoop(spec=parse_policy(policy("goodput_model")), engine=COMPOSITE)
    rng = np.random.default_rng(5)
    for _ in range(30):
        loop.observe(StepBatch.of(eagle_step(rng, 0.5)))
    other = ControlLoop(spec=parse_policy(policy("goodput_model")), engine=COMPOSITE)
    other.load_state_dict(loop.state_dict())
    assert other.drift is not None and loop.drift is not None
    assert other.drift.state_dict() == loop.drift.state_dict()
