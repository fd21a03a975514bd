from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from policies.arms import Method
from policies.spec import parse_policy, static_policy
from sim.compare import run_one
from sim.costmodel import load_profile
from sim.engines import ENGINES
from sim.oracle import compute_oracles, latent_oracle, per_step_oracle, static_arms
from sim.trace import Trace, read_trace
from sim.traffic import generate, generate_with_latent

PROFILE = load_profile("llama-3.1-8b-h100")
LIB = Path(__file__).resolve().parents[2] / "policies" / "library"


@pytest.fixture(scope="module")
def drift() -> Trace:
    return generate("drift", n_requests=14, seed=5)


@pytest.mark.parametrize("c", [1, 4])
def test_no_policy_beats_the_oracle(drift: Trace, c: int) -> None:
    o = compute_oracles(drift, PROFILE, c)
    best = o.throughput
    assert best >= max(r.throughput for r in o.static.values())
    for name in ("default", "epsilon-greedy"):
        pol = parse_policy((LIB / f"{name}.yaml").read_text(), source=name)
        for eng in ("stock-vllm", "composite"):
            r = run_one(drift, PROFILE, pol, ENGINES[eng], c)
            assert r.throughput <= best, (name, eng, r.throughput, best)
    for arm in static_arms(drift):
        r = run_one(drift, PROFILE, static_policy(arm), ENGINES["composite"], c)
        assert r.throughput <= best


def test_per_step_oracle_on_a_hand_made_trace(hand_trace: Path) -> None:
    """Knowing the future, request a (eagle3 acc [2,0,3,0,0,0]) drafts only 1 at t0 to land on t2, where
    3 would be accepted and 3 remain: 2 steps (a static K needs 3). Request b (acc [5,5,5,5], 3 to go)
    drafts 2 at t0: 1 step."""
    t = read_trace(hand_trace)
    r = per_step_oracle(t, PROFILE, 1)
    assert r.request_steps == 3
    assert r.accepted == 1 + 2 + 2
    assert r.drafted == r.accepted  # it drafts exactly what will be accepted


def test_static_arms_cover_every_method(drift: Trace) -> None:
    arms = {str(a) for a in static_arms(drift)}
    assert {"eagle3:1", "eagle3:8", "ngram:1", "ngram:8", "p_eagle:8", "off"} <= arms
    # Every P-EAGLE depth (the plugin's depth fix; a static deployment at K is aligned anyway).
    assert {f"p_eagle:{k}" for k in range(1, 9)} <= arms


def test_per_step_oracle_limited_to_an_engines_drafters(drift: Trace) -> None:
    """The composite drafter hosts EAGLE-3 and n-gram: its oracle may not draft with P-EAGLE."""
    composite = (Method.EAGLE3, Method.NGRAM)
    limited = per_step_oracle(drift, PROFILE, 4, methods=composite)
    only = dataclasses.replace(drift, methods=composite, acc={m: drift.acc[m] for m in composite})
    assert limited.throughput == per_step_oracle(only, PROFILE, 4).throughput
    assert limited.throughput < per_step_oracle(drift, PROFILE, 4).throughput  # P-EAGLE accepts more
    eagle_only = per_step_oracle(drift, PROFILE, 4, methods=(Method.EAGLE3,))
    assert eagle_only.throughput < limited.throughput  # n-gram's copy spans are worth something


def test_per_step_oracle_refuses_a_drafter_the_trace_did_not_score(drift: Trace) -> None:
    only = dataclasses.replace(drift, methods=(Method.EAGLE3,), acc={Method.EAGLE3: drift.acc[Method.EAGLE3]})
    with pytest.raises(ValueError, match="no acceptance for ngram"):
        per_step_oracle(only, PROFILE, 1, methods=(Method.EAGLE3, Method.NGRAM))


def test_knowing_the_odds_sits_between_any_fixed_arm_and_knowing_the_draws() -> None:
    """At one request at a time (no batch to share a step), on the composite drafter."""
    trace, latent = generate_with_latent("drift", n_requests=24, seed=7)
    comp, engine = (Method.EAGLE3, Method.NGRAM), ENGINES["composite"]
    odds = latent_oracle(trace, latent, PROFILE, 1, methods=comp, engine=engine).throughput
    draws = per_step_oracle(trace, PROFILE, 1, methods=comp, engine=engine).throughput
    fixed = max(
        run_one(trace, PROFILE, static_policy(a), engine, 1).throughput
        for a in static_arms(trace)
        if a.method in (*comp, Method.OFF)
    )
    assert fixed < odds < draws
    one_k = latent_oracle(trace, latent, PROFILE, 1, methods=comp, engine=engine, eagle_k=3)
    assert one_k.throughput <= odds * 1.01  # a narrower choice (up to the step pricing's rounding)
    late = latent_oracle(trace, latent, PROFILE, 1, methods=comp, engine=engine, span_seen_after=1)
    assert fixed < late.throughput < odds  # a copy span seen one position late is worth less


def test_latent_odds_come_from_the_same_draws() -> None:
    a = generate("mixed", n_requests=10, seed=2)
    b, latent = generate_with_latent("mixed", n_requests=10, seed=2)
    for m in a.acc:
        assert (a.acc[m] == b.acc[m]).all()
    assert len(latent.inside) == a.total_output_tokens
    # Inside a copy span n-gram accepts the rest of it; the odds say where the spans are.
    ng = a.acc[Method.NGRAM]
    assert (ng[~latent.inside] <= 1).all() and ng[latent.inside].mean() > 2
