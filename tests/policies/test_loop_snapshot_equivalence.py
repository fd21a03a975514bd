"""A loop restored from a snapshot decides exactly as the loop that wrote it ("nothing is lost on restart").

For every preset (and each with the guards switched on), a loop is driven in closed loop by a stream of
step reports of realistic size: hundreds of steps over several traffic classes and load levels, up to
hundreds of requests a step, the engine playing what the directive says (with some rows off plan). At
an arbitrary point of the stream (between a report and the decision that follows it too) its state goes
through JSON, as a snapshot does on disk, into a fresh loop built with another seed; both then get the
same rest of the stream at the same times and must issue the same directives, the same changes and, at
the end, the same state.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from policies.arms import Arm, Method
from policies.context import BatchBuckets
from policies.directive import Directive
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import NOT_SCORED, StepBatch, StepObservation
from policies.presets import load_preset, preset_names
from policies.spec import PolicySpec

ARMS = tuple(
    Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:3", "eagle3:4", "ngram:2", "ngram:4", "off")
)
CLASSES = ("chat", "code", "rag", "math")
#: Load levels (batch sizes), so every batch bucket of the presets sees traffic.
LOADS = (1, 3, 6, 12, 24, 48, 160, 300)
#: First-position acceptance per (class, method): the engine's truth; it shifts halfway (drift).
P_ACCEPT = {
    ("chat", Method.EAGLE3): 0.75,
    ("code", Method.EAGLE3): 0.55,
    ("rag", Method.EAGLE3): 0.65,
    ("math", Method.EAGLE3): 0.85,
    ("chat", Method.NGRAM): 0.1,
    ("code", Method.NGRAM): 0.8,
    ("rag", Method.NGRAM): 0.5,
    ("math", Method.NGRAM): 0.2,
}
#: Seconds between reports: binary-exact ones (a timer then lands exactly on its bound) and others.
GAPS = (0.25, 0.5, 1.0, 0.125, 0.3, 0.7, 1.1)


def spec_for(preset: str, guards: bool) -> PolicySpec:
    spec = load_preset(preset)
    if not guards:
        return spec
    # Every guard on, sized so that each acts within a few hundred steps.
    return replace(
        spec,
        min_dwell_s=max(spec.min_dwell_s, 1.5),
        switch_margin=0.05,
        drift={**spec.drift, "detector": "page_hinkley", "threshold": 8.0, "min_samples": 30},
        slo={**spec.slo, "p99_tpot_ms": 14.0, "window": 64, "min_samples": 16},
        exploration={**spec.exploration, "max_share_at_high_load": 0.3, "high_load_batch": 16},
    )


def engine_for(granularity: Granularity) -> EngineInfo:
    return EngineInfo(
        engine_id="e",
        model="m",
        max_k=4,
        arms=ARMS,
        granularity=granularity,
        max_batch_size=512,
        counterfactual_methods=(Method.NGRAM,) if granularity is Granularity.REQUEST_METHOD else (),
    )


def report(
    rng: np.random.Generator, t: float, gap: float, d: Directive | None, engine: EngineInfo, drifted: bool
) -> StepBatch:
    """One report of 1-6 steps in [t, t + gap): the engine plays the directive (its fallback before the
    first), some rows off plan; now and then a step without requests or without a duration."""
    steps = []
    n_steps = int(rng.integers(1, 7))
    batch = int(LOADS[int(rng.integers(0, len(LOADS)))])
    for i in range(n_steps):
        n = 0 if rng.random() < 0.03 else max(1, batch - int(rng.integers(0, 1 + batch // 8)))
        classes = [CLASSES[c] for c in rng.choice(len(CLASSES), size=n, p=[0.4, 0.3, 0.2, 0.1])]
        if d is None:
            planned = [ARMS[1]] * n
        elif engine.granularity is Granularity.BATCH_STEP:
            k = d.k_for_batch(batch, engine.max_k)
            planned = [Arm(Method.EAGLE3, k) if k else Arm.parse("off")] * n
        else:
            planned = [d.arm_for(c, batch) for c in classes]
        off_plan = rng.random(n) < 0.05
        arms = [
            engine.arms[int(rng.integers(0, len(engine.arms)))] if o else a
            for a, o in zip(planned, off_plan, strict=True)
        ]
        k = np.array([a.k for a in arms], dtype=int)
        p = np.array(
            [P_ACCEPT.get((c, a.method), 0.0) for c, a in zip(classes, arms, strict=True)], dtype=float
        )
        if drifted:
            p = 1.0 - p
        accepted = np.minimum(k, rng.geometric(np.clip(1.0 - p, 1e-3, 1.0)) - 1) if n else k
        cf: dict[Method, Any] = {}
        if engine.granularity is Granularity.REQUEST_METHOD and n:
            p_ng = np.array([P_ACCEPT[(c, Method.NGRAM)] for c in classes])
            score = np.minimum(4, rng.geometric(np.clip(1.0 - p_ng, 1e-3, 1.0)) - 1)
            cf[Method.NGRAM] = np.where(rng.random(n) < 0.2, NOT_SCORED, score)
        duration = 0.0 if rng.random() < 0.02 else 0.006 + 4e-5 * batch + 0.0025 * int(k.max(initial=0))
        steps.append(
            StepObservation.build(
                time_s=t + gap * i / n_steps,
                duration_s=duration * float(rng.uniform(0.9, 1.1)),
                traffic_class=classes,
                method=[a.method for a in arms],
                k=k,
                drafted=k,
                accepted=accepted,
                batch_size=batch,
                counterfactual=cf,
                prefill_tokens=int(rng.choice([0, 0, 0, 64, 900])),
            )
        )
    return StepBatch(steps=steps)


def same_decision(
    a: ControlLoop, b: ControlLoop, da: Directive, db: Directive, ran: bool, where: str
) -> None:
    assert da == db, where
    assert a.rounds == b.rounds, where
    if not ran:  # ``last_changes`` are the changes of the round just run (what the sidecar counts)
        return
    # Field by field: a change's estimate may be NaN (no estimate), which == never matches.
    assert [(c.context, c.before, c.after) for c in a.last_changes] == [
        (c.context, c.before, c.after) for c in b.last_changes
    ], where
    np.testing.assert_array_equal(
        [c.estimate for c in a.last_changes], [c.estimate for c in b.last_changes], err_msg=where
    )


def snapshot(loop: ControlLoop) -> dict[str, Any]:
    """The state as a snapshot holds it: through JSON. (Python's: an EXP3 loss may overflow to
    infinity, which the sidecar's strict JSON refuses; the sidecar then resets the loop.)"""
    state: dict[str, Any] = json.loads(json.dumps(loop.state_dict()))
    return state


def run(preset: str, guards: bool, granularity: Granularity, seed: int, reports: int, snap: int) -> None:
    spec, engine = spec_for(preset, guards), engine_for(granularity)
    rng = np.random.default_rng(seed)
    original = ControlLoop(spec=spec, engine=engine, seed=seed)
    # Per report: a tick now and then (a decision call between reports, mostly not due), the report,
    # the decision after it. The snapshot is taken before operation ``snap``.
    plan: list[str] = []
    for _ in range(reports):
        plan += ["tick", "observe", "decide"] if rng.random() < 0.3 else ["observe", "decide"]
    snap %= len(plan)
    restored: ControlLoop | None = None
    t, gap = 0.0, 0.5
    for i, op in enumerate(plan):
        if i == snap:
            restored = ControlLoop(spec=spec, engine=engine, seed=seed + 1)
            restored.load_state_dict(snapshot(original))
        if op == "observe":
            gap = float(GAPS[int(rng.integers(0, len(GAPS)))])
            batch = report(rng, t, gap, original.directive, engine, drifted=i > len(plan) // 2)
            original.observe(batch)
            if restored is not None:
                restored.observe(batch)
            continue
        t += float(rng.choice([0.1, 0.25, 0.4])) if op == "tick" else gap
        rounds = original.rounds
        da = original.decide(t)
        if restored is not None:
            where = f"{op} {i} at t={t} (snapshot before {snap})"
            same_decision(original, restored, da, restored.decide(t), original.rounds != rounds, where)
    assert restored is not None
    assert snapshot(restored) == snapshot(original)


@pytest.mark.parametrize("guards", [False, True], ids=["preset", "guards"])
@pytest.mark.parametrize("preset", preset_names())
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    granularity=st.sampled_from(list(Granularity)),
    seed=st.integers(0, 2**31),
    reports=st.integers(40, 160),
    snap=st.integers(0, 10**6),
)
@example(granularity=Granularity.REQUEST_METHOD, seed=0, reports=60, snap=1)  # after the first operation
@example(granularity=Granularity.BATCH_STEP, seed=1, reports=60, snap=2)  # after the second
@example(granularity=Granularity.REQUEST_METHOD, seed=2, reports=120, snap=117)  # mid-stream
def test_a_restored_loop_decides_as_the_original(
    preset: str, guards: bool, granularity: Granularity, seed: int, reports: int, snap: int
) -> None:
    run(preset, guards, granularity, seed, reports, snap)


def _driven(seed: int, t0: float, reports: int) -> tuple[ControlLoop, np.random.Generator, float]:
    """The default preset's loop (a 2 s dwell) after ``reports`` reports 0.25 s apart from ``t0``, each
    followed by a decision call, and one more report not yet decided on; the last clock reading."""
    spec, engine = spec_for("default", False), engine_for(Granularity.REQUEST_METHOD)
    rng = np.random.default_rng(seed)
    loop = ControlLoop(spec=spec, engine=engine, seed=seed)
    t = t0
    for _ in range(reports):
        loop.observe(report(rng, t, 0.25, loop.directive, engine, drifted=False))
        t += 0.25
        loop.decide(t)
    loop.observe(report(rng, t, 0.25, loop.directive, engine, drifted=False))
    return loop, rng, t


def test_a_clock_behind_the_saved_one_moves_the_timers_by_as_much() -> None:
    """Restored on a clock behind the one that saved (another process's monotonic clock), the timers
    keep the ages they had at the last decision: the loop decides as one restored on the saving clock
    would, at the same distance from that decision (times binary-exact, so the shift is too)."""
    t0 = float(2**30)  # a wall clock
    loop, rng, _ = _driven(seed=7, t0=t0, reports=40)
    state = snapshot(loop)
    at = state["decision"]["at_s"]  # the last decision that ran a round
    spec, engine = loop.spec, loop.engine
    same, behind = (ControlLoop(spec=spec, engine=engine, seed=9) for _ in range(2))
    same.load_state_dict(state)
    behind.load_state_dict(state)
    start = 1000.0  # the new process's clock
    for x in np.arange(0.0, 30.0, 0.25).tolist():
        if x:
            batch = report(rng, at + x, 0.25, same.directive, engine, drifted=False)
            same.observe(batch)
            behind.observe(batch)
        d = same.decide(at + x)
        assert behind.decide(start + x) == replace(d, issued_at_s=d.issued_at_s - (at - start)), x
        assert behind.rounds == same.rounds and behind.current_arms() == same.current_arms(), x
    assert same.rounds > loop.rounds + 20


def test_a_state_without_the_timers_or_the_round_in_progress_loads_as_before() -> None:
    """A snapshot of an older version (no ``decision``, ``since_s``, ``acc``): the first decision after
    the load runs a round, due or not, with every dwell over (what every restore did before)."""
    loop, _, now = _driven(seed=3, t0=0.0, reports=20)
    state = snapshot(loop)
    del state["decision"]
    for c in state["contexts"].values():
        c.pop("since_s", None)
        c.pop("acc", None)
    old = ControlLoop(spec=loop.spec, engine=loop.engine, seed=1)
    old.load_state_dict(state)
    rounds = old.rounds
    d = old.decide(now)  # not due on the saving loop's timer
    assert old.rounds == rounds + 1 and d.version == loop.version + 1 and d.issued_at_s == now
    assert loop.decide(now) is loop.directive and loop.rounds == rounds


def test_a_decision_saved_under_other_batch_buckets_runs_a_round_first() -> None:
    """The policy's buckets changed under its name: the saved directive cannot be rebuilt, so the
    restored loop decides afresh (its timers dropped with it), as an older snapshot would."""
    loop, _, now = _driven(seed=4, t0=0.0, reports=20)
    state = snapshot(loop)
    spec = replace(loop.spec, buckets=BatchBuckets((1, 8, 64)))
    other = ControlLoop(spec=spec, engine=loop.engine, seed=1)
    other.load_state_dict(state)
    rounds = other.rounds
    other.decide(now)
    assert other.rounds == rounds + 1
