"""The replay and the oracles at scale: memory follows the trace's tokens, not requests x longest.

What must hold: the per-step oracle's dynamic programme holds its values and choices per request at
that request's own length (ragged, as the trace holds its acceptance), so one long request beside many
short ones costs its own tokens; and its plan is the same one the dense form computed (checked by
hand on a small trace, and against the best static arm). No timing thresholds: memory is measured with
``tracemalloc``, which counts numpy's buffers.
"""

from __future__ import annotations

import tracemalloc

import numpy as np

from policies.arms import Method
from sim.costmodel import load_profile
from sim.oracle import ORACLE_ENGINE, per_step_oracle, run_static_arms
from sim.trace import Trace
from sim.traffic import generate

PROFILE = load_profile("llama-3.1-8b-h100")


def _long_beside_short(long: int, short: int, n_short: int) -> Trace:
    outs = np.array([long] + [short] * n_short, dtype=np.int64)
    total = int(outs.sum())
    rng = np.random.default_rng(1)
    return Trace(
        max_k=1,
        methods=(Method.EAGLE3,),
        ids=tuple(f"r{i}" for i in range(len(outs))),
        classes=("chat",) * len(outs),
        prompt_tokens=np.full(len(outs), 64, np.int64),
        output_tokens=outs,
        arrival_s=np.full(len(outs), np.nan),
        acc={Method.EAGLE3: rng.integers(0, 2, total).astype(np.int32)},
    )


def test_the_per_step_oracle_holds_memory_in_the_traces_tokens() -> None:
    # 1,000 requests of 2 tokens beside one of 50,000: the dense form held 1,001 x 50,002 float64 values
    # and as many choices and acceptance counts (over 1 GB); ragged, about 52,000 of each.
    tr = _long_beside_short(50_000, 2, 1_000)
    tracemalloc.start()
    try:
        r = per_step_oracle(tr, PROFILE, 8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert int(r.timeline.emitted.sum()) == tr.total_output_tokens
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB"


def test_the_per_step_oracle_is_never_below_a_static_arm_on_a_generated_trace() -> None:
    tr = generate("drift", n_requests=300, seed=5)
    for c in (1, 32):
        o = per_step_oracle(tr, PROFILE, c)
        assert int(o.timeline.emitted.sum()) == tr.total_output_tokens
        static = run_static_arms(tr, PROFILE, c)
        # The plan is priced at the run's mean context, so it is not a bound by construction; on the
        # generated traffic it beats every static arm (the property the report relies on).
        assert o.throughput > max(s.throughput for s in static.values())


def test_the_per_step_oracle_plan_on_a_hand_made_trace() -> None:
    # One request of 5 tokens, EAGLE-3 only, max_k 1, every draft accepted: from state 1 (one token
    # done) the best plan drafts at every position: 1 -> 3 -> 5, two decode steps.
    tr = Trace(
        max_k=1,
        methods=(Method.EAGLE3,),
        ids=("a",),
        classes=("chat",),
        prompt_tokens=np.array([10], np.int64),
        output_tokens=np.array([5], np.int64),
        arrival_s=np.array([np.nan]),
        acc={Method.EAGLE3: np.ones(5, np.int32)},
    )
    r = per_step_oracle(tr, PROFILE, 1, engine=ORACLE_ENGINE)
    assert (r.steps, r.request_steps, r.drafted, r.accepted) == (3, 2, 2, 2)
