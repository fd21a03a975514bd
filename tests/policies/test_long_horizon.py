"""The policies over the horizons a sidecar runs them for: weeks, a decision round a second, millions of
engine steps, on a wall clock near 1.7e9 s.

What must hold after a long run, for every preset: every estimate and saved number is finite and the
state goes through strict JSON; the adaptive presets still move to the new best arm after the engine's
acceptance changes late in the run (nothing saturates so that they stop adapting); what the loop keeps
stays bounded as rounds go by; and a loop restored from a long run's snapshot continues it exactly.

The engine is closed-loop: each report's steps play the arm the directive names for their batch size,
with acceptance drawn from a per-(class, method) truth and a step time that grows with the draft.
Reports are large (hundreds of steps) so that millions of steps take a few hundred calls.
"""

from __future__ import annotations

import json
import math
from collections import deque

import numpy as np
import pytest

from policies.arms import METHOD_CODES, Arm, Method
from policies.context import Context
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch
from policies.presets import load_preset, preset_names

ARMS = tuple(
    Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:3", "eagle3:4", "ngram:2", "ngram:4", "off")
)
CLASSES = ("chat", "code")
#: The wall clock of a sidecar started in late 2023: float64 resolves it to about 2.4e-7 s.
EPOCH = 1.7e9
#: Presets that forget (a discount, a window, a memory in steps): they must track a change however late.
ADAPTIVE = ("default", "thompson", "sw-ucb", "epsilon-greedy")
#: Engine steps each preset is run for (in reports of 1000 steps), as many as keep a test near 10 s
#: on a shared CI core: the learners that read reports step by step in Python cost far more a step.
HORIZON = {"default": 200_000, "hedge": 10_000, "ngram-fallback": 100_000, "trtllm-gate": 100_000}
MILLION = 1_000_000


def horizon(preset: str) -> int:
    return HORIZON.get(preset, MILLION)


def engine(granularity: Granularity = Granularity.REQUEST_METHOD) -> EngineInfo:
    return EngineInfo(
        engine_id="e",
        model="m",
        max_k=4,
        arms=ARMS,
        granularity=granularity,
        max_batch_size=4096,
        counterfactual_methods=(Method.NGRAM,),
    )


class World:
    """The engine's truth: per-position acceptance per method, a step time per arm, and when it changes."""

    def __init__(self, p_eagle: float, p_ngram: float, seed: int = 0) -> None:
        self.p = {Method.EAGLE3: p_eagle, Method.NGRAM: p_ngram}
        self.rng = np.random.default_rng(seed)

    def report(self, loop: ControlLoop, t0: float, steps: int, rows: int, dt: float) -> StepBatch:
        """``steps`` steps of ``rows`` requests from ``t0`` on, each request on the arm the loop plays
        for its class in the bucket of ``rows`` (its pooled arm where the class has none yet)."""
        label = loop.spec.buckets.label(loop.spec.buckets.index(rows))
        arms = loop.current_arms()
        pooled = arms.get(Context(bucket=label), ARMS[0])
        total = steps * rows
        class_of = np.arange(total, dtype=np.int64) % len(CLASSES)
        arm_of = [arms.get(Context(bucket=label, traffic_class=c), pooled) for c in CLASSES]
        method = np.array([METHOD_CODES[a.method] for a in arm_of], dtype=np.int8)[class_of]
        k = np.array([a.k for a in arm_of], dtype=np.int32)[class_of]
        p = np.array([self.p.get(a.method, 0.0) for a in arm_of])[class_of]
        # Accepted: the run of successes from the first position, capped at K.
        run = np.argmin(self.rng.random((total, 5)) < p[:, None], axis=1)
        run[(self.rng.random((total, 5)) < p[:, None]).all(axis=1)] = 5
        accepted = np.minimum(run, k).astype(np.int32)
        # One EAGLE-3 pass per drafted position: a longer draft costs more per step.
        passes = max((a.k for a in arm_of if a.method is Method.EAGLE3), default=0)
        duration = 0.01 + 0.0015 * passes + 0.0001 * rows
        cf = np.minimum(np.argmin(self.rng.random((total, 5)) < self.p[Method.NGRAM], axis=1), 4)
        return StepBatch.from_columns(
            n=np.full(steps, rows, dtype=np.int64),
            time_s=t0 + duration * np.arange(steps, dtype=np.float64),
            duration_s=np.full(steps, duration),
            batch_size=np.full(steps, rows, dtype=np.int64),
            queue_length=np.zeros(steps, np.int64),
            queue_wait_s=np.zeros(steps),
            prefill_tokens=np.zeros(steps, np.int64),
            method=method,
            k=k,
            drafted=k.copy(),
            accepted=accepted,
            class_names=CLASSES,
            class_of=class_of,
            request_id=("",) * total,
            finished=np.zeros(total, bool),
            ngram_proposal=np.zeros(total, np.int32),
            ngram_reported=np.zeros(steps, bool),
            counterfactual={Method.NGRAM: (cf.astype(np.int32), np.ones(steps, bool))},
        )


def drive(
    loop: ControlLoop, world: World, t: float, rounds: int, *, steps: int, rows: int, gap: float = 1.0
) -> tuple[float, list[tuple[object, ...]]]:
    """``rounds`` reports, each followed by a decision ``gap`` seconds on; the clock after them and each
    round's decision (the k-table and plan in force)."""
    out: list[tuple[object, ...]] = []
    for _ in range(rounds):
        loop.observe(world.report(loop, t, steps, rows, 0.01))
        t += gap
        d = loop.decide(t)
        out.append((d.version, d.k_table, d.plan))
    return t, out


def pooled_arm(loop: ControlLoop, rows: int) -> Arm:
    label = loop.spec.buckets.label(loop.spec.buckets.index(rows))
    return loop.current_arms()[Context(bucket=label)]


def assert_finite_state(loop: ControlLoop) -> None:
    """Every estimate finite (or NaN for an arm never seen) and the state strict JSON."""
    for ctx, by_arm in loop.estimates().items():
        for arm, v in by_arm.items():
            assert math.isfinite(v), f"{ctx.key} {arm}: estimate {v}"
    json.dumps(loop.state_dict(), allow_nan=False)


@pytest.mark.parametrize("preset", preset_names())
def test_a_million_steps_on_the_epoch_clock_stay_finite_and_saveable(preset: str) -> None:
    """Up to 10^6 engine steps (8 * 10^6 request-steps), a round per 1000, the clock at 1.7e9 s."""
    loop = ControlLoop(spec=load_preset(preset), engine=engine(), seed=0)
    world = World(p_eagle=0.8, p_ngram=0.3)
    t = EPOCH
    loop.decide(t)
    rounds = horizon(preset) // 1000
    t, _ = drive(loop, world, t, rounds, steps=1000, rows=8)
    assert loop.totals.steps == horizon(preset)
    assert loop.rounds == rounds + 1
    assert_finite_state(loop)


@pytest.mark.parametrize("preset", ADAPTIVE)
def test_adaptive_presets_still_switch_after_a_late_drift(preset: str) -> None:
    """After a long stable run on EAGLE-3 (10^6 steps for the tabular learners; 2 * 10^5 for the
    default, whose memory is 2000 steps, so that is a hundred memories), EAGLE-3 stops being accepted
    at all: every adaptive preset then plays n-gram or off in most rounds within a few hundred. The
    learners still explore, so each phase is judged on the share of its last 50 rounds."""
    loop = ControlLoop(spec=load_preset(preset), engine=engine(), seed=0)
    world = World(p_eagle=0.9, p_ngram=0.05)
    t = EPOCH
    loop.decide(t)
    t, _ = drive(loop, world, t, horizon(preset) // 1000 - 50, steps=1000, rows=8)

    def eagle_share(rounds: int, steps: int) -> float:
        nonlocal t
        eagle = []
        for _ in range(rounds):
            t, _ = drive(loop, world, t, 1, steps=steps, rows=8)
            eagle.append(pooled_arm(loop, 8).method is Method.EAGLE3)
        return float(np.mean(eagle[-50:]))

    assert eagle_share(50, 1000) > 0.5
    world.p = {Method.EAGLE3: 0.0, Method.NGRAM: 0.9}
    share = eagle_share(400, 20)
    assert share < 0.5, f"{preset} still plays EAGLE-3 in {share:.0%} of rounds 350-400 after the drift"
    assert_finite_state(loop)


def footprint(obj: object, seen: set[int] | None = None) -> int:
    """Elements the object holds, all the way down: items of containers, values of arrays, and the
    attributes of the loop's own objects (learners, guards, contexts). Counted, so it is exact."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, str | bytes | int | float | bool | type(None) | type):
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return int(obj.size)
    if isinstance(obj, np.random.Generator | np.random.BitGenerator):
        return 0
    if isinstance(obj, dict):
        return len(obj) + sum(footprint(k, seen) + footprint(v, seen) for k, v in obj.items())
    if isinstance(obj, list | tuple | set | frozenset | deque):
        return len(obj) + sum(footprint(v, seen) for v in obj)
    module = type(obj).__module__ or ""
    if not module.startswith("policies"):
        return 0
    names = list(getattr(obj, "__dict__", {})) + [
        n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ()) if hasattr(obj, n)
    ]
    return sum(footprint(getattr(obj, n), seen) for n in dict.fromkeys(names))


@pytest.mark.parametrize("preset", preset_names())
def test_what_the_loop_keeps_does_not_grow_with_rounds(preset: str) -> None:
    """After the first 150 rounds have created every context and filled every window, 600 more rounds
    (10 minutes of decisions) leave the loop holding as many elements as it held: no per-round
    history outside bounded windows (one element kept a round would add 600)."""
    loop = ControlLoop(spec=load_preset(preset), engine=engine(), seed=0)
    world = World(p_eagle=0.7, p_ngram=0.4)
    t = EPOCH
    loop.decide(t)
    t = drive(loop, world, t, 150, steps=20, rows=8)[0]
    before = footprint(loop)
    t = drive(loop, world, t, 600, steps=20, rows=8)[0]
    after = footprint(loop)
    # Caches derived from the statistics (cleared when those change) come and go: a little slack.
    assert after <= before * 1.05 + 64, f"{preset}: {before} elements after 150 rounds, {after} after 750"


@pytest.mark.parametrize("preset", preset_names())
def test_a_loop_restored_after_a_long_run_continues_it_exactly(preset: str) -> None:
    """A loop run for 10^5 steps (10^4 for hedge) on the epoch clock, saved through strict JSON into a
    fresh loop of another seed: both then make the same 1000 decisions on the same reports, and end in
    the same state."""
    a = ControlLoop(spec=load_preset(preset), engine=engine(), seed=0)
    world = World(p_eagle=0.7, p_ngram=0.4, seed=1)
    t = EPOCH
    a.decide(t)
    t, _ = drive(a, world, t, min(horizon(preset), 100_000) // 1000, steps=1000, rows=8)
    b = ControlLoop(spec=load_preset(preset), engine=engine(), seed=99)
    b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
    # The same reports for both: drawn once, from what ``a`` plays (``b`` must play the same).
    for r in range(1000):
        assert a.current_arms() == b.current_arms(), f"round {r}: arms differ"
        report = world.report(a, t, 4, 8 if r % 3 else 1, 0.01)
        a.observe(report)
        b.observe(report)
        t += 1.0 if r % 7 else 0.5
        da, db = a.decide(t), b.decide(t)
        assert (da.version, da.k_table, da.plan, da.reason) == (db.version, db.k_table, db.plan, db.reason), r
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())


@pytest.mark.parametrize("gran", list(Granularity))
def test_a_week_of_rounds_on_the_epoch_clock_keeps_every_timer_and_counter_exact(gran: Granularity) -> None:
    """A week of once-a-second rounds is 604800 of them: too many to run, so a loop is saved as it
    would be a week in (clock at 1.7e9 + 604800, every counter a week's worth) and goes on from there.
    Dwell timers and the decision interval still resolve on that clock (decisions a second apart run)."""
    spec = load_preset("thompson")
    loop = ControlLoop(spec=spec, engine=engine(gran), seed=0)
    world = World(p_eagle=0.8, p_ngram=0.3)
    t = EPOCH
    loop.decide(t)
    t, _ = drive(loop, world, t, 20, steps=50, rows=8)
    state = json.loads(json.dumps(loop.state_dict()))
    week = 604800.0
    state["rounds"] += 604800
    state["totals"]["steps"] += 604800 * 100
    state["decision"]["at_s"] += week
    state["decision"]["issued_at_s"] += week
    for c in state["contexts"].values():
        if "since_s" in c:
            c["since_s"] += week
    restored = ControlLoop(spec=spec, engine=engine(gran), seed=0)
    restored.load_state_dict(state)
    t += week
    rounds = restored.rounds
    t, _ = drive(restored, world, t, 30, steps=50, rows=8)
    assert restored.rounds == rounds + 30
    assert_finite_state(restored)
