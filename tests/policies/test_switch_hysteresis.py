"""Hysteresis on value: no switch unless the predicted goodput gain beats a margin learnt from the
estimate's uncertainty; contexts without traffic follow the greedy plan instead of every draw."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from policies.arms import Arm, Method
from policies.context import Context
from policies.guards import keeps_current
from policies.spec import PolicySpec, parse_policy
from sim.costmodel import PluginCost, load_profile
from sim.engines import ENGINES
from sim.replay import Replayer
from sim.traffic import generate

PROFILE = load_profile("llama-3.1-8b-h100")
LIB = Path(__file__).resolve().parents[2] / "policies" / "library"


def _default(**params: float) -> PolicySpec:
    spec = parse_policy((LIB / "default.yaml").read_text(), source="default")
    return dataclasses.replace(spec, params={**spec.params, **params})


def test_keeps_current_with_a_learnt_margin() -> None:
    est = np.array([100.0, 101.0, 130.0, np.nan])
    assert keeps_current(est, 0, 2, 0.0, learnt=(25.0, 40.0))  # gain below the learnt margin
    assert not keeps_current(est, 0, 2, 0.0, learnt=(45.0, 40.0))
    assert keeps_current(est, 0, 1, 0.02, learnt=(45.0, 40.0))  # the relative margin still holds it
    assert not keeps_current(est, 0, 3, 0.0, learnt=(0.0, 40.0))  # never estimated: try it first
    assert not keeps_current(est, 0, 2, 0.0, learnt=(float("nan"), 40.0))  # no opinion
    assert not keeps_current(est, -1, 2, 0.0, learnt=(0.0, 40.0))  # nothing in play yet


def _trained(**params: float) -> tuple[Replayer, object]:
    tr = generate("chat", n_requests=80, seed=4)
    r = Replayer(
        trace=tr,
        profile=PROFILE,
        engine=ENGINES["stock-vllm"],
        policy=_default(**params),
        concurrency=4,
        seed=0,
    )
    r.run()
    from policies.loop import ControlLoop

    loop = ControlLoop(spec=r.policy, engine=ENGINES["stock-vllm"].info(tr.max_k), seed=0)
    assert r.final_state is not None
    loop.load_state_dict(r.final_state)
    return r, loop


def test_the_margin_is_learnt_from_the_posteriors_and_shrinks_with_confidence() -> None:
    _, loop = _trained()
    learner = loop.learner  # type: ignore[attr-defined]
    arms = loop.arms  # type: ignore[attr-defined]
    i3, i4 = arms.index(Arm(Method.EAGLE3, 3)), arms.index(Arm(Method.EAGLE3, 4))
    allowed = list(range(len(arms)))
    learner.params = {**learner.params, "switch_floor": 0.0}
    gain, margin = learner.switch_check(Context.parse("2-4/*"), allowed, i3, i4)
    assert np.isfinite(gain) and margin > 0
    # Fewer standard errors: a smaller margin; none and no floor: no opinion at all.
    learner.params = {**learner.params, "switch_confidence": 0.5}
    _, smaller = learner.switch_check(Context.parse("2-4/*"), allowed, i3, i4)
    assert smaller < margin
    learner.params = {**learner.params, "switch_confidence": 0.0, "switch_floor": 0.0}
    assert learner.switch_check(Context.parse("2-4/*"), allowed, i3, i4) is None


def test_an_arm_with_unseen_draft_positions_is_not_held_back() -> None:
    _, loop = _trained()
    learner = loop.learner  # type: ignore[attr-defined]
    arms = loop.arms  # type: ignore[attr-defined]
    # A class never seen has no acceptance counts of its own beyond the pooled ones; position 8 of
    # EAGLE-3 is never verified at this load, so eagle3:8 is unsettled and may be tried.
    i3, i8 = arms.index(Arm(Method.EAGLE3, 3)), arms.index(Arm(Method.EAGLE3, 8))
    learner.params = {**learner.params, "switch_settled_trials": 1e6}
    assert learner.switch_check(Context.parse("2-4/*"), list(range(len(arms))), i3, i8) is None


def test_fewer_switches_on_a_drift_at_the_same_goodput() -> None:
    c = 8
    tr = generate("drift", n_requests=240, seed=2)
    runs = {}
    for name, params in (("on", {}), ("off", {"switch_confidence": 0.0, "switch_floor": 0.0})):
        runs[name] = Replayer(
            trace=tr,
            profile=PROFILE,
            engine=ENGINES["composite"],
            policy=_default(**params),
            concurrency=c,
            seed=0,
        ).run()
    on, off = runs["on"], runs["off"]
    assert on.switches < off.switches
    assert on.throughput > 0.95 * off.throughput


def test_a_k_table_engine_leaves_its_first_k_when_another_is_better() -> None:
    # A K-table engine plays one K per batch, so the cost model never sees the draft-pass coefficient
    # vary until a switch happens; the value hysteresis must not hold back the switch that would
    # identify it (it did: the stock engine stayed near its first K at c = 32, 0.92 x best static).
    from policies.spec import static_policy
    from sim.engines import engine_for_arm

    # Decisions alone: without the plugin's cost per step, which only the driven engine pays.
    prof = dataclasses.replace(
        PROFILE,
        plugin_k_table=PluginCost(),
        plugin_composite=PluginCost(),
        plugin_composite_sync=PluginCost(),
    )
    tr = generate("chat", n_requests=300, seed=3)
    best = max(
        Replayer(
            trace=tr,
            profile=prof,
            engine=engine_for_arm(Arm(Method.EAGLE3, k)),
            policy=static_policy(f"eagle3:{k}"),
            concurrency=32,
            seed=0,
        )
        .run()
        .throughput
        for k in (3, 4, 5)
    )
    r = Replayer(
        trace=tr, profile=prof, engine=ENGINES["stock-vllm"], policy=_default(), concurrency=32, seed=0
    ).run()
    assert r.throughput >= 0.95 * best


def test_a_move_to_off_is_judged_by_value_like_any_other() -> None:
    # `off` verifies no position, so nothing is left to settle; it was treated as never estimated and
    # the hysteresis never held a draw of `off` back (a bucket near `off` could flip on noise).
    from policies.arms import OFF
    from policies.engine import EngineInfo, Granularity
    from policies.loop import ControlLoop
    from policies.observation import StepBatch, StepObservation

    arms = (*(Arm(Method.EAGLE3, k) for k in range(1, 9)), OFF)
    eng = EngineInfo(engine_id="e", model="m", max_k=8, arms=arms, granularity=Granularity.BATCH_STEP)
    loop = ControlLoop(spec=_default(), engine=eng, seed=0)
    rng = np.random.default_rng(1)
    t = 0.0
    for i in range(3000):  # batch 32, K 0 / 2 / 4 in turn: every direction of the cost model seen
        k = (0, 2, 4)[i % 3]
        acc = np.minimum(rng.geometric(0.35, 32) - 1, k)
        dur = (20 + 3.5 * (k + 1) + 1.5 * k) / 1e3
        t += dur
        loop.observe(StepBatch.of(StepObservation.build(
            time_s=t, duration_s=dur, traffic_class=["c"] * 32, method=["off" if k == 0 else "eagle3"] * 32,
            k=[k] * 32, drafted=[k] * 32, accepted=acc.tolist())))  # fmt: skip
    learner = loop.learner  # type: ignore[attr-defined]
    i4, ioff = arms.index(Arm(Method.EAGLE3, 4)), arms.index(OFF)
    judged = learner.switch_check(Context.parse("17-32/*"), list(range(len(arms))), i4, ioff)
    assert judged is not None
    gain, margin = judged
    assert gain < 0 < margin  # off is worse here: a draw of it is held back
