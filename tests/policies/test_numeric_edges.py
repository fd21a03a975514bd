"""Inputs that pass validation but sit at the edges of physics or of the policies' arithmetic.

Step times of a nanosecond and of a thousand seconds, drafters accepted always or never, batches of 1
and 4096 requests, clocks that repeat a reading or step back (NTP), a decision asked for twice at the
same time, and many contexts at once: no preset turns an estimate NaN or writes a state strict JSON
cannot hold, a clock set back does not stop the loop learning, and the cost of a round or a report
does not grow with what it need not (a window's length, the square of the contexts, steps x classes).
Costs are counted (Python calls, traced bytes), never timed.
"""

from __future__ import annotations

import json
import math
import sys
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from policies.algorithms.goodput_model import GoodputModel
from policies.algorithms.ucb import SlidingWindowUCB
from policies.arms import METHOD_CODES, Arm, Method
from policies.context import Context
from policies.engine import Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch
from policies.presets import load_preset, preset_names
from tests.policies.test_long_horizon import ARMS, EPOCH, engine


def report(
    arm: Arm,
    *,
    t0: float,
    steps: int,
    rows: int,
    duration: float,
    accepted: int | None = None,
    classes: tuple[str, ...] = ("chat", "code"),
    seed: int = 0,
) -> StepBatch:
    """``steps`` steps of ``rows`` requests on ``arm``; ``accepted``: every row accepts that many drafts
    (capped at K), else a random number; n-gram's counterfactual scored on every row."""
    rng = np.random.default_rng(seed)
    total = steps * rows
    k = np.full(total, arm.k, dtype=np.int32)
    acc = rng.integers(0, k + 1) if accepted is None else np.minimum(k, accepted)
    cf = rng.integers(0, 5, total) if accepted is None else np.full(total, min(accepted, 4))
    return StepBatch.from_columns(
        n=np.full(steps, rows, dtype=np.int64),
        time_s=t0 + duration * np.arange(steps, dtype=np.float64),
        duration_s=np.full(steps, duration),
        batch_size=np.full(steps, rows, dtype=np.int64),
        queue_length=np.zeros(steps, np.int64),
        queue_wait_s=np.zeros(steps),
        prefill_tokens=np.zeros(steps, np.int64),
        method=np.full(total, METHOD_CODES[arm.method], np.int8),
        k=k,
        drafted=k.copy(),
        accepted=acc.astype(np.int32),
        class_names=classes,
        class_of=np.arange(total, dtype=np.int64) % len(classes),
        request_id=("",) * total,
        finished=np.zeros(total, bool),
        ngram_proposal=np.zeros(total, np.int32),
        ngram_reported=np.zeros(steps, bool),
        counterfactual={Method.NGRAM: (cf.astype(np.int32), np.ones(steps, bool))},
    )


def playing(loop: ControlLoop, rows: int) -> Arm:
    label = loop.spec.buckets.label(loop.spec.buckets.index(rows))
    return loop.current_arms().get(Context(bucket=label), ARMS[0])


def python_calls(fn: Callable[[], Any]) -> int:
    """Python-level function calls ``fn`` makes (a proxy for work done in the interpreter)."""
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


EDGES = {
    "nanosecond steps": {"duration": 1e-9},
    "thousand-second steps": {"duration": 1e3},
    "perfect drafter": {"duration": 0.02, "accepted": 99},
    "useless drafter": {"duration": 0.02, "accepted": 0},
    "batch of 1": {"duration": 0.02, "rows": 1},
    "batch of 4096": {"duration": 0.05, "rows": 4096, "steps": 2},
}


@pytest.mark.parametrize("edge", list(EDGES))
@pytest.mark.parametrize("preset", preset_names())
def test_edge_inputs_keep_every_preset_finite_and_saveable(preset: str, edge: str) -> None:
    kw: dict[str, Any] = {"steps": 50, "rows": 8, **EDGES[edge]}
    spec = load_preset(preset)
    loop = ControlLoop(spec=spec, engine=engine(), seed=0)
    t = EPOCH
    loop.decide(t)
    for r in range(40):
        loop.observe(report(playing(loop, kw["rows"]), t0=t, seed=r, **kw))
        t += 1.0
        loop.decide(t)
    for ctx, by_arm in loop.estimates().items():
        for arm, v in by_arm.items():
            assert math.isfinite(v), f"{ctx.key} {arm}: {v}"
    state = json.loads(json.dumps(loop.state_dict(), allow_nan=False))
    restored = ControlLoop(spec=spec, engine=engine(), seed=5)
    restored.load_state_dict(state)
    assert restored.current_arms() == loop.current_arms()


def test_a_clock_set_back_does_not_stop_the_loop_learning() -> None:
    """An NTP step of an hour back: the loop goes on deciding a round a second on the new clock, and a
    context's dwell runs from there (it used to hold every arm and decide nothing for the hour)."""
    spec = load_preset("thompson")
    loop = ControlLoop(spec=spec, engine=engine(Granularity.BATCH_STEP), seed=1)
    t = EPOCH
    for r in range(5):
        loop.observe(report(playing(loop, 8), t0=t, steps=50, rows=8, duration=0.02, seed=r))
        loop.decide(t)
        t += 1.0
    assert loop.rounds == 5
    t -= 3600.0
    for r in range(30):
        loop.observe(report(playing(loop, 8), t0=t, steps=50, rows=8, duration=0.02, seed=100 + r))
        loop.decide(t)
        t += 1.0
    # The reading at the step back is taken as the last decision's time (its interval starts again).
    assert loop.rounds == 5 + 29
    directive = loop.directive
    assert directive is not None and directive.issued_at_s <= t
    json.dumps(loop.state_dict(), allow_nan=False)


def test_a_repeated_clock_reading_runs_one_round_and_returns_the_same_directive() -> None:
    loop = ControlLoop(spec=load_preset("default"), engine=engine(), seed=0)
    loop.observe(report(ARMS[2], t0=EPOCH, steps=100, rows=8, duration=0.02))
    first = loop.decide(EPOCH)
    for _ in range(3):
        loop.observe(report(ARMS[2], t0=EPOCH, steps=10, rows=8, duration=0.02))
        assert loop.decide(EPOCH) is first
    assert loop.rounds == 1


def test_a_small_clock_jitter_back_is_harmless() -> None:
    """A wall clock read a microsecond behind the last decision (NTP slewing, two threads): no round,
    the same directive, and the next round a decision interval on."""
    loop = ControlLoop(spec=load_preset("thompson"), engine=engine(), seed=0)
    loop.observe(report(ARMS[2], t0=EPOCH, steps=50, rows=8, duration=0.02))
    first = loop.decide(EPOCH)
    again = loop.decide(EPOCH - 1e-6)
    assert again.same_decision(first) and again.version == first.version
    assert loop.rounds == 1
    loop.decide(EPOCH - 1e-6 + 0.999)
    assert loop.rounds == 1
    loop.decide(EPOCH - 1e-6 + 1.0)
    assert loop.rounds == 2


def test_a_sliding_window_of_100000_rounds_costs_no_python_work_per_round() -> None:
    """sw_ucb re-summed its window in Python every round: 100000 rounds a context (its largest window)
    cost about 0.1 s a round each, more than the decision interval with a few dozen contexts. The sums
    are the same to the last bit as adding the window's rounds one at a time, oldest first."""
    arms = ARMS[:4]
    learner = SlidingWindowUCB(arms=arms, params={"window": 100000, "c": 0.2}, rng=np.random.default_rng(0))
    rng = np.random.default_rng(0)
    rewards = (rng.random(100000) * 10.0 ** rng.integers(-3, 6, 100000)).tolist()
    played = rng.integers(0, 4, 100000).tolist()
    pairs = [[i, r] for i, r in zip(played, rewards, strict=True)]
    learner.load_state_dict({"tables": {}, "hist": {Context(bucket="8").key: pairs}})
    ctx = Context(bucket="8")
    learner.update(ctx, {2: 123.0})
    calls = python_calls(lambda: learner.update(ctx, {1: 500.0}))
    assert calls < 100, f"{calls} Python calls for one round"
    n, s, q = np.zeros(4), np.zeros(4), np.zeros(4)
    for i, r in [*list(zip(played, rewards, strict=True))[2:], (2, 123.0), (1, 500.0)]:
        n[i] += 1.0
        s[i] += 1.0 * r
        q[i] += 1.0 * r * r
    t = learner.table(ctx)
    assert t.n.tobytes() == n.tobytes() and t.s.tobytes() == s.tobytes() and t.q.tobytes() == q.tobytes()
    assert learner.state_dict()["hist"][ctx.key][-3:] == [pairs[-1], [2, 123.0], [1, 500.0]]


def test_a_round_with_a_thousand_contexts_costs_linear_work() -> None:
    """256 classes in 5 batch buckets: 1285 contexts. Each context that proposed a switch rebuilt the
    map of every context's arm (``others``), so a round hashed contexts about a million times."""
    loop = ControlLoop(spec=load_preset("thompson"), engine=engine(), seed=0)
    classes = tuple(f"c{i}" for i in range(256))
    t = EPOCH
    for r in range(3):
        for rows in (1, 4, 8, 16, 64):
            loop.observe(
                report(
                    ARMS[r],
                    t0=t,
                    steps=max(1, 256 // rows),
                    rows=rows,
                    duration=0.02,
                    classes=classes,
                    seed=r,
                )
            )
        t += 3.0
        loop.decide(t)
    assert len(loop._ctx) >= 1280
    for rows in (1, 4, 8, 16, 64):
        loop.observe(
            report(ARMS[3], t0=t, steps=max(1, 256 // rows), rows=rows, duration=0.02, classes=classes)
        )
    t += 3.0
    calls = python_calls(lambda: loop.decide(t))
    # About 90 a context; rebuilding the map per proposing context made it about 1100.
    assert calls < 400 * len(loop._ctx), f"{calls} Python calls for a round of {len(loop._ctx)} contexts"


def test_a_report_of_many_steps_and_classes_learns_in_bounded_memory() -> None:
    """The default learner counted acceptance in one dense histogram over (table, step, accepted, K):
    a report of 128 steps naming 256 classes took about 220 MiB (1024 steps: 1.7 GiB). Counted a run of
    steps at a time it stays small, and learns what learning step by step learns."""
    params = {k: p.default for k, p in GoodputModel.PARAMS.items()}
    classes = tuple(f"c{i}" for i in range(256))
    batch = report(ARMS[2], t0=0.0, steps=128, rows=256, duration=0.02, classes=classes, seed=3)
    labels = ["32+"] * len(batch)
    whole = GoodputModel(arms=ARMS, params=params, rng=np.random.default_rng(0))
    tracemalloc.start()
    try:
        whole.observe(batch, labels, True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 48 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    stepwise = GoodputModel(arms=ARMS, params=params, rng=np.random.default_rng(0))
    for i in range(0, len(batch), 8):  # 8 steps of 256 classes fit one histogram
        stepwise.observe(batch.take(range(i, i + 8)), labels[i : i + 8], True)
    assert whole._acc.keys() == stepwise._acc.keys()
    for key, table in whole._acc.items():
        np.testing.assert_allclose(table, stepwise._acc[key], rtol=1e-12)
