"""The ControlLoop: observe -> decide, with an injected clock and a seeded RNG."""

import json

import numpy as np
import pytest

from policies.arms import Arm, Method
from policies.context import Context
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.spec import parse_policy, static_policy

ARMS = tuple(Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:4", "ngram:4", "off"))
COMPOSITE = EngineInfo("e1", "m", 4, ARMS, Granularity.REQUEST_METHOD)
STOCK = EngineInfo(
    "e2", "m", 4, tuple(a for a in ARMS if a.method is not Method.NGRAM), Granularity.BATCH_STEP
)


def policy(algorithm: str = "discounted_thompson", **spec: object) -> str:
    extra = "".join(f"  {k}: {v}\n" for k, v in {"min_dwell_s": 0, **spec}.items())
    return (
        "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: t}\n"
        f"spec:\n  algorithm: {{name: {algorithm}}}\n{extra}"
    )


def step(arm: Arm, accepted: list[int], classes: list[str], duration: float = 0.01) -> StepObservation:
    n = len(accepted)
    return StepObservation.build(
        time_s=0.0,
        duration_s=duration,
        traffic_class=classes,
        method=[arm.method] * n,
        k=[arm.k] * n,
        drafted=[arm.k] * n,
        accepted=accepted,
    )


def test_first_decision_covers_every_bucket_and_versions_only_on_change() -> None:
    loop = ControlLoop(spec=static_policy("eagle3:2"), engine=STOCK)
    d1 = loop.decide(0.0)
    assert d1.version == 1 and d1.method is Method.EAGLE3
    assert [(r.bs_min, r.bs_max, r.k) for r in d1.k_table] == [(1, 0, 2)]
    assert loop.decide(0.5) is d1  # not due yet
    d2 = loop.decide(5.0)
    assert d2.version == 1 and d2.same_decision(d1)


def test_static_off_gives_k_zero_everywhere() -> None:
    d = ControlLoop(spec=static_policy("off"), engine=STOCK).decide(0.0)
    assert all(r.k == 0 for r in d.k_table)
    assert d.k_for_batch(1, 4) == 0 and d.k_for_batch(100, 4) == 0


def test_goodput_is_the_reward_not_acceptance() -> None:
    # Same acceptance (all drafts accepted) but K=4 steps cost so much more that K=1 has the better goodput.
    loop = ControlLoop(spec=parse_policy(policy("epsilon_greedy")), engine=STOCK)
    loop.decide(0.0)
    loop.observe(StepBatch.of(step(Arm.parse("eagle3:4"), [4] * 8, ["default"] * 8, duration=0.050)))
    loop.observe(StepBatch.of(step(Arm.parse("eagle3:1"), [1] * 8, ["default"] * 8, duration=0.010)))
    loop.decide(1.0)
    est = loop.estimates()[Context.parse("5-8/*")]
    assert est[Arm.parse("eagle3:4")] == pytest.approx(5 * 8 / 0.050)
    assert est[Arm.parse("eagle3:1")] == pytest.approx(2 * 8 / 0.010)
    assert est[Arm.parse("eagle3:1")] > est[Arm.parse("eagle3:4")]


def test_per_class_contexts_only_for_request_granular_engines() -> None:
    obs = step(Arm.parse("eagle3:2"), [2, 0], ["code", "chat"])
    composite = ControlLoop(spec=parse_policy(policy()), engine=COMPOSITE)
    stock = ControlLoop(spec=parse_policy(policy()), engine=STOCK)
    for loop in (composite, stock):
        loop.decide(0.0)
        loop.observe(StepBatch.of(obs))
        loop.decide(1.0)
    assert {Context.parse("2-4/code"), Context.parse("2-4/chat"), Context.parse("2-4/*")} <= set(
        composite.current_arms()
    )
    assert not any(k.traffic_class in ("code", "chat") for k in stock.current_arms())
    d = composite.directive
    assert d is not None and {e.traffic_class for e in d.plan} <= {"*", "code", "chat"}
    arms = composite.current_arms()
    for cls in ("code", "chat"):
        # Every class gets its context's arm, through its own entry or the bucket's "*".
        assert d.arm_for(cls, 2) == arms[Context(bucket="2-4", traffic_class=cls)]
    assert all(
        e.arm != arms[Context.parse("2-4/*")] for e in d.plan if e.traffic_class != "*" and e.covers(2)
    )


def test_a_class_on_the_bucket_arm_issues_no_new_version() -> None:
    loop = ControlLoop(spec=static_policy("eagle3:2"), engine=COMPOSITE)
    d1 = loop.decide(0.0)
    loop.observe(StepBatch.of(step(Arm.parse("eagle3:2"), [1, 1], ["code", "chat"])))
    d2 = loop.decide(5.0)
    assert d2.version == d1.version and Context.parse("2-4/code") in loop.current_arms()


def test_learns_the_better_method_per_class() -> None:
    # code: n-gram accepts 4 of 4, EAGLE-3 1 of 4; chat: the reverse. Same step cost.
    loop = ControlLoop(spec=parse_policy(policy()), engine=COMPOSITE, seed=1)
    goodness = {
        ("code", Method.NGRAM): 4,
        ("code", Method.EAGLE3): 1,
        ("chat", Method.NGRAM): 0,
        ("chat", Method.EAGLE3): 3,
    }
    for r in range(60):
        d = loop.decide(float(r))
        for cls in ("code", "chat"):
            arm = d.arm_for(cls, 2)
            acc = min(arm.k, goodness.get((cls, arm.method), 0))
            loop.observe(StepBatch.of(step(arm, [acc, acc], [cls, cls], duration=0.01 + 0.002 * arm.k)))
    arms = loop.current_arms()
    assert arms[Context.parse("2-4/code")] == Arm.parse("ngram:4")
    assert arms[Context.parse("2-4/chat")].method is Method.EAGLE3


def test_min_dwell_holds_a_context_until_it_elapses() -> None:
    loop = ControlLoop(spec=parse_policy(policy("epsilon_greedy", min_dwell_s=10)), engine=STOCK, seed=0)
    first = loop.decide(0.0).k_table
    for t in range(1, 10):
        loop.observe(StepBatch.of(step(Arm.parse("eagle3:1"), [0], ["x"], duration=1.0)))
        assert loop.decide(float(t)).k_table == first


def test_p_eagle_restricted_to_k_max_unless_engine_is_fixed() -> None:
    arms = tuple(Arm.parse(a) for a in ("p_eagle:2", "p_eagle:4", "off"))
    buggy = ControlLoop(spec=parse_policy(policy()), engine=EngineInfo("p", "m", 4, arms))
    fixed = ControlLoop(
        spec=parse_policy(policy()), engine=EngineInfo("p", "m", 4, arms, p_eagle_partial_k_safe=True)
    )
    assert Arm.parse("p_eagle:2") not in buggy.arms and Arm.parse("p_eagle:4") in buggy.arms
    assert Arm.parse("p_eagle:2") in fixed.arms


def test_no_playable_arm_is_an_error() -> None:
    with pytest.raises(ValueError, match="offers no arm"):
        ControlLoop(spec=static_policy("ngram:4"), engine=EngineInfo("x", "m", 4, (Arm.parse("p_eagle:2"),)))


def test_rows_for_arms_outside_the_policy_are_counted_not_learned() -> None:
    spec = parse_policy(policy(arms="[eagle3:2, off]"))
    loop = ControlLoop(spec=spec, engine=STOCK)
    loop.decide(0.0)
    loop.observe(StepBatch.of(step(Arm.parse("eagle3:4"), [3, 3], ["a", "a"])))
    assert loop.totals.ignored_rows == 2 and loop.totals.accepted == 6


def test_state_round_trips_through_json() -> None:
    loop = ControlLoop(spec=parse_policy(policy()), engine=COMPOSITE, seed=3)
    for r in range(20):
        d = loop.decide(float(r))
        arm = d.arm_for("code", 8)
        loop.observe(StepBatch.of(step(arm, [min(arm.k, 2)] * 8, ["code"] * 8)))
    state = json.loads(json.dumps(loop.state_dict()))
    again = ControlLoop(spec=parse_policy(policy()), engine=COMPOSITE, seed=99)
    again.load_state_dict(state)
    assert again.current_arms() == loop.current_arms()
    assert again.estimates() == loop.estimates()
    assert again.totals == loop.totals
    # Same RNG state, same next choices.
    assert again.decide(100.0).plan == loop.decide(100.0).plan


def test_state_for_other_arms_is_refused() -> None:
    loop = ControlLoop(spec=parse_policy(policy()), engine=COMPOSITE)
    other = ControlLoop(spec=parse_policy(policy()), engine=STOCK)
    with pytest.raises(ValueError, match="different arm set"):
        other.load_state_dict(loop.state_dict())


def test_totals() -> None:
    loop = ControlLoop(spec=static_policy("eagle3:2"), engine=STOCK)
    loop.observe(StepBatch.of(step(Arm.parse("eagle3:2"), [2, 1, 0], ["a"] * 3, duration=0.02)))
    t = loop.totals
    assert (t.steps, t.request_steps, t.drafted, t.accepted, t.emitted) == (1, 3, 6, 3, 6)
    assert t.acceptance_rate == 0.5 and t.goodput == pytest.approx(300.0)
    assert np.isfinite(t.busy_s)


def test_each_round_hands_the_learner_request_steps_and_tokens_per_arm() -> None:
    loop = ControlLoop(
        spec=parse_policy(policy("goodput_model", contexts="{per_class: true}")), engine=COMPOSITE
    )
    seen: dict[Context, tuple[list[float], list[float]]] = {}
    loop.learner.observe_round = lambda ctx, rows, tokens: seen.__setitem__(  # type: ignore[method-assign]
        ctx, (rows.tolist(), tokens.tolist())
    )
    loop.decide(0.0)
    e2, ng4 = ARMS.index(Arm.parse("eagle3:2")), ARMS.index(Arm.parse("ngram:4"))
    for _ in range(3):
        loop.observe(StepBatch.of(step(Arm.parse("eagle3:2"), [1, 2], ["chat", "code"])))
        loop.observe(StepBatch.of(step(Arm.parse("ngram:4"), [4], ["code"])))
    loop.decide(10.0)
    # Two-row steps fall in bucket 2-4, one-row steps in bucket 1.
    assert (
        seen[Context.parse("2-4/*")][0][e2] == 6
        and sum(seen[Context.parse("2-4/*")][0]) == 6
        and seen[Context.parse("2-4/*")][1][e2] == 3 * (2 + 3)
    )
    assert (
        seen[Context.parse("1/*")][0][ng4] == 3
        and sum(seen[Context.parse("1/*")][0]) == 3
        and seen[Context.parse("1/*")][1][ng4] == 3 * 5
    )
    assert seen[Context.parse("2-4/code")][0][e2] == 3 and seen[Context.parse("1/code")][0][ng4] == 3
