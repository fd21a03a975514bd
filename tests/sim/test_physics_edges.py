"""The simulator's physics at the edges of what validation lets through.

What must hold on every trace and profile the readers accept: every output token of the trace is
emitted exactly once, every request finishes, the virtual clock only moves forward, no step emits more
than its drafts plus one token per request, throughput is finite and positive, the static arms'
vectorised replay agrees with the stepwise one, and the reported oracle is at least every static arm
and every policy. Edges: one request, requests of one token (every request, or some), max_k 1 and 64,
acceptance all 0 and all max_k, concurrency 1, above the request count and 1024, and profiles pushed to
the ends of each field's range.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import yamldoc
from policies.arms import MAX_K, Arm, Method
from policies.presets import load_preset
from policies.spec import static_policy
from sim.costmodel import Profile, _profile_dir, load_profile, parse_profile
from sim.engines import ENGINES, engine_for_arm
from sim.oracle import compute_oracles, per_step_oracle
from sim.replay import Replayer
from sim.run import RunResult, arm_code, arm_of_code
from sim.trace import Trace
from sim.vectorised import replay_static

PROFILES = {
    n: load_profile(n) for n in ("llama-3.1-8b-h100", "llama-3.1-8b-h100-per-draft", "gpt-oss-120b-h100")
}
METHODS = (Method.EAGLE3, Method.NGRAM, Method.P_EAGLE)


def make_trace(outs: list[int], *, max_k: int, acc: str = "rand", prompt: int = 100, seed: int = 0) -> Trace:
    n, total = len(outs), sum(outs)
    rng = np.random.default_rng(seed)
    cols: dict[Method, np.ndarray] = {}
    for m in METHODS:
        if acc == "zero":
            cols[m] = np.zeros(total, np.int32)
        elif acc == "full":
            cols[m] = np.full(total, max_k, np.int32)
        else:
            cols[m] = rng.integers(0, max_k + 1, total).astype(np.int32)
    return Trace(
        max_k=max_k,
        methods=METHODS,
        ids=tuple(f"r{i}" for i in range(n)),
        classes=tuple(("chat", "code", "maths")[i % 3] for i in range(n)),
        prompt_tokens=np.full(n, prompt, np.int64),
        output_tokens=np.asarray(outs, np.int64),
        arrival_s=np.full(n, np.nan),
        acc=cols,
    )


def check_run(r: RunResult, trace: Trace, concurrency: int) -> None:
    """The invariants every replay keeps, whatever the policy, engine or profile."""
    tl = r.timeline
    assert int(tl.emitted.sum()) == trace.total_output_tokens  # tokens out = tokens in the trace
    assert np.all(np.isfinite(r.finish_s)) and np.all(r.finish_s > 0)  # every request finishes
    assert np.all(r.finish_s >= r.first_token_s) and np.all(r.first_token_s > r.submit_s)
    assert np.all(np.diff(tl.end_s) > 0) and tl.end_s[0] > 0  # the clock only moves forward
    # No step emits more than its drafts plus one token per request in it.
    assert np.all(tl.emitted <= tl.drafted + min(concurrency, trace.n))
    assert np.all(tl.accepted <= tl.drafted)
    assert math.isfinite(r.throughput) and r.throughput > 0


# -- arm codes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [Method.EAGLE3, Method.P_EAGLE, Method.NGRAM])
def test_every_arm_code_reads_back_as_its_arm_up_to_max_k(method: Method) -> None:
    # At a base of 64, ngram:64 read back as 'off' and eagle3:64 raised (p_eagle:0 is no arm).
    ks = np.arange(1, MAX_K + 1)
    codes = arm_code(np.full(len(ks), list(Method).index(method)), ks)
    assert [arm_of_code(int(c)) for c in codes] == [Arm(method, int(k)) for k in ks]
    assert arm_of_code(int(arm_code(np.array([list(Method).index(Method.OFF)]), np.array([0]))[0])) == Arm(
        Method.OFF, 0
    )


def test_a_policy_drafting_ngram_at_max_k_64_is_reported_as_ngram() -> None:
    from sim.compare import arm_share

    tr = make_trace([200] * 8, max_k=64, acc="full")
    r = Replayer(
        trace=tr, profile=PROFILES["llama-3.1-8b-h100"], engine=ENGINES["composite"],
        policy=load_preset("default"), concurrency=4,
    ).run()  # fmt: skip
    played = {str(arm_of_code(int(c))) for c in r.timeline.arm[r.timeline.arm >= 0]}
    assert "ngram:64" in played and "off" not in played
    assert "off" not in arm_share(r)


# -- one-token requests ---------------------------------------------------------------------------


@pytest.mark.parametrize("arm", ["eagle3:3", "ngram:2", "p_eagle:4", "off"])
@pytest.mark.parametrize("c", [1, 2, 5])
def test_a_trace_of_one_token_requests_replays_without_decode_steps(arm: str, c: int) -> None:
    # Every request ends with its prefill: no decode row at all. The vectorised replay raised
    # "attempt to get argmax of an empty sequence"; the stepwise one replays it.
    tr = make_trace([1, 1, 1, 1], max_k=4)
    a = Arm.parse(arm)
    p = PROFILES["llama-3.1-8b-h100"]
    v = replay_static(tr, method=a.method, k=a.k, concurrency=c, profile=p, engine=engine_for_arm(a))
    s = Replayer(trace=tr, profile=p, engine=engine_for_arm(a), policy=static_policy(a), concurrency=c).run()
    for r in (v, s):
        check_run(r, tr, c)
        assert r.request_steps == 0 and r.steps == math.ceil(4 / c)
        assert np.all(r.timeline.arm == -1)
    np.testing.assert_allclose(v.finish_s, s.finish_s, rtol=1e-12)


def test_the_oracles_of_a_trace_of_one_token_requests() -> None:
    # The per-class and per-phase oracles combined no rows and raised "need at least one array".
    tr = make_trace([1, 1, 1], max_k=2)
    o = compute_oracles(tr, PROFILES["llama-3.1-8b-h100"], 2)
    assert o.per_class is not None and o.per_phase is not None and o.per_step is not None
    for r in (o.per_class, o.per_phase, o.per_step, *o.static.values()):
        check_run(r, tr, 2)
    assert o.throughput == pytest.approx(o.best_static[1].throughput)


# -- invariants, at random over the edges ---------------------------------------------------------


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    max_k = draw(st.sampled_from([1, 2, 8, MAX_K]))
    outs = draw(st.lists(st.integers(1, 60), min_size=1, max_size=12))
    return make_trace(
        outs,
        max_k=max_k,
        acc=draw(st.sampled_from(["zero", "full", "rand"])),
        prompt=draw(st.sampled_from([0, 1, 4096, 131072])),
        seed=draw(st.integers(0, 1000)),
    )


_SLOW = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@_SLOW
@given(
    trace=traces(),
    arm=st.sampled_from(["eagle3:1", "eagle3:8", "ngram:3", "p_eagle:1", "p_eagle:8", "off"]),
    c=st.sampled_from([1, 2, 5, 1024]),
    profile=st.sampled_from(sorted(PROFILES)),
)
def test_static_arms_agree_between_vectorised_and_stepwise_and_stay_below_the_oracle(
    trace: Trace, arm: str, c: int, profile: str
) -> None:
    p = PROFILES[profile]
    a = Arm.parse(arm)
    eng = engine_for_arm(a)
    v = replay_static(trace, method=a.method, k=min(a.k, trace.max_k), concurrency=c, profile=p, engine=eng)
    s = Replayer(trace=trace, profile=p, engine=eng, policy=static_policy(a), concurrency=c).run()
    # Stated tolerance: the same arithmetic summed in a different order (cumsum vs a running clock).
    assert (s.steps, s.request_steps, s.drafted, s.accepted) == (
        v.steps,
        v.request_steps,
        v.drafted,
        v.accepted,
    )
    np.testing.assert_allclose(s.timeline.end_s, v.timeline.end_s, rtol=1e-12)
    np.testing.assert_allclose(s.finish_s, v.finish_s, rtol=1e-12)
    np.testing.assert_array_equal(s.timeline.emitted, v.timeline.emitted)
    check_run(v, trace, c)
    check_run(s, trace, c)
    assert compute_oracles(trace, p, c).throughput >= v.throughput * (1 - 1e-12)


@_SLOW
@given(
    trace=traces(),
    policy=st.sampled_from(["default", "epsilon-greedy", "thompson", "ucbspec"]),
    engine=st.sampled_from(sorted(ENGINES)),
    c=st.sampled_from([1, 3, 1024]),
    profile=st.sampled_from(sorted(PROFILES)),
)
def test_every_policy_keeps_the_invariants_and_stays_below_the_oracle(
    trace: Trace, policy: str, engine: str, c: int, profile: str
) -> None:
    p = PROFILES[profile]
    r = Replayer(
        trace=trace, profile=p, engine=ENGINES[engine], policy=load_preset(policy), concurrency=c
    ).run()
    check_run(r, trace, c)
    o = compute_oracles(trace, p, c)
    # Up to the drain: the per-step oracle prices each row at the full batch, so where the run's last
    # requests run alone a policy can play those steps better (sim/oracle.py); by at most their share.
    drain = max(_drain_share(r), _drain_share(o.per_step)) if o.per_step is not None else 0.0
    assert o.throughput >= r.throughput * (1 - drain) * (1 - 1e-9)


def _drain_share(r: RunResult) -> float:
    """The share of a closed-loop run's time after its batch first shrinks for good: from the first
    request to finish after the last one was admitted (0 when every request ends in the last step)."""
    end = float(r.finish_s.max())
    after = r.finish_s[r.finish_s > r.submit_s.max()]
    return (end - float(after.min())) / end if end > 0 else 0.0


def test_the_oracle_is_passed_only_in_the_drain() -> None:
    """The known case (the test above failed on it): two requests at full acceptance, Thompson on the
    n-gram engine, passes the reported oracle by 0.24 %, less than the drain's share (a step alone)."""
    trace = make_trace([25, 26], max_k=2, acc="full", prompt=0)
    p = PROFILES["gpt-oss-120b-h100"]
    r = Replayer(
        trace=trace,
        profile=p,
        engine=ENGINES["stock-vllm-ngram"],
        policy=load_preset("thompson"),
        concurrency=3,
    ).run()
    o = compute_oracles(trace, p, 3)
    assert o.per_step is not None
    assert r.throughput < o.throughput / (1 - max(_drain_share(r), _drain_share(o.per_step)))


# -- profiles at the ends of their ranges ---------------------------------------------------------


def _profile(**edits: Any) -> Profile:
    text = (_profile_dir() / "llama-3.1-8b-h100.yaml").read_text(encoding="utf-8")
    data, _ = yamldoc.load(text, max_depth=12, max_nodes=100_000)
    data = copy.deepcopy(data)
    for path, v in edits.items():
        cur = data
        *parents, last = path.split("__")
        for part in parents:
            cur = cur.setdefault(part, {})
        cur[last] = v
    return parse_profile(data, source="edge.yaml")


EDGE_PROFILES = {
    # 1 us a step of one request, 50 ns more per request (policies.physics: the floors the sidecar holds)
    "fastest step": dict(
        target__const_s=1e-9, target__kv_s_per_token=0.0, target__batched_s_per_token=5e-8, overhead_s=1e-6
    ),
    "an hour a step": dict(target__const_s=3000.0, overhead_s=0.0),
    "draft dearer than the target": dict(
        draft__eagle3__const_s=3600.0, draft__eagle3__kv_s_per_token=1.0, draft__eagle3__spec_s_per_token=1.0
    ),
    "free drafts": dict(
        draft__eagle3__const_s=0.0,
        draft__eagle3__kv_s_per_token=0.0,
        draft__eagle3__spec_s_per_token=0.0,
        draft__p_eagle__pass_forwards=0.0,
    ),
    "fit at K 64": dict(draft__eagle3__fit_k=64),
    "per draft, fit at 1": dict(draft__eagle3__fit_k=1, draft__eagle3__cost="per_draft"),
    "no sync time": dict(scheduling__sync_step_s=0.0),
    "an hour of sync time": dict(scheduling__sync_step_s=3600.0),
    "a second per KV token": dict(target__kv_s_per_token=1.0),
    "a second per batched token": dict(target__batched_s_per_token=1.0),
    "n-gram as dear as verifying": dict(draft__ngram__verify_fraction=1.0),
    "widest P-EAGLE pass": dict(draft__p_eagle__pass_forwards=64.0, draft__p_eagle__slot_s=3600.0),
    "an hour of plugin": dict(plugin={"step_s": 3600.0, "per_request_s": 3600.0}),
    "every expert per token": dict(
        moe={
            "expert_bytes_per_gpu": 1e15,
            "num_experts": 65536,
            "experts_per_token": 65536,
            "bandwidth_bytes_per_s": 1e18,
            "efficiency": 1.0,
        }
    ),
}


@pytest.mark.parametrize("name", sorted(EDGE_PROFILES))
def test_profiles_at_the_edges_of_validation_give_physical_results(name: str) -> None:
    p = _profile(**EDGE_PROFILES[name])
    tr = make_trace([1, 7, 30, 2, 16], max_k=8)
    for eng in ENGINES.values():
        for pol in ("default", "static-eagle3-3"):
            for c in (1, 4, 1024):
                check_run(
                    Replayer(trace=tr, profile=p, engine=eng, policy=load_preset(pol), concurrency=c).run(),
                    tr,
                    c,
                )
    o = compute_oracles(tr, p, 4)
    for r in (*o.static.values(), o.per_class, o.per_phase, o.per_step):
        assert r is not None
        check_run(r, tr, 4)


def test_a_128k_token_request_replays_whole() -> None:
    tr = make_trace([131072], max_k=8, prompt=131072)
    p = PROFILES["llama-3.1-8b-h100"]
    for arm in ("eagle3:8", "off"):
        a = Arm.parse(arm)
        r = replay_static(tr, method=a.method, k=a.k, concurrency=1, profile=p, engine=engine_for_arm(a))
        check_run(r, tr, 1)
    check_run(per_step_oracle(tr, p, 1, methods=(Method.EAGLE3,)), tr, 1)
