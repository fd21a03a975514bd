"""sim compare's headline baseline: the best static arm the run's engine model can play (as the README)."""

from __future__ import annotations

import pytest

from sim.cli import resolve_policy
from sim.compare import Comparison, best_static_among, run_comparison
from sim.costmodel import load_profile
from sim.engines import ENGINES
from sim.oracle import static_arms
from sim.prices import load_prices
from sim.report import markdown
from sim.traffic import generate


@pytest.fixture(scope="module")
def drift() -> Comparison:
    # drift carries P-EAGLE, which the oracles' best static arm may pick but no engine below can play.
    trace = generate("drift", n_requests=40, seed=3)
    return run_comparison(
        trace,
        load_profile("llama-3.1-8b-h100"),
        load_prices(),
        policies=[resolve_policy("default"), resolve_policy("static:eagle3:3")],
        concurrency=(1, 8),
    )


def test_baseline_ranges_over_the_engines_arms_only(drift: Comparison) -> None:
    seen = set()
    for e in drift.entries:
        for c, run in e.runs.items():
            block = drift.block(run, c)
            if e.engine not in ENGINES:  # the oracles' own rows have no engine model
                assert "best_static_of_engine" not in block
                continue
            seen.add(e.engine)
            playable = {str(a) for a in ENGINES[e.engine].arms(drift.trace.max_k)}
            candidates = {a: r.throughput for a, r in drift.oracles[c].static.items() if a in playable}
            best = block["best_static_of_engine"]
            assert best["arm"] in playable
            assert best["throughput_tok_s"] == pytest.approx(max(candidates.values()), abs=1e-3)
            assert best["ratio"] == pytest.approx(run.throughput / max(candidates.values()), rel=1e-3)
            # A narrower set of arms never gives a higher baseline than the oracles' best static arm.
            assert best["ratio"] >= block["oracle"]["by_kind"]["best_static"]["ratio"] - 1e-4
    assert {"composite", "stock-vllm"} <= seen


def test_report_states_the_baseline_in_its_header(drift: Comparison) -> None:
    md = markdown(drift)
    assert "best single static arm *that run's engine model can play*" in md
    row = next(line for line in md.splitlines() if line.startswith("| default @ composite |"))
    best = drift.block(next(e for e in drift.entries if e.label == "default @ composite").runs[1], 1)
    cell = row.split("|")[3].strip()
    assert cell == f"{best['best_static_of_engine']['ratio']:.3f} ({best['best_static_of_engine']['arm']})"
    # The report says what each engine's host adds: scheduling, and the plugin in its mode.
    host = next(line for line in md.splitlines() if line.startswith("- Host time per step:"))
    k_table = drift.profile.plugin_k_table
    assert f"`stock-vllm-p-eagle` {k_table.at(8.0) * 1e3:.2f} / {k_table.at(32.0) * 1e3:.2f} ms" in host
    assert "but `composite-sync`, which pays" in host


def test_best_static_among_skips_arms_that_did_not_run(drift: Comparison) -> None:
    static = drift.oracles[1].static
    arms = static_arms(drift.trace)
    assert best_static_among({}, arms) is None
    label, run = best_static_among(static, arms)  # type: ignore[misc]
    assert run.throughput == max(r.throughput for r in static.values())
    assert label == drift.oracles[1].best_static[0]


def test_a_static_arm_with_a_per_request_rule_runs_driven_on_the_engines_asked_for() -> None:
    # A static arm with a rule is the plugin drafting n-gram where it proposes: it must run stepwise
    # on the engine the user names and pay the plugin, not be replayed as the plain static arm.
    from policies.spec import parse_policy

    ruled = parse_policy(
        "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: ruled}\nspec:\n"
        "  algorithm: {name: static, params: {arm: 'eagle3:3'}}\n  rule: {kind: ngram_span}\n",
        source="<test>",
    )
    trace = generate("code-edit", n_requests=12, seed=1)
    cmp = run_comparison(
        trace,
        load_profile("llama-3.1-8b-h100"),
        load_prices(),
        policies=[ruled, resolve_policy("static:eagle3:3")],
        engines=(ENGINES["composite"],),
        concurrency=(1,),
        baselines=None,
    )
    by_policy = {e.policy: e for e in cmp.entries if e.kind == "policy"}
    assert by_policy["ruled"].engine == "composite"
    assert by_policy["static-eagle3-3"].engine == "stock-vllm"
    ruled_run, plain_run = by_policy["ruled"].runs[1], by_policy["static-eagle3-3"].runs[1]
    # code-edit is copy-heavy: drafting n-gram where it proposes accepts more per step
    assert ruled_run.accepted / ruled_run.request_steps > plain_run.accepted / plain_run.request_steps
