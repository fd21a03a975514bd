"""The demo engine's workload: seeded phases of the simulator's own traffic classes."""

import numpy as np
import pytest

from controller.embedded.workload import MAX_POOL, Phase, Schedule, build_workload, demo_workload
from policies.arms import Method
from sim.costmodel import DEFAULT_PROFILE, load_profile

PROFILE = load_profile(DEFAULT_PROFILE)


def test_same_seed_same_requests_and_different_seed_differs() -> None:
    a, b, c = (
        demo_workload(seed=3, duration_s=4.0),
        demo_workload(seed=3, duration_s=4.0),
        demo_workload(seed=4, duration_s=4.0),
    )
    assert a.trace.ids == b.trace.ids and a.count == b.count
    for m in (Method.EAGLE3, Method.NGRAM):
        np.testing.assert_array_equal(a.trace.acc[m], b.trace.acc[m])
    assert not np.array_equal(a.trace.output_tokens[: c.trace.n], c.trace.output_tokens[: a.trace.n])


def test_phases_draw_their_own_classes_and_pools_cover_the_phase() -> None:
    w = demo_workload(seed=0, duration_s=20.0)
    names = [next(iter(p.mix)) for p in w.schedule.phases]
    assert names == ["chat", "code-edit", "maths", "summarisation"]
    for i, cls in enumerate(names):
        rows = range(w.first[i], w.first[i] + w.count[i])
        assert {w.trace.classes[r] for r in rows} == {cls}
        assert w.count[i] >= 4 * w.schedule.phases[i].concurrency
    # The i-th request of a phase is one row, and a long phase cycles through its pool.
    assert w.index(2, 0) == w.first[2] and w.index(2, w.count[2]) == w.first[2]


def test_long_phases_are_capped_not_generated_without_bound() -> None:
    w = build_workload(Schedule((Phase(3600.0, {"maths": 1.0}, 32),)), profile=PROFILE, seed=0)
    assert w.count == (MAX_POOL,)


def test_schedule_index_and_scaling() -> None:
    s = Schedule((Phase(1.0, {"chat": 1.0}, 1), Phase(3.0, {"maths": 1.0}, 8))).scaled(8.0)
    assert s.duration_s == pytest.approx(8.0) and s.starts() == [0.0, 2.0]
    assert [s.index(t) for t in (0.0, 1.99, 2.0, 7.9, 100.0)] == [0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"duration_s": 0.0, "mix": {"chat": 1.0}, "concurrency": 1}, "duration_s"),
        ({"duration_s": float("nan"), "mix": {"chat": 1.0}, "concurrency": 1}, "duration_s"),
        ({"duration_s": 1.0, "mix": {"chat": 1.0}, "concurrency": 0}, "concurrency"),
        ({"duration_s": 1.0, "mix": {"chat": -1.0}, "concurrency": 1}, "mix"),
        ({"duration_s": 1.0, "mix": {"poetry": 1.0}, "concurrency": 1}, "unknown class 'poetry'"),
    ],
)
def test_bad_phases_are_rejected_with_the_field(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        Phase(**kwargs)


def test_empty_schedule_and_bad_max_k_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least one phase"):
        Schedule(())
    with pytest.raises(ValueError, match="max_k"):
        build_workload(Schedule((Phase(1.0, {"chat": 1.0}, 1),)), profile=PROFILE, max_k=0)


def test_the_workload_carries_the_ngram_proposers_match_of_every_phase() -> None:
    # The plugin's engine knows the proposer's match before drafting; the demo engine must too, or
    # the per-request rule runs blind and the demo understates the composite drafter.
    w = demo_workload(seed=0, duration_s=8.0)
    prop = w.trace.ngram_proposal
    assert prop is not None and len(prop) == int(w.trace.output_tokens.sum())
    assert w.trace.meta["ngram"] == {"min_n": 4, "max_n": 5}
    assert prop.min() >= 0 and prop.max() <= w.max_k
    # Every phase's pool has matches (copy spans) and positions without one.
    for i in range(len(w.schedule.phases)):
        lo, hi = w.trace.offsets[w.first[i]], w.trace.offsets[w.first[i] + w.count[i]]
        assert (prop[lo:hi] > 0).any() and (prop[lo:hi] == 0).any()
    assert w.max_k == 8
