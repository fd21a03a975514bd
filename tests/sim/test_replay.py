from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policies.arms import METHOD_CODES, Method
from policies.loop import ControlLoop
from policies.observation import NOT_SCORED, StepBatch, StepObservation
from policies.presets import load_preset
from policies.spec import parse_policy, static_policy
from sim.costmodel import load_profile
from sim.engines import ENGINES, EngineModel
from sim.replay import Replayer
from sim.trace import Trace, read_trace
from sim.traffic import generate
from sim.vectorised import replay_static

PROFILE = load_profile("llama-3.1-8b-h100")
LIB = Path(__file__).resolve().parents[2] / "policies" / "library"


def _static(trace: Trace, arm: str, c: int = 1) -> object:
    from policies.arms import Arm
    from sim.engines import engine_for_arm

    a = Arm.parse(arm)
    return replay_static(
        trace, method=a.method, k=a.k, concurrency=c, profile=PROFILE, engine=engine_for_arm(a)
    )


@pytest.mark.parametrize(
    ("arm", "steps_a", "steps_b", "accepted"),
    [
        # a: acc [2,0,3,0,0,0], 6 tokens. K=2: t0 accepts 2 (done 4), t3 0 (5), t4 0 (6) -> 3 steps.
        # b: acc [5,5,5,5], 4 tokens. K=2: t0 accepts 2 (done 4) -> 1 step.
        ("eagle3:2", 3, 1, 2 + 2),
        # K=1: a: t0 1 (3), t2 1 (5), t4 0 (6) -> 3 steps; b: t0 1 (3), t2 capped at 1 remaining -> 2 steps.
        ("eagle3:1", 3, 2, 2 + 1),
        # K=4: a as K=2; b: t0 min(5,4)=4 but only 3 remain -> 1 step, 2 accepted (capped).
        ("eagle3:4", 3, 1, 2 + 2),
        # n-gram K=4: a never accepts -> 5 steps; b: t0 accepts 3 -> done 4 -> 1 step, 2 counted.
        ("ngram:4", 5, 1, 0 + 2),
        ("off", 5, 3, 0),
    ],
)
def test_hand_made_replay_is_exact(
    hand_trace: Path, arm: str, steps_a: int, steps_b: int, accepted: int
) -> None:
    t = read_trace(hand_trace)
    r = _static(t, arm)
    assert r.request_steps == steps_a + steps_b  # type: ignore[attr-defined]
    assert r.accepted == accepted  # type: ignore[attr-defined]
    # One prefill step per request plus its decode steps, run one after the other at concurrency 1.
    assert r.steps == 2 + steps_a + steps_b  # type: ignore[attr-defined]
    assert int(r.timeline.emitted.sum()) == 10  # type: ignore[attr-defined]


def test_hand_made_step_times(hand_trace: Path) -> None:
    """eagle3:2 at concurrency 1, priced by hand from the published coefficients."""
    t = read_trace(hand_trace)
    r = _static(t, "eagle3:2")

    def target(kv: float, batched: float) -> float:
        return 3.92645679e-08 * kv + 2.10103129e-05 * batched + 5.88590713e-03

    def draft_fwd(kv: float, spec: float) -> float:
        return (2.37768493e-09 * kv + 8.41429603e-07 * spec + 2.13526175e-03) / 3

    ovh = 1.20683946e-03
    # Request a: prefill of 10 prompt tokens (the head runs one forward), then decode steps at done = 1, 4, 5.
    prefill = target(0, 10) + draft_fwd(0, 0) + ovh
    steps = [target(10 + d, 3) + 2 * draft_fwd(10 + d, 2) + ovh for d in (1, 4, 5)]
    expected_finish_a = prefill + sum(steps)
    assert r.first_token_s[0] == pytest.approx(prefill, rel=1e-12)  # type: ignore[attr-defined]
    assert r.finish_s[0] == pytest.approx(expected_finish_a, rel=1e-12)  # type: ignore[attr-defined]
    # Request b starts when a has finished (one slot).
    assert r.submit_s[1] == pytest.approx(expected_finish_a, rel=1e-12)  # type: ignore[attr-defined]
    b_prefill = target(0, 20) + draft_fwd(0, 0) + ovh
    b_step = target(21, 3) + 2 * draft_fwd(21, 2) + ovh
    assert r.finish_s[1] == pytest.approx(expected_finish_a + b_prefill + b_step, rel=1e-12)  # type: ignore[attr-defined]


def test_plain_decode_matches_the_published_worked_value() -> None:
    # arXiv 2601.11580's fitted model: bs = 1 at 1k context, no speculation: ~7.1 ms
    # (vLLM #20780 measured 7.07 ms).
    assert PROFILE.plain_step_time(1, 1000) == pytest.approx(
        3.92645679e-05 + 2.10103129e-05 + 5.88590713e-03 + 1.20683946e-03, rel=1e-12
    )
    assert 7.0e-3 < PROFILE.plain_step_time(1, 1000) < 7.2e-3


@pytest.fixture(scope="module")
def small() -> Trace:
    return generate("mixed", n_requests=24, seed=3)


@pytest.mark.parametrize("arm", ["eagle3:3", "ngram:4", "p_eagle:8", "off"])
@pytest.mark.parametrize("c", [1, 4])
def test_stepwise_equals_vectorised_for_static_arms(small: Trace, arm: str, c: int) -> None:
    from policies.arms import Arm
    from sim.engines import engine_for_arm

    a = Arm.parse(arm)
    eng = engine_for_arm(a)
    v = replay_static(small, method=a.method, k=a.k, concurrency=c, profile=PROFILE, engine=eng)
    s = Replayer(trace=small, profile=PROFILE, engine=eng, policy=static_policy(a), concurrency=c).run()
    assert (s.steps, s.request_steps, s.drafted, s.accepted) == (
        v.steps,
        v.request_steps,
        v.drafted,
        v.accepted,
    )
    np.testing.assert_allclose(s.finish_s, v.finish_s, rtol=1e-12)
    np.testing.assert_allclose(s.first_token_s, v.first_token_s, rtol=1e-12)
    np.testing.assert_allclose(s.submit_s, v.submit_s, rtol=1e-12, atol=1e-12)


def _with_arrivals(t: Trace, arrivals: np.ndarray) -> Trace:
    return replace(t, arrival_s=np.asarray(arrivals, dtype=np.float64))


def test_open_loop_with_everyone_waiting_equals_closed_loop(small: Trace) -> None:
    pol = parse_policy((LIB / "default.yaml").read_text(), source="default")
    t = _with_arrivals(small.subset(range(10)), np.zeros(10))
    closed = Replayer(trace=t, profile=PROFILE, engine=ENGINES["composite"], policy=pol, concurrency=4).run()
    opened = Replayer(
        trace=t, profile=PROFILE, engine=ENGINES["composite"], policy=pol, concurrency=4, open_loop=True
    ).run()
    np.testing.assert_allclose(opened.finish_s, closed.finish_s, rtol=1e-12)
    assert opened.switches == closed.switches


def test_open_loop_with_sparse_arrivals_equals_closed_loop_at_one(small: Trace) -> None:
    pol = static_policy("eagle3:3")
    closed = replay_static(
        small, method=Method.EAGLE3, k=3, concurrency=1, profile=PROFILE, engine=ENGINES["stock-vllm"]
    )
    # Each request arrives long after the previous one finished: never two in the engine at once.
    gaps = np.arange(small.n) * (closed.makespan_s + 1.0)
    t = _with_arrivals(small, gaps)
    opened = Replayer(
        trace=t, profile=PROFILE, engine=ENGINES["stock-vllm"], policy=pol, concurrency=8, open_loop=True
    ).run()
    np.testing.assert_allclose(
        opened.finish_s - opened.submit_s, closed.finish_s - closed.submit_s, rtol=1e-9
    )
    np.testing.assert_allclose(
        opened.first_token_s - opened.submit_s, closed.first_token_s - closed.submit_s, rtol=1e-9
    )
    np.testing.assert_allclose(opened.submit_s, gaps)


def test_open_loop_needs_arrivals(small: Trace) -> None:
    with pytest.raises(ValueError, match="arrival_s"):
        Replayer(
            trace=small,
            profile=PROFILE,
            engine=ENGINES["composite"],
            policy=static_policy("off"),
            concurrency=1,
            open_loop=True,
        )


def _observed(monkeypatch: pytest.MonkeyPatch, trace: Trace, engine: str, c: int) -> list[StepObservation]:
    seen: list[StepObservation] = []
    orig = ControlLoop.observe

    def spy(self: ControlLoop, batch: StepBatch) -> None:
        assert len(batch) == 1  # the simulator reports each step as it runs
        seen.extend(batch.steps)
        orig(self, batch)

    monkeypatch.setattr(ControlLoop, "observe", spy)
    pol = parse_policy((LIB / "default.yaml").read_text(), source="default")
    Replayer(trace=trace, profile=PROFILE, engine=ENGINES[engine], policy=pol, concurrency=c).run()
    return seen


def test_stock_engine_applies_one_k_per_step_and_reports_the_head(
    monkeypatch: pytest.MonkeyPatch, small: Trace
) -> None:
    obs = _observed(monkeypatch, small, "stock-vllm", 4)
    e3, off = METHOD_CODES[Method.EAGLE3], METHOD_CODES[Method.OFF]
    ks = set()
    for o in obs:
        assert len(set(o.k.tolist())) == 1 and len(set(o.method.tolist())) == 1
        assert set(o.method.tolist()) <= {e3, off}
        assert Method.NGRAM not in o.counterfactual  # a stock engine does not score n-gram
        head = o.counterfactual[Method.EAGLE3]
        verified = o.method == e3
        assert (head[verified] == NOT_SCORED).all()
        assert set(head[~verified].tolist()) <= {0, 1}
        ks.add(int(o.k[0]))
    assert len(ks) > 1  # the policy explored more than one K


def test_composite_engine_mixes_methods_and_scores_ngram(
    monkeypatch: pytest.MonkeyPatch, small: Trace
) -> None:
    obs = _observed(monkeypatch, small, "composite", 4)
    ng = METHOD_CODES[Method.NGRAM]
    allowed = {METHOD_CODES[m] for m in (Method.EAGLE3, Method.NGRAM, Method.OFF)}
    mixed = 0
    for o in obs:
        assert set(o.method.tolist()) <= allowed
        cf = o.counterfactual[Method.NGRAM]
        assert ((cf == NOT_SCORED) == (o.method == ng)).all()
        assert (cf[o.method != ng] >= 0).all()
        mixed += len(set(o.method.tolist())) > 1
    assert mixed > 0


def test_engine_without_trace_method_is_refused(small: Trace) -> None:
    t = replace(small, methods=(Method.EAGLE3,), acc={Method.EAGLE3: small.acc[Method.EAGLE3]})
    with pytest.raises(ValueError, match="ngram"):
        Replayer(
            trace=t, profile=PROFILE, engine=ENGINES["composite"], policy=static_policy("off"), concurrency=1
        )


def test_per_request_k_engine_keeps_one_method(monkeypatch: pytest.MonkeyPatch, small: Trace) -> None:
    obs = _observed(monkeypatch, small, "per-request-k", 4)
    e3, off = METHOD_CODES[Method.EAGLE3], METHOD_CODES[Method.OFF]
    for o in obs:
        assert set(o.method.tolist()) <= {e3, off}
        assert ((o.method == off) == (o.k == 0)).all()


@pytest.mark.parametrize("concurrency", [4, 32])
def test_the_plugin_delays_an_async_step_only_past_the_gpu_and_every_waiting_step_in_full(
    concurrency: int,
) -> None:
    # Under async scheduling the host's work (vLLM's and the plugin's) runs while the GPU computes;
    # synchronous scheduling, and a composite step with n-gram rows, pay it on top.
    from policies.arms import Arm
    from policies.presets import load_preset
    from sim.costmodel import PluginCost

    prof = load_profile("llama-3.1-8b-h100")
    tr = generate("code", n_requests=max(30, 4 * concurrency), seed=2)
    # A static arm with the default's per-request rule runs the plugin, and its plans do not depend on
    # the clock (a learner's do), so the runs below differ only in what the plugin costs.
    policy = replace(static_policy(Arm(Method.EAGLE3, 3)), rule=load_preset("default").rule)

    def run(engine: str, plugin: PluginCost) -> tuple[float, int]:
        p = replace(prof, plugin_composite=plugin, plugin_composite_sync=plugin)
        r = Replayer(
            trace=tr, profile=p, engine=ENGINES[engine], policy=policy, concurrency=concurrency, seed=0
        ).run()
        return r.makespan_s, r.steps

    none, small, huge = PluginCost(), PluginCost(1e-4, 1e-6), PluginCost(0.5, 0.0)
    # per-request-k never waits: a plugin cheaper than every GPU step costs nothing; one dearer than
    # every step sets each step's time.
    (t0, n0), (t1, n1), (t2, n2) = (run("per-request-k", c) for c in (none, small, huge))
    assert n0 == n1 and t1 == pytest.approx(t0, rel=1e-12)
    assert t2 == pytest.approx(n2 * (prof.sync_step_s + 0.5), rel=1e-9)
    # composite-sync waits on every step: the plugin is paid in full on each.
    (t0, n0), (t1, n1) = run("composite-sync", none), run("composite-sync", small)
    assert n0 == n1 and t1 - t0 > 0.99 * n1 * small.step_s
    # composite waits only where a request drafts n-gram: the plugin costs something, less than in full.
    (t0, n0), (t1, n1) = run("composite", none), run("composite", small)
    assert n0 == n1 and 0 < t1 - t0 < n1 * (small.step_s + concurrency * small.per_request_s)
    if concurrency == 4:
        # (Here about three steps in four have an n-gram row; in full it would be above n1 * step_s.
        # At 32 nearly every step has one, so nearly every step waits.)
        assert 0 < t1 - t0 < 0.9 * n1 * small.step_s


def test_sync_scheduling_is_charged_to_sync_engines_and_the_plugin_to_controlled_ones() -> None:
    from dataclasses import replace as dc_replace

    from policies.arms import Arm
    from policies.presets import load_preset
    from sim.engines import ENGINES
    from sim.replay import Replayer, needs_plugin
    from sim.traffic import generate

    prof = load_profile("llama-3.1-8b-h100")
    tr = generate("chat", n_requests=30, seed=1)
    arm = Arm(Method.EAGLE3, 3)

    def run(engine: str | EngineModel) -> tuple[float, int]:
        model = ENGINES[engine] if isinstance(engine, str) else engine
        r = Replayer(
            trace=tr, profile=prof, engine=model, policy=static_policy(arm), concurrency=4, seed=0
        ).run()
        return r.makespan_s, r.steps

    (t_async, n_async), (t_sync, n_sync) = run("composite"), run("composite-sync")
    assert n_async == n_sync and t_sync - t_async == pytest.approx(n_sync * prof.sync_step_s, rel=1e-6)
    assert ENGINES["composite"].scheduling == "async-ngram-waits" and ENGINES["composite-sync"].sync
    # On the composite engine a step where a request drafts n-gram waits for its tokens as synchronous
    # scheduling does (the worker's merge needs them on the host); only steps that decode nothing
    # (prefill alone) are then cheaper than under synchronous scheduling.
    arm = Arm(Method.NGRAM, 3)
    waits_always = dc_replace(ENGINES["composite"], scheduling="sync")  # (only the scheduling differs)
    (t_async, n_async), (t_sync, n_sync) = run("composite"), run(waits_always)
    assert n_async == n_sync and 0 <= t_sync - t_async < 0.1 * n_sync * prof.sync_step_s
    # composite-sync runs vLLM's EAGLE-3 proposer at its guessed K, here 1 (every row's class arm is
    # n-gram's), not the table's 3: as the async worker, only its first forward.
    assert arm.k == 3 and run("composite-sync")[0] == pytest.approx(t_sync, rel=1e-12)
    assert [ENGINES["composite"].waits(ng) for ng in (False, True)] == [False, True]
    assert [ENGINES["composite-sync"].waits(ng) for ng in (False, True)] == [True, True]
    assert [ENGINES["stock-vllm"].waits(ng) for ng in (False, True)] == [False, False]
    # A static arm is a plain vLLM; any learner, or a static arm with the per-request rule, runs the
    # plugin and pays for it.
    assert not needs_plugin(static_policy(arm))
    assert needs_plugin(load_preset("default"))
    assert needs_plugin(dc_replace(static_policy(arm), rule=load_preset("default").rule))


def test_a_warm_start_takes_the_donors_tables_not_its_generator(small: Trace) -> None:
    # The autoscale model's warm replica is a sidecar's fleet warm start (ControlLoop.load_learned): it
    # keeps the donor's learned tables but draws from its own seed. It loaded the donor's whole state
    # (load_state_dict), generator included, so replicas of any seed explored with the donor's draws.
    pol = load_preset("thompson")  # draws from its generator at every round

    def run(seed: int, state: dict[str, Any] | None) -> Replayer:
        r = Replayer(
            trace=small, profile=PROFILE, engine=ENGINES["composite"], policy=pol, concurrency=4, seed=seed,
            loop_state=state,
        )  # fmt: skip
        r.run()
        return r

    donor = run(0, None).final_state
    assert donor is not None
    warm = [run(s, donor).final_state for s in (1, 2, 1)]
    assert all(w is not None for w in warm)
    rng = [w["rng"] for w in warm if w is not None]
    assert rng[0] != rng[1]  # each seed its own draws
    assert rng[0] == rng[2]  # and the same seed the same ones
