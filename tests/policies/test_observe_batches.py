"""``observe(StepBatch)``: a report of many steps equals the same steps reported one at a time (up to
float rounding), for the loop and every learner; the simulator reports one step at a time, the sidecar
hundreds."""

from typing import Any

import numpy as np
import pytest

from policies.algorithms import REGISTRY, GoodputModel
from policies.arms import Arm, Method
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import NOT_SCORED, StepBatch, StepObservation
from policies.spec import parse_policy

ARMS = tuple(
    Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:4", "ngram:2", "ngram:4", "p_eagle:4", "off")
)
CLASSES = ("chat", "code", "rag")


def random_step(rng: np.random.Generator, *, empty_ok: bool = True) -> StepObservation:
    n = int(rng.integers(0 if empty_ok else 1, 12))
    arms = [ARMS[i] for i in rng.integers(0, len(ARMS), size=n)]
    k = np.array([a.k for a in arms], dtype=int)
    drafted = np.array([rng.integers(0, kk + 1) for kk in k], dtype=int)
    accepted = np.array([rng.integers(0, d + 1) for d in drafted], dtype=int)
    cf: dict[Method, Any] = {}
    if rng.random() < 0.7:
        cf[Method.NGRAM] = np.where(rng.random(n) < 0.3, NOT_SCORED, rng.integers(0, 5, size=n))
    if rng.random() < 0.3:
        cf[Method.EAGLE3] = rng.integers(0, 2, size=n)
    obs = StepObservation.build(
        time_s=0.0,
        duration_s=float(rng.choice([0.0, 0.004, 0.011, 0.03])) if empty_ok else 0.02,
        traffic_class=[CLASSES[i] for i in rng.integers(0, len(CLASSES), size=n)],
        method=[a.method for a in arms],
        k=k,
        drafted=drafted,
        accepted=accepted,
        batch_size=n + int(rng.integers(0, 40)),
        counterfactual=cf,
        prefill_tokens=int(rng.choice([0, 0, 17, 300])),
    )
    if Method.EAGLE3 in cf:  # the head's first position, scored whatever was verified
        obs = StepObservation(
            **{f: getattr(obs, f) for f in obs.__slots__} | {"counterfactual_depth": {Method.EAGLE3: 1}}
        )
    return obs


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


def model(**params: Any) -> GoodputModel:
    full = (
        {k: p.default for k, p in GoodputModel.PARAMS.items()} | {"memory_steps": 50.0, "max_k": 3} | params
    )
    return GoodputModel(arms=ARMS, params=full, rng=np.random.default_rng(0))


@pytest.mark.parametrize("per_class", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_goodput_model_batch_equals_steps_one_by_one(per_class: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    one, many = model(), model()
    for _ in range(6):
        # What the loop hands a learner: steps with requests and time.
        batch = [random_step(rng, empty_ok=False) for _ in range(int(rng.integers(1, 8)))]
        buckets = [str(rng.choice(["1-4", "5-16", "17+"])) for _ in batch]
        for obs, b in zip(batch, buckets, strict=True):
            one.observe(StepBatch.of(obs), [b], per_class)
        many.observe(StepBatch(steps=batch), buckets, per_class)
        assert_same(one.state_dict(), many.state_dict())
    assert one._acc  # the batches did teach something


def test_every_learner_learns_a_batch_as_its_steps_in_order() -> None:
    rng = np.random.default_rng(3)
    batch = [random_step(rng, empty_ok=False) for _ in range(5)]
    for name, cls in REGISTRY.items():
        if name == "goodput_model":
            continue
        params = {k: p.default for k, p in cls.PARAMS.items()}
        one = cls(arms=ARMS, params=params, rng=np.random.default_rng(0))
        many = cls(arms=ARMS, params=params, rng=np.random.default_rng(0))
        for obs in batch:
            one.observe(StepBatch.of(obs), ["x"], True)
        many.observe(StepBatch(steps=batch), ["x"] * len(batch), True)
        assert_same(one.state_dict(), many.state_dict())


POLICY = """
apiVersion: speccontrol/v1
kind: Policy
metadata: {name: t}
spec:
  algorithm: {name: goodput_model, params: {memory_steps: 40, max_k: 4, explore: 0}}
  arms: [eagle3:1, eagle3:2, eagle3:4, ngram:2, ngram:4, off]
  contexts: {batch_buckets: [1, 8, 24], per_class: true}
  drift: {detector: page_hinkley, delta: 0.01, threshold: 2, min_samples: 5}
  slo: {p99_tpot_ms: 5}
"""


def loop() -> ControlLoop:
    engine = EngineInfo(
        engine_id="e",
        model="m",
        max_k=4,
        arms=tuple(Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:4", "ngram:2", "ngram:4", "off")),
        granularity=Granularity.REQUEST_METHOD,
        max_batch_size=64,
    )
    return ControlLoop(spec=parse_policy(POLICY, source="t"), engine=engine, seed=1)


def test_loop_batch_equals_steps_one_by_one_with_drift_alarms() -> None:
    rng = np.random.default_rng(11)
    one, many = loop(), loop()
    for round_ in range(30):
        batch = [random_step(rng) for _ in range(int(rng.integers(1, 7)))]
        for obs in batch:
            one.observe(StepBatch.of(obs))
        many.observe(StepBatch(steps=batch))
        if round_ % 5 == 4:
            # Greedy (explore 0): a Thompson draw from an eigen-decomposition would amplify the rounding.
            now = float(round_)
            assert one.decide(now) == many.decide(now)
            assert_same(one.state_dict(), many.state_dict())
    a, b = one.state_dict(), many.state_dict()
    assert_same(a, b)
    assert one.totals.drift_alarms > 0  # drift fired (the split path ran)
    assert one.totals.ignored_rows > 0  # p_eagle rows are outside the policy's arms
    assert one._ctx.keys() == many._ctx.keys()
    for key, c in one._ctx.items():
        other = many._ctx[key].acc
        if c.acc is None:
            assert other is None
        else:
            assert other is not None
            np.testing.assert_allclose(c.acc.tokens, other.tokens)
            np.testing.assert_allclose(c.acc.time_s, other.time_s, rtol=1e-12)
