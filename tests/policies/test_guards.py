"""Safety guards: hysteresis at a batch-size boundary, the p99 TPOT guard, the exploration budget."""

import numpy as np
import pytest

from policies.arms import Arm
from policies.context import Context
from policies.engine import EngineInfo
from policies.guards import ExplorationBudget, TpotGuard, keeps_current
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.spec import parse_policy

E2, E4, E1, OFF = (Arm.parse(a) for a in ("eagle3:2", "eagle3:4", "eagle3:1", "off"))
STOCK = EngineInfo("e", "m", 4, (E1, E2, E4, OFF))


def policy(algorithm: str, extra: str = "", params: str = "{}") -> str:
    return (
        "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: t}\n"
        f"spec:\n  algorithm: {{name: {algorithm}, params: {params}}}\n"
        + ("" if "min_dwell_s:" in extra else "  min_dwell_s: 0\n")
        + extra
    )


def step(arm: Arm, batch: int, goodput: float, accepted: int | None = None) -> StepObservation:
    """A step of ``arm`` whose rows reach ``goodput`` tokens/s (accepted defaults to K)."""
    acc = arm.k if accepted is None else accepted
    return StepObservation.build(
        time_s=0.0,
        duration_s=batch * (acc + 1) / goodput,
        traffic_class=["default"] * batch,
        method=[arm.method] * batch,
        k=[arm.k] * batch,
        drafted=[arm.k] * batch,
        accepted=[acc] * batch,
    )


def test_keeps_current_unit() -> None:
    est = np.array([100.0, 101.0, 130.0, np.nan])
    assert keeps_current(est, 0, 1, 0.02)  # 1 % better: inside the margin
    assert not keeps_current(est, 0, 2, 0.02)  # 30 % better: switch
    assert not keeps_current(est, 0, 3, 0.02)  # never tried: no estimate to hold it back
    assert not keeps_current(est, 0, 1, 0.0)
    assert not keeps_current(est, -1, 1, 0.02)


def run_boundary(
    margin: float, rounds: int, truth: dict[Arm, float], seed: int = 0
) -> tuple[ControlLoop, int]:
    """Batches alternate 8 and 9 (the 5-8 | 9-16 boundary); rewards are noisy around ``truth``."""
    loop = ControlLoop(
        spec=parse_policy(
            policy("discounted_thompson", f"  arms: [eagle3:2, eagle3:4]\n  switch_margin: {margin}\n")
        ),
        engine=STOCK,
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    loop.decide(0.0)
    switches = 0
    for r in range(1, rounds + 1):
        arms = loop.current_arms()
        for batch in (8, 9):
            bucket = Context.parse("5-8/*") if batch == 8 else Context.parse("9-16/*")
            arm = arms[bucket]
            loop.observe(StepBatch.of(step(arm, batch, truth[arm] * (1 + 0.01 * rng.standard_normal()))))
        loop.decide(float(r))
        if r > 10:  # after every arm was tried
            switches += sum(
                c.context in (Context.parse("5-8/*"), Context.parse("9-16/*")) for c in loop.last_changes
            )
    return loop, switches


def test_hysteresis_prevents_flip_flop_between_arms_within_the_margin() -> None:
    near = {E2: 1000.0, E4: 1010.0}  # 1 % apart, noise 1 %
    _, without = run_boundary(0.0, 300, near)
    _, with_margin = run_boundary(0.05, 300, near)
    assert without > 20  # discounted Thompson flip-flops between near-equal arms
    assert with_margin == 0


def test_hysteresis_still_switches_to_a_clear_winner() -> None:
    loop, _ = run_boundary(0.05, 50, {E2: 1000.0, E4: 1010.0})
    rng = np.random.default_rng(9)
    current = loop.current_arms()[Context.parse("5-8/*")]
    other = E4 if current == E2 else E2
    truth = {current: 600.0, other: 1000.0}  # the arm in play lost 40 %
    for r in range(51, 80):
        for batch in (8, 9):
            arm = loop.current_arms()[Context.parse("5-8/*") if batch == 8 else Context.parse("9-16/*")]
            loop.observe(StepBatch.of(step(arm, batch, truth[arm] * (1 + 0.01 * rng.standard_normal()))))
        loop.decide(float(r))
    assert loop.current_arms()[Context.parse("5-8/*")] == other


def test_tpot_guard_unit() -> None:
    g = TpotGuard(slo_ms=40.0, window=64, min_samples=16, release=0.9)
    assert g.update("b", 4) is None  # too few samples
    g.observe("b", 0.060, np.zeros(16, dtype=np.int32))  # 60 ms per token
    assert g.update("b", 4) == 4 and g.trips == 1
    assert TpotGuard.restrict((E1, E2, E4, OFF), [0, 1, 2, 3], 4) == [0, 1, 3]
    assert TpotGuard.restrict((E1, E2, E4, OFF), [2], 1) == [2]  # nothing shorter: keep the shortest
    g.observe("b", 0.030, np.zeros(16, dtype=np.int32))  # 30 ms < 0.9 x 40
    assert g.update("b", 2) is None


def test_tpot_guard_caps_a_bucket_above_the_slo_and_lifts_the_cap_below_it() -> None:
    loop = ControlLoop(
        spec=parse_policy(
            policy(
                "epsilon_greedy",
                "  min_dwell_s: 100\n  slo: {p99_tpot_ms: 40, window: 64, min_samples: 32}\n",
                "{epsilon: 0}",
            )
        ),
        engine=STOCK,
    )
    # Teach it that eagle3:4 has the best goodput, but its steps take 60 ms for a request with no accepts.
    for arm, g in ((E1, 500.0), (E2, 600.0), (OFF, 300.0), (E4, 900.0)):
        loop.observe(StepBatch.of(step(arm, 8, g)))
    loop.decide(0.0)
    assert loop.current_arms()[Context.parse("5-8/*")] == E4
    for _ in range(8):
        loop.observe(StepBatch.of(step(E4, 8, 8 / 0.060, accepted=0)))
    p99 = loop.tpot_guard.p99("5-8")
    assert p99 is not None and p99 > 40
    loop.decide(3.0)  # min_dwell_s is 100: only the guard may force this switch
    assert loop.tpot_guard.cap("5-8") == 4 and loop.current_arms()[Context.parse("5-8/*")].k < 4
    assert loop.totals.tpot_trips == 1
    assert loop.decide(3.0).k_for_batch(8, 4) < 4
    # Under the cap the steps are short: 20 ms per token, well under 0.9 x 40 ms.
    for _ in range(8):
        loop.observe(
            StepBatch.of(step(loop.current_arms()[Context.parse("5-8/*")], 8, 8 / 0.020, accepted=0))
        )
    loop.decide(4.0)
    assert loop.tpot_guard.cap("5-8") is None


def test_exploration_budget_unit() -> None:
    b = ExplorationBudget(max_share=0.1, high_load_batch=32)
    assert b.applies((17, 32)) and b.applies((33, 0)) and not b.applies((9, 16))
    allowed = [b.permit(Context.parse("33+/*"), exploratory=True) for _ in range(100)]
    assert sum(allowed) == 10 and b.explored(Context.parse("33+/*")) == (10, 100)
    assert not ExplorationBudget(max_share=1.0, high_load_batch=32).applies((33, 0))


@pytest.mark.parametrize("share", [0.05, 1.0])
def test_exploration_budget_limits_exploratory_choices_at_high_load(share: float) -> None:
    loop = ControlLoop(
        spec=parse_policy(
            policy(
                "epsilon_greedy",
                f"  exploration: {{max_share_at_high_load: {share}, high_load_batch: 32}}\n",
                "{epsilon: 0.5}",
            )
        ),
        engine=STOCK,
    )
    truth = {E1: 800.0, E2: 1000.0, E4: 700.0, OFF: 500.0}
    # Every arm seen once in both buckets, so estimates exist and the greedy arm is eagle3:2.
    for arm, g in truth.items():
        loop.observe(StepBatch.of(step(arm, 32, g)))
        loop.observe(StepBatch.of(step(arm, 8, g)))
    loop.decide(0.0)
    off_greedy = {Context.parse("17-32/*"): 0, Context.parse("5-8/*"): 0}
    rounds = 400
    for r in range(1, rounds + 1):
        arms = loop.current_arms()
        loop.observe(
            StepBatch.of(step(arms[Context.parse("17-32/*")], 32, truth[arms[Context.parse("17-32/*")]]))
        )
        loop.observe(StepBatch.of(step(arms[Context.parse("5-8/*")], 8, truth[arms[Context.parse("5-8/*")]])))
        loop.decide(float(r))
        for key in off_greedy:
            off_greedy[key] += loop.current_arms()[key] != E2
    if share < 1.0:
        explored, decisions = loop.budget.explored(Context.parse("17-32/*"))
        assert explored <= share * decisions
        assert off_greedy[Context.parse("17-32/*")] <= share * rounds
        assert loop.totals.exploration_denied > 0
    else:
        # No budget: epsilon 0.5 over 4 arms leaves the greedy arm about 3/8 of the rounds.
        assert off_greedy[Context.parse("17-32/*")] > 0.25 * rounds
    # Below the high-load batch size the learner explores freely either way.
    assert off_greedy[Context.parse("5-8/*")] > 0.25 * rounds


def test_a_guard_whose_min_samples_exceed_its_window_acts_once_the_window_is_full() -> None:
    # What a saved policy from before the rule may hold: it acts at `window` samples, not never.
    g = TpotGuard.from_params({"p99_tpot_ms": 40.0, "window": 32, "min_samples": 64, "release": 0.9})
    g.observe("b", 0.060, np.zeros(31, dtype=np.int32))
    assert g.update("b", 4) is None
    g.observe("b", 0.060, np.zeros(1, dtype=np.int32))
    assert g.update("b", 4) == 4 and g.trips == 1
