"""The stepping kernel: what one step does (plan, clamp, accept, price), checked by hand and against the
vectorised accelerator on realistic traces, for every engine model that can play the plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arms import METHOD_CODES, Arm, Method
from policies.directive import Directive, PlanEntry
from policies.engine_rules import safe_default_directive
from sim.costmodel import load_profile
from sim.engines import ENGINES, EngineModel, engine_for_arm
from sim.kernel import StepKernel
from sim.trace import Trace, read_trace
from sim.traffic import generate
from sim.vectorised import replay_static

PROFILE = load_profile("llama-3.1-8b-h100")


def _run_static(trace: Trace, arm: Arm, c: int, engine_name: str | None = None) -> tuple[list[float], int]:
    """Closed loop at concurrency ``c`` in trace order through the kernel; step times and accepted."""
    eng = ENGINES[engine_name] if engine_name else engine_for_arm(arm)
    k = StepKernel(trace=trace, profile=PROFILE, engine=eng)
    d = safe_default_directive(arm, max_k=trace.max_k)
    nxt, finished, accepted = 0, 0, 0
    times: list[float] = []
    while finished < trace.n:
        take = min(c - k.running, trace.n - nxt)
        s = k.step(d, np.arange(nxt, nxt + take, dtype=np.int64))
        nxt += take
        finished += len(s.finished)
        accepted += int(s.accepted.sum())
        times.append(s.duration_s)
    return times, accepted


@pytest.mark.parametrize("arm", ["eagle3:1", "eagle3:3", "ngram:4", "p_eagle:8", "off"])
@pytest.mark.parametrize("c", [1, 8, 32])
def test_vectorised_accelerator_equals_the_kernel(arm: str, c: int) -> None:
    tr = generate("drift", n_requests=200, seed=5)
    a = Arm.parse(arm)
    times, accepted = _run_static(tr, a, c)
    v = replay_static(tr, method=a.method, k=a.k, concurrency=c, profile=PROFILE, engine=engine_for_arm(a))
    assert len(times) == v.steps and accepted == v.accepted
    np.testing.assert_allclose(np.cumsum(times), v.timeline.end_s, rtol=1e-12)


@pytest.mark.parametrize("arm", ["eagle3:2", "ngram:3", "off"])
def test_vectorised_equals_the_kernel_on_the_composite_drafter(arm: str) -> None:
    tr = generate("code-edit", n_requests=120, seed=2, methods=(Method.EAGLE3, Method.NGRAM))
    a = Arm.parse(arm)
    times, accepted = _run_static(tr, a, 8, "composite")
    v = replay_static(tr, method=a.method, k=a.k, concurrency=8, profile=PROFILE, engine=ENGINES["composite"])
    assert len(times) == v.steps and accepted == v.accepted
    np.testing.assert_allclose(np.cumsum(times), v.timeline.end_s, rtol=1e-12)


def test_hand_made_step(hand_trace: Path) -> None:
    tr = read_trace(hand_trace)
    k = StepKernel(trace=tr, profile=PROFILE, engine=ENGINES["composite"])
    d = safe_default_directive(Arm(Method.EAGLE3, 4), max_k=tr.max_k)
    first = k.step(d, np.arange(tr.n, dtype=np.int64))
    assert len(first.requests) == 0 and first.tokens == tr.n and k.running == tr.n
    s = k.step(d)
    # Both decode at position 0: accepted min(acc[0], K), emitted capped at what remains.
    acc0 = tr.acc[Method.EAGLE3][tr.offsets[:-1]]
    remaining = tr.output_tokens - 1
    np.testing.assert_array_equal(s.accepted, np.minimum(np.minimum(acc0, 4) + 1, remaining) - 1)
    assert s.duration_s == PROFILE.step_time(
        kv=float((tr.prompt_tokens + 1).sum()),
        batched=float(4 * tr.n + tr.n),
        eagle_forwards=4.0,
        eagle_spec=float(4 * tr.n),
        p_eagle_passes=0.0,
        p_eagle_spec=0.0,
        ngram_rows=0.0,
    )


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from([Method.EAGLE3, Method.P_EAGLE, Method.NGRAM, Method.OFF]),
    k=st.integers(1, 40),
    engine=st.sampled_from(["composite", "per-request-k", "stock-vllm"]),
)
def test_every_row_is_playable_and_k_zero_means_off(method: Method, k: int, engine: str) -> None:
    tr = generate("chat", n_requests=12, seed=1)
    eng = ENGINES[engine]
    kern = StepKernel(trace=tr, profile=PROFILE, engine=eng)
    arm = Arm(method, k) if method is not Method.OFF else Arm(Method.OFF, 0)
    d = safe_default_directive(arm, max_k=64)
    kern.step(d, np.arange(12, dtype=np.int64))
    s = kern.step(d)
    codes = {METHOD_CODES[m] for m in eng.methods} | {METHOD_CODES[Method.OFF]}
    assert set(s.method.tolist()) <= codes
    assert (s.k <= tr.max_k).all()
    off = s.method == METHOD_CODES[Method.OFF]
    assert ((s.k == 0) == off).all()
    assert (s.accepted <= s.k).all() and (s.accepted >= 0).all()


def test_the_composite_engine_keeps_drafts_within_the_placeholders_and_prices_eagle_at_its_rows_k() -> None:
    # Under async scheduling vLLM gives each request the table's placeholders and the plugin can only
    # shorten them: a draft is cut to that width, which is max_k where the span rule drafts n-gram
    # (Directive.width_for_batch) and the table's K otherwise. The plugin's worker runs EAGLE-3 at
    # the longest K of the rows drafting it, for every row (synchronous scheduling: see
    # test_synchronous_scheduling_runs_eagle_at_the_k_guessed_before_the_step).
    from dataclasses import replace

    from policies.rules import validate_rule

    tr = generate("code-edit", n_requests=16, seed=2, methods=(Method.EAGLE3, Method.NGRAM))
    base = safe_default_directive(Arm(Method.EAGLE3, 2), max_k=tr.max_k)
    span = replace(base, rule=validate_rule("ngram_span", {}))
    # A plan drafting n-gram at 6 under a table of 2 (no policy of ours issues one: the table covers
    # the plan): the engine cuts those drafts to 2.
    wide_plan = replace(base, plan=(PlanEntry("*", 1, 0, Arm(Method.NGRAM, 6)),))
    assert ENGINES["composite"].table_cap and ENGINES["composite-device"].table_cap

    def longest(d: Directive, engine: EngineModel) -> int:
        kern = StepKernel(trace=tr, profile=PROFILE, engine=engine)
        kern.step(d, np.arange(16, dtype=np.int64))
        ks = []
        while kern.running:
            s = kern.step(d)
            ks.append(int(s.k.max()) if len(s.k) else 0)
        return max(ks)

    uncapped = replace(ENGINES["composite"], table_cap=False)
    assert longest(wide_plan, ENGINES["composite"]) == 2 < longest(wide_plan, uncapped) == 6
    assert longest(span, ENGINES["composite"]) == longest(span, uncapped) > 2  # the rule's room: max_k
    # Priced: one step of 16 rows all planned at K 1 (below the table's 2) pays EAGLE at 1, not 2.
    one = replace(safe_default_directive(Arm(Method.EAGLE3, 1), max_k=tr.max_k), k_table=base.k_table)
    two = safe_default_directive(Arm(Method.EAGLE3, 2), max_k=tr.max_k)
    times = {}
    for name, d in (("one", one), ("two", two)):
        kern = StepKernel(trace=tr, profile=PROFILE, engine=ENGINES["composite"])
        kern.step(d, np.arange(16, dtype=np.int64))
        step = kern.step(d)
        assert set(step.k.tolist()) == {int(name == "two") + 1}
        times[name] = step.duration_s
    assert times["two"] > times["one"]


def test_synchronous_scheduling_runs_eagle_at_the_k_guessed_before_the_step() -> None:
    # composite-sync: the plugin sets the K vLLM's EAGLE-3 proposer runs at before the step, from each
    # request's class arm, leaving out a request whose pending plan is n-gram's
    # (policies.engine_rules.drafter_k_row); a request that then plans EAGLE-3 longer gets what was
    # drafted. Priced at that K for every row, as the async worker's is at its rows' longest.
    from dataclasses import replace

    tr = generate("code-edit", n_requests=16, seed=2, methods=(Method.EAGLE3, Method.NGRAM))
    sync = ENGINES["composite-sync"]
    assert sync.eagle_guessed and not ENGINES["composite"].eagle_guessed
    ngram = replace(safe_default_directive(Arm(Method.NGRAM, 4), max_k=tr.max_k), method=Method.EAGLE3)
    eagle = safe_default_directive(Arm(Method.EAGLE3, 3), max_k=tr.max_k)
    assert ngram.k_for_batch(16, tr.max_k) == 4
    guessed = replace(ENGINES["composite"], eagle_guessed=True)  # the same scheduling, priced apart
    kern, ref = (StepKernel(trace=tr, profile=PROFILE, engine=e) for e in (guessed, ENGINES["composite"]))
    for k in (kern, ref):
        k.step(ngram, np.arange(16, dtype=np.int64))
    for _ in range(3):  # every row on n-gram: EAGLE-3 at 1 (its first forward), as on the async path
        a, b = kern.step(ngram), ref.step(ngram)
        assert set(a.method.tolist()) == {METHOD_CODES[Method.NGRAM]}
        assert a.duration_s == b.duration_s
    after = [kern.step(eagle) for _ in range(2)]  # the class turns to EAGLE-3 at 3
    assert set(after[0].k.tolist()) == {1}  # guessed from the n-gram plans pending: 1 drafted
    assert set(after[1].k.tolist()) == {3}
    assert after[0].duration_s < after[1].duration_s
