"""The model-based goodput learner: acceptance and cost models, sharing across batch sizes, joint plans."""

import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from policies.algorithms import GoodputModel
from policies.arms import Arm, Method
from policies.context import ANY_CLASS, Context
from policies.observation import NOT_SCORED, StepBatch, StepObservation

ARMS = tuple(Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:4", "ngram:2", "ngram:4", "off"))


def model(seed: int = 0, **params: Any) -> GoodputModel:
    full = {k: p.default for k, p in GoodputModel.PARAMS.items()} | params
    return GoodputModel(arms=ARMS, params=full, rng=np.random.default_rng(seed))


def expected_accepted(m: GoodputModel, arm: str) -> float:
    """The model's mean accepted drafts for ``arm`` on chat requests (no posterior draw)."""
    return float(m._accepted("chat", [ARMS.index(Arm.parse(arm))], sample=False)[0])


def cost_ms(batch: int, eagle_k: int, tokens: int) -> float:
    """Ground-truth step time: 6 ms + 0.05 ms per verified token + 0.8 ms per sequential EAGLE pass."""
    return 6.0 + 0.05 * tokens + (0.3 + 0.8 * eagle_k if eagle_k else 0.0)


def steps(
    rng: np.random.Generator, arm: Arm, batch: int, p_eagle: float, ngram_cf: int = NOT_SCORED
) -> StepObservation:
    k = arm.k
    # Geometric acceptance: each position accepted with p_eagle given the previous one was.
    acc = np.minimum(rng.geometric(1 - p_eagle, size=batch) - 1, k) if arm.method is Method.EAGLE3 else None
    if arm.method is Method.NGRAM:
        acc = np.minimum(np.full(batch, max(ngram_cf, 0)), k)
    if acc is None:
        acc = np.zeros(batch, dtype=int)
    tokens = batch * (k + 1)
    eagle_k = k if arm.method is Method.EAGLE3 else 0
    return StepObservation.build(
        time_s=0.0,
        duration_s=cost_ms(batch, eagle_k, tokens) / 1e3,
        traffic_class=["chat"] * batch,
        method=[arm.method] * batch,
        k=[k] * batch,
        drafted=[k] * batch,
        accepted=acc,
        counterfactual={Method.NGRAM: [ngram_cf] * batch},
    )


def test_learns_ngram_acceptance_from_counterfactuals_without_playing_it() -> None:
    m = model()
    rng = np.random.default_rng(1)
    for _ in range(50):
        m.observe(
            StepBatch.of(steps(rng, Arm.parse("eagle3:2"), 4, 0.5, ngram_cf=3)), ["2-4"], per_class=True
        )
    assert expected_accepted(m, "ngram:2") == pytest.approx(2.0, abs=0.05)
    assert expected_accepted(m, "ngram:4") == pytest.approx(3.0, abs=0.1)
    # EAGLE-3 was verified at K=2 only: p = 0.5 per position, so E[accepted | K=2] = 0.5 + 0.25.
    assert expected_accepted(m, "eagle3:2") == pytest.approx(0.75, abs=0.08)


def test_cost_model_recovers_step_times_and_generalises_to_unseen_batch_sizes() -> None:
    m = model(ridge=1e-6)
    rng = np.random.default_rng(2)
    for batch in (1, 2, 4, 8):
        for arm in ARMS:
            for _ in range(10):
                m.observe(StepBatch.of(steps(rng, arm, batch, 0.6)), ["x"], per_class=False)
    theta = m._theta(sample=False)
    for arm, batch in [(Arm.parse("eagle3:4"), 32), (Arm.parse("off"), 48), (Arm.parse("ngram:4"), 40)]:
        got = float(m._costs(theta, float(batch), np.array([ARMS.index(arm)]))[0])
        want = cost_ms(batch, arm.k if arm.method is Method.EAGLE3 else 0, batch * (arm.k + 1))
        # The n-gram lookup adds no time in the ground truth; its fitted indicator is ~0.
        assert got == pytest.approx(want, rel=0.02)


def test_speculation_stops_at_a_batch_size_never_seen() -> None:
    # Learn at small batches only; at batch 64 verifying drafts of a poorly accepted head no longer pays.
    m = model(explore=0.0)
    rng = np.random.default_rng(3)
    for batch in (1, 2, 3, 4):
        for arm in ARMS:
            for _ in range(20):
                m.observe(StepBatch.of(steps(rng, arm, batch, 0.3)), ["2-4"], per_class=False)
    m._batch["33+"] = np.array([64.0, 1.0])
    small = ARMS[m.select(Context.parse("1/*"), range(len(ARMS)))]  # type: ignore[arg-type]
    large = ARMS[m.select(Context.parse("33+/*"), range(len(ARMS)))]  # type: ignore[arg-type]
    assert small.method is Method.EAGLE3
    assert large == Arm.parse("off")


def test_joint_plan_is_the_best_pair_for_the_batch() -> None:
    m = model(explore=0.0)
    rng = np.random.default_rng(4)
    # chat: EAGLE-3 accepts 80 % per position, n-gram nothing; code: n-gram copies 4 tokens, EAGLE-3 poor.
    # The engine explored a few arms (both classes on the same arm), so the cost model is identified.
    for r in range(200):
        arm = ARMS[r % len(ARMS)]
        chat = steps(rng, arm, 2, 0.8, ngram_cf=0)
        code = steps(rng, arm, 2, 0.1, ngram_cf=4)
        both = StepObservation.build(
            time_s=0.0,
            duration_s=chat.duration_s,
            traffic_class=["chat", "chat", "code", "code"],
            method=np.concatenate([chat.method, code.method]),
            k=np.concatenate([chat.k, code.k]),
            drafted=np.concatenate([chat.drafted, code.drafted]),
            accepted=np.concatenate([chat.accepted, code.accepted]),
            counterfactual={
                Method.NGRAM: np.concatenate(
                    [chat.counterfactual[Method.NGRAM], code.counterfactual[Method.NGRAM]]
                )
            },
        )
        m.observe(StepBatch.of(both), ["2-4"], per_class=True)
    plan = m.plan_bucket("2-4", ["chat", "code"], range(len(ARMS)))  # type: ignore[arg-type]
    assert plan is not None

    def true_goodput(chat: Arm, code: Arm) -> float:
        def acc(arm: Arm, p_eagle: float, ngram: int) -> float:
            if arm.method is Method.EAGLE3:
                return sum(p_eagle**j for j in range(1, arm.k + 1))
            return min(ngram, arm.k) if arm.method is Method.NGRAM else 0.0

        emitted = 2 * (1 + acc(chat, 0.8, 0)) + 2 * (1 + acc(code, 0.1, 4))
        eagle_k = max([a.k for a in (chat, code) if a.method is Method.EAGLE3], default=0)
        return emitted / cost_ms(4, eagle_k, 2 * (chat.k + 1) + 2 * (code.k + 1))

    best = max(((a, b) for a in ARMS for b in ARMS), key=lambda ab: true_goodput(*ab))
    # The one EAGLE pass a chat request would need costs the whole batch more than chat gains:
    # the best joint plan drafts code with n-gram and leaves chat off.
    assert best == (Arm.parse("off"), Arm.parse("ngram:4"))
    assert (ARMS[plan["chat"]], ARMS[plan["code"]]) == best


def test_state_round_trips() -> None:
    m = model()
    rng = np.random.default_rng(5)
    for _ in range(30):
        m.observe(
            StepBatch.of(steps(rng, Arm.parse("eagle3:2"), 4, 0.5, ngram_cf=1)), ["2-4"], per_class=True
        )
    again = model()
    again.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert np.allclose(again.estimates(Context.parse("2-4/chat")), m.estimates(Context.parse("2-4/chat")))


def test_wrong_shaped_state_is_refused() -> None:
    m = model()
    state = m.state_dict()
    state["xtx"] = [[1.0]]
    with pytest.raises(
        ValueError, match=r"xtx: expected a list of numbers of shape \(6 x 6\), got \[\[1.0\]\]"
    ):
        model().load_state_dict(state)


def test_limited_depth_counterfactuals_do_not_count_later_positions_as_rejected() -> None:
    # An EAGLE head's first position, scored on rows that verified n-gram: exact for one token only.
    m = model()
    for _ in range(100):
        obs = StepObservation.build(
            time_s=0.0,
            duration_s=0.01,
            traffic_class=["chat"] * 4,
            method=[Method.NGRAM] * 4,
            k=[2] * 4,
            drafted=[2] * 4,
            accepted=[0] * 4,
            counterfactual={Method.EAGLE3: [1] * 4},
        )
        m.observe(
            StepBatch.of(replace(obs, counterfactual_depth={Method.EAGLE3: 1})), ["2-4"], per_class=True
        )
    # Position 1 is certain; positions 2-4 are still at the prior (1/2 each): 1 + 1/2 + 1/4 + 1/8.
    assert expected_accepted(m, "eagle3:4") == pytest.approx(1.875, abs=0.02)


def test_rows_the_rule_drafts_with_ngram_shorten_the_planned_eagle_draft() -> None:
    """Every row pays for EAGLE-3's passes, but the rule's n-gram rows gain nothing from them.

    Ground truth at batch 8, p = 0.8 per position: with every row on EAGLE-3, K=4 is best (2.34 tokens
    per ms, against 2.14 for K=2); with three of eight rows drafting n-gram by the rule (4 of 4
    accepted), K=2 is (2.89 against 2.77 for K=4); with five of eight, no draft at all (3.67 against
    3.45 for K=1): only three rows would gain from a 1.1 ms pass.
    """
    trained = [Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:4", "off")]
    allowed = [ARMS.index(a) for a in trained]  # no n-gram arm: n-gram rows are the rule's

    def train(ngram_rows: int) -> GoodputModel:
        m = model(explore=0.0, ridge=1e-6)
        rng = np.random.default_rng(4)
        e = 8 - ngram_rows
        for _ in range(60):
            for arm in trained:
                acc = np.minimum(rng.geometric(0.2, size=e) - 1, arm.k)
                method = Method.EAGLE3 if arm.k else Method.OFF
                obs = StepObservation.build(
                    time_s=0.0,
                    duration_s=cost_ms(8, arm.k, e * (arm.k + 1) + ngram_rows * 5) / 1e3,
                    traffic_class=["chat"] * 8,
                    method=[method] * e + [Method.NGRAM] * ngram_rows,
                    k=[arm.k] * e + [4] * ngram_rows,
                    drafted=[arm.k] * e + [4] * ngram_rows,
                    accepted=[*acc.tolist(), *[4] * ngram_rows],
                )
                m.observe(StepBatch.of(obs), ["5-8"], per_class=True)
        # What the control loop hands over at the decision round: request-steps and tokens per arm.
        rows, tokens = np.zeros(len(ARMS)), np.zeros(len(ARMS))
        rows[[ARMS.index(a) for a in trained]] = 60 * e
        rows[ARMS.index(Arm.parse("ngram:4"))] = 60 * len(trained) * ngram_rows
        tokens[ARMS.index(Arm.parse("ngram:4"))] = 5 * 60 * len(trained) * ngram_rows
        for ctx in (Context.parse("5-8/*"), Context.parse("5-8/chat")):
            m.observe_round(ctx, rows, tokens)
        return m

    def planned(m: GoodputModel) -> Arm:
        plan = m.plan_bucket("5-8", ["chat"], allowed, sample=False)
        assert plan is not None and plan["chat"] == plan[ANY_CLASS]
        return ARMS[plan[ANY_CLASS]]

    assert planned(train(0)) == Arm.parse("eagle3:4")
    assert planned(train(3)) == Arm.parse("eagle3:2")
    assert planned(train(5)) == Arm.parse("off")
    # Offered n-gram arms, the plan may draft n-gram itself: no rows are set aside as the rule's.
    everything = train(5).plan_bucket("5-8", ["chat"], list(range(len(ARMS))), sample=False)
    assert everything is not None and ARMS[everything["chat"]].method is Method.NGRAM


def test_derived_acceptance_follows_every_update_and_plans_draw_as_without_it() -> None:
    """What a decision round derives once per change of the counts (the posterior mean of accepted
    drafts, the Beta parameters the draws use) is never stale: after every update, a learner asked for
    estimates and plans all along estimates and plans as a fresh one loaded with its state, and draws
    as one never asked for estimates."""
    rng = np.random.default_rng(7)
    asked, quiet = model(seed=3), model(seed=3)
    ctx = Context(bucket="8-15", traffic_class="chat")
    allowed = list(range(len(ARMS)))
    for i in range(60):
        arm = ARMS[int(rng.integers(0, len(ARMS)))]
        obs = steps(
            rng, arm, int(rng.integers(1, 32)), p_eagle=0.3 + 0.6 * (i % 2), ngram_cf=int(rng.integers(0, 4))
        )
        for m in (asked, quiet):
            m.observe(StepBatch.of(obs), ["8-15"], True)
            if i % 10 == 9:
                m.on_drift("chat", Method.EAGLE3, 0.5)
        fresh = model(seed=3)
        fresh.load_state_dict(json.loads(json.dumps(asked.state_dict())))
        np.testing.assert_array_equal(asked.estimates(ctx), fresh.estimates(ctx))
        greedy = asked.plan_bucket("8-15", ["chat"], allowed, sample=False)
        assert greedy == fresh.plan_bucket("8-15", ["chat"], allowed, sample=False)
        # Sampled plans draw from the same parameters, so they consume the random streams alike.
        assert asked.plan_bucket("8-15", ["chat"], allowed) == quiet.plan_bucket("8-15", ["chat"], allowed)
    assert asked.rng.bit_generator.state == quiet.rng.bit_generator.state


def test_the_cost_model_counts_the_tokens_drafted_not_the_k_planned() -> None:
    # An n-gram draft can fall short of its K (the match runs out): the step verified what was
    # drafted, and charging K per row biased the per-token slope fitted from mixed steps.
    def step(k: int, drafted: int) -> StepObservation:
        return StepObservation.build(
            time_s=0.0,
            duration_s=cost_ms(4, 0, 4 * (drafted + 1)) / 1e3,
            traffic_class=["chat"] * 4,
            method=[Method.NGRAM] * 4,
            k=[k] * 4,
            drafted=[drafted] * 4,
            accepted=[drafted] * 4,
        )

    short, exact = model(), model()
    for _ in range(20):
        short.observe(StepBatch.of(step(4, 2)), ["2-4"], per_class=True)
        exact.observe(StepBatch.of(step(2, 2)), ["2-4"], per_class=True)
    np.testing.assert_allclose(short._xtx, exact._xtx)
    np.testing.assert_allclose(short._xty, exact._xty)
