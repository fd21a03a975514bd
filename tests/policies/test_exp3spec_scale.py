"""EXP3Spec's reward scale forgets: a round's goodput is scaled by the largest of the context's last
``SCALE_ROUNDS`` rounds, not of all time, so one outlier round (a step of a tiny but valid duration, a
traffic phase much faster than the rest) stops mattering after ``SCALE_ROUNDS`` rounds instead of
leaving every later scaled reward ~0 and the learner unable to tell arms apart for good. The window is
saved (``tops``; ``top`` their largest, for versions before it), snapshots of those versions (``top``
only) still load, and a saved window of the wrong shape or range is refused naming the field, with
nothing of the learner changed."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.algorithms import REGISTRY, Learner
from policies.algorithms.base import MAX_REWARD
from policies.algorithms.exp3spec import SCALE_ROUNDS
from policies.arms import Arm
from policies.context import Context
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.presets import preset_text
from policies.spec import parse_policy

ARMS = (Arm.parse("eagle3:3"), Arm.parse("ngram:4"))
#: Arm 1 is clearly the better: 25 % more goodput, noise well under the gap.
MEANS, NOISE = (800.0, 1000.0), 50.0
CTX = Context.parse("1/*")
#: The largest goodput an engine can report (2^20 requests emitting 65 tokens each in a microsecond).
MAX_GOODPUT = 7e13


def exp3(seed: int = 0, arms: tuple[Arm, ...] = ARMS) -> Learner:
    """The learner the exp3spec preset runs, built as the loop builds it: its spec's algorithm from the
    registry with the spec's params."""
    spec = parse_policy(preset_text("exp3spec"))
    return REGISTRY[spec.algorithm](arms=arms, params=spec.params, rng=np.random.default_rng(seed))


def play(lr: Learner, seed: int, rounds: int, outlier_at: int, factor: float = 1e6) -> np.ndarray:
    """Seeded rounds of the two arms; the round ``outlier_at`` reports a goodput ``factor`` times its own."""
    rng = np.random.default_rng(seed + 10_000)
    picks = np.empty(rounds, dtype=int)
    for r in range(rounds):
        i = lr.select(CTX, [0, 1])
        picks[r] = i
        g = float(rng.normal(MEANS[i], NOISE))
        lr.update(CTX, {i: g * factor if r == outlier_at else g})
    return picks


def _json(x: Any) -> Any:
    return json.loads(json.dumps(x, allow_nan=False))


# -- the outlier is forgotten -----------------------------------------------------------------------


@pytest.mark.parametrize("outlier_at", [0, 20, 500])
@pytest.mark.parametrize("seed", range(6))
def test_one_outlier_round_does_not_stop_the_learner_telling_the_arms_apart(
    seed: int, outlier_at: int
) -> None:
    # The scale was the largest round goodput ever seen: after one round 1e6 times the rest every
    # scaled reward was ~1e-6, every arm's loss ~1 / p, and the picks a coin toss (0.4 to 0.7 of them
    # the better arm over the last 1500 rounds, whatever the seed).
    picks = play(exp3(seed), seed, 3000, outlier_at)
    assert (picks[1500:] == 1).mean() >= 0.9


def test_after_the_window_a_round_at_the_recent_best_scores_no_loss() -> None:
    # With the outlier still the scale, a round at the recent best goodput scored r ~ 1e-6: loss ~1 / p.
    lr = exp3()
    lr.select(CTX, [0, 1])
    lr.update(CTX, {0: 1e9})
    for _ in range(SCALE_ROUNDS):
        lr.select(CTX, [0, 1])
        lr.update(CTX, {0: 900.0, 1: 1000.0})
    before = lr.state_dict()["loss"][CTX.key]
    lr.select(CTX, [0, 1])
    lr.update(CTX, {1: 1000.0})
    after = lr.state_dict()["loss"][CTX.key]
    assert after == before  # 1 - 1000 / 1000 = 0 added
    assert lr.state_dict()["top"][CTX.key] == 1000.0


ROUND = st.dictionaries(
    st.integers(0, 1),
    st.floats(0.0, MAX_GOODPUT, allow_nan=False) | st.sampled_from([0.0, 5e-324, MAX_GOODPUT]),
    max_size=2,
)


@settings(max_examples=60, deadline=None)
@given(
    before=st.lists(ROUND, max_size=2 * SCALE_ROUNDS),
    outlier=st.sampled_from([1e6, 1e9, MAX_GOODPUT]),
    after=st.lists(
        st.dictionaries(st.integers(0, 1), st.floats(0.0, 1e4), min_size=1, max_size=2), min_size=1
    ),
    empty_every=st.integers(2, 7),
)
def test_the_scale_is_the_largest_goodput_of_the_last_window_of_rounds(
    before: list[dict[int, float]], outlier: float, after: list[dict[int, float]], empty_every: int
) -> None:
    # Rounds without rewards (no arm ran in the context) neither enter the window nor push one out.
    lr = exp3()
    rounds = [*before, {0: outlier}, *after]
    rounds += [{1: 500.0 + (j % 3)} for j in range(SCALE_ROUNDS)]
    seen: list[float] = []
    for j, rewards in enumerate(rounds):
        lr.select(CTX, [0, 1])
        lr.update(CTX, rewards)
        if j % empty_every == 0:
            lr.select(CTX, [0, 1])
            lr.update(CTX, {})
        if rewards:
            seen.append(max(rewards.values()))
        state = lr.state_dict()
        window = seen[-SCALE_ROUNDS:]
        # A context no reward reached yet has no window: its scale is 0, as "top" was.
        assert state["tops"].get(CTX.key, []) == window
        assert state["top"].get(CTX.key, 0.0) == max(window, default=0.0)
    assert state["top"][CTX.key] == 502.0  # the outlier long gone
    assert all(math.isfinite(x) and x >= 0 for x in state["loss"][CTX.key])


# -- the window is saved ----------------------------------------------------------------------------


def reloaded(a: Learner, state: Any = None) -> Learner:
    b = exp3(1)
    b.load_state_dict(_json(a.state_dict() if state is None else state))
    return b


def test_the_window_round_trips_through_a_snapshot_and_the_learner_goes_on_the_same() -> None:
    a = exp3()
    play(a, 0, 150, outlier_at=30)
    b = reloaded(a)
    assert _json(b.state_dict()) == _json(a.state_dict())
    assert len(a.state_dict()["tops"][CTX.key]) == SCALE_ROUNDS
    for x in (a, b):
        x.select(CTX, [0, 1])
    for x in (a, b):
        x.update(CTX, {0: 820.0})
    assert _json(b.state_dict()) == _json(a.state_dict())


def test_a_snapshot_of_the_version_before_the_window_loads_and_its_top_is_forgotten() -> None:
    # Those versions saved only "top", the largest goodput ever seen (here an outlier): it starts the
    # window, and SCALE_ROUNDS rounds later it is gone.
    a = exp3()
    play(a, 0, 40, outlier_at=-1)
    state = _json(a.state_dict())
    del state["tops"]
    state["top"][CTX.key] = 5e9
    b = reloaded(a, state)
    assert b.state_dict()["tops"] == {CTX.key: [5e9]}
    assert b.state_dict()["top"] == {CTX.key: 5e9}
    assert _json(b.state_dict()) == {**state, "tops": {CTX.key: [5e9]}}
    for _ in range(SCALE_ROUNDS):
        b.select(CTX, [0, 1])
        b.update(CTX, {1: 1000.0})
    assert b.state_dict()["top"] == {CTX.key: 1000.0}


def test_where_the_window_is_saved_top_is_checked_but_not_read() -> None:
    a = exp3()
    play(a, 0, 10, outlier_at=-1)
    state = _json(a.state_dict())
    window = state["tops"][CTX.key]
    state["top"][CTX.key] = 1e12
    assert reloaded(a, state).state_dict()["tops"][CTX.key] == window
    assert reloaded(a, state).state_dict()["top"][CTX.key] == max(window)


def _saved_window(**edits: Any) -> dict[str, Any]:
    a = exp3()
    play(a, 0, 30, outlier_at=-1)
    state: dict[str, Any] = _json(a.state_dict())
    state["tops"] = {**state.get("tops", {}), **edits}
    return state


BAD_WINDOWS = {
    "a-number": (
        lambda: _saved_window(**{CTX.key: 900.0}),
        "tops['1/*']: expected a list of numbers of shape (n)",
    ),
    "nested": (
        lambda: _saved_window(**{CTX.key: [[900.0]]}),
        "tops['1/*']: expected a list of numbers of shape (n)",
    ),
    "a-string-in-it": (
        lambda: _saved_window(**{CTX.key: ["900"]}),
        "tops['1/*']: expected a list of numbers",
    ),
    "a-bool-in-it": (
        lambda: _saved_window(**{CTX.key: [900.0, True]}),
        "tops['1/*']: expected a list of numbers",
    ),
    "nan": (lambda: _saved_window(**{CTX.key: [900.0, math.nan]}), "tops['1/*']: every value must be finite"),
    "infinite": (lambda: _saved_window(**{CTX.key: [math.inf]}), "tops['1/*']: every value must be finite"),
    "negative": (
        lambda: _saved_window(**{CTX.key: [900.0, -1.0]}),
        "tops['1/*']: every value must be finite and in [0, 1e+18]",
    ),
    "beyond-any-reward": (
        lambda: _saved_window(**{CTX.key: [1e300]}),
        "tops['1/*']: every value must be finite",
    ),
    "beyond-a-double": (lambda: _saved_window(**{CTX.key: [10**400]}), "tops['1/*']: holds a number beyond"),
    "longer-than-the-window": (
        lambda: _saved_window(**{CTX.key: [900.0] * (SCALE_ROUNDS + 1)}),
        f"tops['1/*']: at most {SCALE_ROUNDS} rounds' goodputs expected, got {SCALE_ROUNDS + 1}",
    ),
    "not-a-context": (lambda: _saved_window(**{"nope": [900.0]}), "tops['nope']: "),
    "a-list": (
        lambda: {**_saved_window(), "tops": [[900.0]]},
        "tops: a mapping of context to goodputs expected, got list",
    ),
}


@pytest.mark.parametrize(("state", "says"), list(BAD_WINDOWS.values()), ids=list(BAD_WINDOWS))
def test_a_saved_window_of_the_wrong_shape_is_named_and_nothing_is_taken(
    state: Callable[[], Any], says: str
) -> None:
    target = exp3(1)
    play(target, 1, 12, outlier_at=-1)
    before = json.dumps(target.state_dict(), sort_keys=True)
    with pytest.raises(ValueError) as err:
        target.load_state_dict(state())
    assert str(err.value).startswith(says), str(err.value)
    assert json.dumps(target.state_dict(), sort_keys=True) == before


def test_a_window_at_the_limits_loads() -> None:
    state = _saved_window(**{CTX.key: [0.0, MAX_REWARD] + [1.0] * (SCALE_ROUNDS - 2), "2-4/chat": []})
    b = exp3(1)
    b.load_state_dict(state)
    assert b.state_dict()["tops"][CTX.key][:2] == [0.0, MAX_REWARD]
    assert b.state_dict()["top"]["2-4/chat"] == 0.0
    b.select(CTX, [0, 1])
    b.update(CTX, {0: 800.0})
    json.dumps(b.state_dict(), allow_nan=False)


def test_through_the_loop_a_bad_window_is_named_under_the_learner() -> None:
    arms = (*ARMS, Arm.parse("off"))
    engine = EngineInfo("e1", "m", 4, arms, Granularity.REQUEST_METHOD)
    loop = ControlLoop(spec=parse_policy(preset_text("exp3spec")), engine=engine, seed=0)
    state = _json(loop.state_dict())
    state["learner"]["tops"] = {CTX.key: [-3.0]}
    with pytest.raises(ValueError, match=r"^loop state\.learner: tops\['1/\*'\]: every value must be"):
        ControlLoop(spec=parse_policy(preset_text("exp3spec")), engine=engine, seed=0).load_state_dict(state)
