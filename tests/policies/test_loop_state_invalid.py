"""ControlLoop.load_state_dict with saved state of the wrong shape: snapshots come from disk and the
fleet's posteriors from the network, so any JSON value may stand anywhere in them. The loader either
takes the state (and the loop then decides and observes as usual) or raises ValueError naming what is
wrong; never another exception (the sidecar catches ValueError and starts that loop afresh)."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arms import Arm
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.presets import preset_text
from policies.spec import parse_policy

ARMS = tuple(Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:4", "ngram:4", "off"))
ENGINE = EngineInfo("e1", "m", 4, ARMS, Granularity.REQUEST_METHOD)
PRESETS = ("default", "ucb1", "thompson")


def _obs(arm: Arm, n: int) -> StepObservation:
    return StepObservation.build(
        time_s=0.0,
        duration_s=0.02,
        traffic_class=["code", "chat"] * (n // 2),
        method=[arm.method] * n,
        k=[arm.k] * n,
        drafted=[arm.k] * n,
        accepted=[min(arm.k, 2)] * n,
    )


def _loop(preset: str, seed: int = 0) -> ControlLoop:
    return ControlLoop(spec=parse_policy(preset_text(preset)), engine=ENGINE, seed=seed)


def _trained(preset: str) -> dict[str, Any]:
    loop = _loop(preset)
    for r in range(30):
        arm = loop.decide(float(r)).arm_for("code", 32)
        loop.observe(StepBatch.of(_obs(arm, 32)))
    state: dict[str, Any] = json.loads(json.dumps(loop.state_dict()))
    return state


SAVED = {p: _trained(p) for p in PRESETS}


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document (the root excluded)."""
    out: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append((*at, k))
        out.extend(_paths(v, (*at, k)))
    return out


def _put(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 99, 2**53, 2**63, 1e308, float("inf"), float("-inf"), float("nan"), 0.5])
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


def _use(loop: ControlLoop) -> None:
    """What the sidecar does with a loop next: decide, observe, decide, save."""
    d = loop.decide(1e6)
    loop.observe(StepBatch.of(_obs(d.arm_for("code", 32), 32)))
    loop.decide(1e6 + 60.0)
    json.dumps(loop.state_dict(), allow_nan=False)  # as the sidecar's snapshot writes it


def _loaded_or_refused(preset: str, state: dict[str, Any]) -> None:
    """A state is refused with ValueError, or loaded into a loop that then decides, observes and saves."""
    loop = _loop(preset, seed=1)
    try:
        loop.load_state_dict(state)
    except ValueError:
        return
    _use(loop)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), preset=st.sampled_from(PRESETS))
def test_any_value_anywhere_is_taken_or_refused_with_a_value_error(data: st.DataObject, preset: str) -> None:
    state = copy.deepcopy(SAVED[preset])
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(state)))
        _put(state, path, data.draw(JSON_VALUES))
    _loaded_or_refused(preset, state)


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        (("contexts",), [], "state.contexts: a mapping expected, got list"),
        (("guards",), "x", "state.guards: a mapping expected, got str"),
        (("guards", "tpot"), [1], "state.guards.tpot: a mapping expected"),
        (("rounds",), float("inf"), "state.rounds: expected an integer, got float"),
        (("rounds",), -2, "state.rounds: -2 is outside [0, 9007199254740991]"),
        (("totals", "steps"), None, "state.totals.steps: expected an integer, got NoneType"),
        (("totals", "busy_s"), 1e300, "state.totals.busy_s: 1e+300 is outside [0, 9007199254740991]"),
        (("version",), 2.5, "state.version: expected an integer, got float"),
        (
            ("learner", "acc"),
            [],
            "state.learner: acc: a mapping of 'CLASS|METHOD' to acceptance counts expected, got list",
        ),
        (("rng",), "x", "state.rng: "),
        # The round in progress, the dwell and decision timers (saved since restored loops decide as
        # the loops that saved them).
        (
            ("contexts", "17-32/*", "acc"),
            [],
            "state.contexts['17-32/*'].acc: a mapping with rows, tokens and time_s expected, got list",
        ),
        (
            ("contexts", "17-32/*", "acc", "rows"),
            [1] * 4,
            "state.contexts['17-32/*'].acc.rows: expected a list",
        ),
        (
            ("contexts", "17-32/*", "acc", "rows"),
            [0.5] * 5,
            "state.contexts['17-32/*'].acc.rows: request-steps are whole numbers",
        ),
        (
            ("contexts", "17-32/*", "acc", "tokens"),
            None,
            "state.contexts['17-32/*'].acc.tokens: expected a list",
        ),
        (
            ("contexts", "17-32/*", "acc", "tokens"),
            [-1.0] * 5,
            "state.contexts['17-32/*'].acc.tokens: every value must be finite",
        ),
        (
            ("contexts", "17-32/*", "acc", "time_s"),
            [float("nan")] * 5,
            "state.contexts['17-32/*'].acc.time_s: every value must be finite",
        ),
        (
            ("contexts", "17-32/*", "acc", "time_s"),
            [1e-300] * 5,
            "state.contexts['17-32/*'].acc.tokens: arm 2's goodput is beyond 1e+18",
        ),
        (
            ("contexts", "17-32/*", "since_s"),
            "25",
            "state.contexts['17-32/*'].since_s: expected a finite number",
        ),
        (
            ("contexts", "17-32/*", "since_s"),
            30.0,
            "state.contexts['17-32/*'].since_s: expected a finite number",
        ),
        (("decision",), [], "state.decision: a mapping with at_s, issued_at_s and reason expected, got list"),
        (("decision", "at_s"), float("inf"), "state.decision.at_s: expected a finite number"),
        (
            ("decision", "issued_at_s"),
            30.0,
            "state.decision.issued_at_s: expected a finite number in [-1e+09, 29], got 30.0",
        ),
        (("decision", "reason"), 5, "state.decision.reason: expected a string"),
        (
            ("guards", "tpot", "windows"),
            [],
            "state.guards.tpot: windows: a mapping of bucket to TPOTs expected",
        ),
        (
            ("guards", "tpot", "windows"),
            {"17-32": [-1.0]},
            "state.guards.tpot: windows['17-32']: every value must be finite",
        ),
        (
            ("guards", "tpot", "windows"),
            {"x": [1.0]},
            "state.guards.tpot: windows: 'x' is not a batch bucket",
        ),
    ],
)
def test_a_field_of_the_wrong_shape_is_named(path: tuple[str, ...], value: Any, says: str) -> None:
    state = copy.deepcopy(SAVED["default"])
    _put(state, path, value)
    with pytest.raises(ValueError, match=re.escape(says)):
        _loop("default").load_state_dict(state)


def test_a_saved_arm_index_beyond_the_arm_set_is_refused() -> None:
    state = copy.deepcopy(SAVED["default"])
    ctx = next(iter(state["contexts"]))
    state["contexts"][ctx]["arm"] = 99
    with pytest.raises(
        ValueError, match=r"contexts\[.*\]\.arm: 99 is not an arm index \(-1 or one of the policy's 5 arms\)"
    ):
        _loop("default").load_state_dict(state)


def test_a_since_without_a_decision_is_refused() -> None:
    state = copy.deepcopy(SAVED["default"])
    del state["decision"]
    with pytest.raises(
        ValueError, match=r"contexts\['1/\*'\]\.since_s: saved for a context without an arm or a"
    ):
        _loop("default").load_state_dict(state)


def test_a_class_context_without_its_buckets_pooled_one_is_refused() -> None:
    # Loaded, it made every decision fail (a KeyError looking up '0/*'), and the sidecar reset the loop
    # with an ERROR and a traceback.
    state = copy.deepcopy(SAVED["default"])
    state["contexts"]["0/x"] = {"arm": -1, "rounds": 0}
    with pytest.raises(
        ValueError,
        match=re.escape("contexts['0/x']: a class's context without its bucket's pooled one ('0/*')"),
    ):
        _loop("default").load_state_dict(state)


@pytest.mark.parametrize(
    ("decision", "says"),
    [
        # shifted to a clock far behind, the issue time overflowed to -inf: a state no snapshot holds
        ({"at_s": 1e308, "issued_at_s": -1e308, "reason": ""}, "decision.at_s: "),
        ({"at_s": 1e9, "issued_at_s": -1e300, "reason": ""}, "decision.issued_at_s: "),
    ],
)
def test_decision_times_a_clock_shift_could_overflow_are_refused(decision: dict[str, Any], says: str) -> None:
    state = copy.deepcopy(SAVED["default"])
    state["decision"] = decision
    with pytest.raises(ValueError, match=re.escape(says)):
        _loop("default").load_state_dict(state)


def test_hedge_with_a_saved_time_per_row_near_zero_still_draws() -> None:
    # g = tokens / rows / time was infinite, g / top NaN, and every draw after it failed.
    state = copy.deepcopy(SAVED_NEWER["hedge"])
    for v in state["learner"]["time"].values():
        v[0] = [5e-324] * len(v[0])
    loop = _loop("hedge", seed=1)
    loop.load_state_dict(state)
    _use(loop)


def test_a_good_state_still_loads_and_decides_the_same() -> None:
    a, b = _loop("default", seed=5), _loop("default", seed=5)
    b.load_state_dict(copy.deepcopy(SAVED["default"]))
    a.load_state_dict(copy.deepcopy(SAVED["default"]))
    assert a.decide(1e6).plan == b.decide(1e6).plan


#: Learner fields saved since snapshots kept the learners' whole state (preset -> the field).
NEWER = {"exp3spec": "p", "hedge": "time", "ngram-fallback": "rates", "trtllm-gate": "rates"}
SAVED_NEWER = {p: _trained(p) for p in NEWER}


@settings(max_examples=200, deadline=None)
@given(data=st.data(), preset=st.sampled_from(sorted(NEWER)))
def test_any_value_in_the_newer_learner_fields_is_taken_or_refused(data: st.DataObject, preset: str) -> None:
    state = copy.deepcopy(SAVED_NEWER[preset])
    field = ("learner", NEWER[preset])
    places = [field, *((*field, *p) for p in _paths(state["learner"][NEWER[preset]]))]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(places))
        try:
            _put(state, path, data.draw(JSON_VALUES))
        except (LookupError, TypeError):  # an earlier draw replaced the place's parent
            continue
    _loaded_or_refused(preset, state)


@pytest.mark.parametrize(
    ("preset", "path", "value", "says"),
    [
        (
            "exp3spec",
            ("p",),
            [],
            "state.learner: p: a mapping of context to probabilities expected, got list",
        ),
        ("exp3spec", ("p", "1/*"), [0.5], "state.learner: p['1/*']: expected a list of numbers of shape (5)"),
        (
            "exp3spec",
            ("p", "1/*"),
            [0.2, 0.2, 0.2, 0.2, 1.5],
            "p['1/*']: every value must be finite and in [0, 1]",
        ),
        ("exp3spec", ("p", "1/*"), ["0.2"] * 5, "p['1/*']: expected a list of numbers"),
        (
            "hedge",
            ("time",),
            "x",
            "state.learner: time: a mapping of context to time per row expected, got str",
        ),
        (
            "hedge",
            ("time", "17-32/*"),
            [[0.0] * 5],
            "time['17-32/*']: expected a list of numbers of shape (2 x 5)",
        ),
        (
            "hedge",
            ("time", "17-32/*"),
            [[-1.0] * 5, [1.0] * 5],
            "time['17-32/*']: every value must be finite",
        ),
        ("hedge", ("time", "17-32/*"), [[10**400] * 5, [1] * 5], "time['17-32/*']: holds a number beyond"),
        (
            "ngram-fallback",
            ("rates",),
            [0.5],
            "state.learner: rates: a mapping of traffic class to rates expected",
        ),
        (
            "ngram-fallback",
            ("rates", "*"),
            [float("nan")],
            "state.learner: rates['*']: every value must be finite",
        ),
        ("ngram-fallback", ("rates", "*"), [True], "rates['*']: expected a list of numbers of shape (n)"),
        (
            "trtllm-gate",
            ("rates",),
            {"a": 1},
            "state.learner: rates: expected a list of numbers of shape (n)",
        ),
        ("trtllm-gate", ("rates",), [2.0], "state.learner: rates: every value must be finite and in [0, 1]"),
        # Hedge's round in progress.
        ("hedge", ("tokens",), [], "state.learner: tokens: a mapping of context to tokens per arm expected"),
        (
            "hedge",
            ("tokens", "17-32/*"),
            [1.0],
            "state.learner: tokens['17-32/*']: expected a list of numbers",
        ),
        (
            "hedge",
            ("rows", "17-32/*"),
            [-1.0] * 5,
            "state.learner: rows['17-32/*']: every value must be finite",
        ),
        ("hedge", ("rows", "x"), [1.0] * 5, "state.learner: rows['x']: "),
    ],
)
def test_a_newer_learner_field_of_the_wrong_shape_is_named(
    preset: str, path: tuple[str, ...], value: Any, says: str
) -> None:
    state = copy.deepcopy(SAVED_NEWER[preset])
    _put(state["learner"], path, value)
    with pytest.raises(ValueError, match=re.escape(says)):
        _loop(preset).load_state_dict(state)


#: The default policy with every guard on: drift detection, the p99 TPOT guard and the exploration
#: budget each save state of their own.
GUARDED = preset_text("default").replace(
    "  seed: 0\n",
    "  seed: 0\n  drift: {detector: page_hinkley}\n  slo: {p99_tpot_ms: 5, window: 16, min_samples: 16}\n"
    "  exploration: {max_share_at_high_load: 0.2, high_load_batch: 16}\n",
)


def _guarded() -> ControlLoop:
    return ControlLoop(spec=parse_policy(GUARDED), engine=ENGINE, seed=0)


def _guarded_state() -> dict[str, Any]:
    loop = _guarded()
    for r in range(30):
        arm = loop.decide(float(r)).arm_for("code", 32)
        loop.observe(StepBatch.of(_obs(arm, 32)))
    state: dict[str, Any] = json.loads(json.dumps(loop.state_dict()))
    assert state["guards"]["drift"]["tests"] and state["guards"]["budget"]["counts"]
    assert state["guards"]["tpot"]["trips"] and state["guards"]["tpot"]["caps"]
    return state


SAVED_GUARDED = _guarded_state()


@pytest.mark.parametrize(
    ("guard", "field", "value", "says"),
    [
        # int() and float() took each of these: a trips count below 0 or beyond 2^53 went on into the
        # loop's totals, whose next snapshot then dropped the whole engine on restore
        ("tpot", "trips", -7, "guards.tpot: trips: expected an integer in [0, "),
        ("tpot", "trips", 1e300, "guards.tpot: trips: expected an integer in [0, "),
        ("tpot", "trips", "7", "guards.tpot: trips: expected an integer in [0, "),
        ("tpot", "trips", 2.5, "guards.tpot: trips: expected an integer in [0, "),
        ("tpot", "caps", {"17-32": 0}, "guards.tpot: caps['17-32']: expected an integer in [1, 64]"),
        ("tpot", "caps", {"17-32": "3"}, "guards.tpot: caps['17-32']: expected an integer in [1, 64]"),
        ("tpot", "caps", {"17-32": True}, "guards.tpot: caps['17-32']: expected an integer in [1, 64]"),
        ("tpot", "caps", {"x": 2}, "guards.tpot: caps: 'x' is not a batch bucket label"),
        # a negative count of explored decisions let the budget explore without limit at high load
        ("budget", "counts", {"17-32/*": [100, -1000]}, "guards.budget: counts['17-32/*']: every value must"),
        ("budget", "counts", {"17-32/*": [10, 11]}, "guards.budget: counts['17-32/*']: explored 11 of 10"),
        ("budget", "counts", {"17-32/*": "12"}, "guards.budget: counts['17-32/*']: expected a list"),
        (
            "budget",
            "counts",
            {"17-32/*": [2.5, 1]},
            "guards.budget: counts['17-32/*']: decisions are counted in whole numbers",
        ),
        ("drift", "alarms", -1, "guards.drift: alarms: expected an integer in [0, "),
        ("drift", "alarms", True, "guards.drift: alarms: expected an integer in [0, "),
        # "nan" through float(): a test whose sums are NaN never fires again
        (
            "drift",
            "tests",
            {"code|eagle3": ["nan"] * 6},
            "guards.drift: tests['code|eagle3']: expected a list",
        ),
        (
            "drift",
            "tests",
            {"code|eagle3": [5, 3.0, 0, 0, 0, 0]},
            "guards.drift: tests['code|eagle3']: the mean of first-position acceptances is in [0, 1]",
        ),
        (
            "drift",
            "tests",
            {"code|eagle3": [-5, 0.5, 0, 0, 0, 0]},
            "guards.drift: tests['code|eagle3']: a sample count is a whole number",
        ),
        (
            "drift",
            "tests",
            {"code|eagle3": [5, 0.5, 1, 2, 0, 0]},
            "guards.drift: tests['code|eagle3']: the running minimum and maximum do not bound the sums",
        ),
        ("drift", "tests", {"code|nope": [5, 0.5, 0, 0, 0, 0]}, "guards.drift: tests['code|nope']: 'nope' "),
        (
            "drift",
            "tests",
            {"|eagle3": [5, 0.5, 0, 0, 0, 0]},
            "guards.drift: tests['|eagle3']: expected a traffic",
        ),
    ],
)
def test_a_guard_value_of_the_wrong_type_or_range_is_named(
    guard: str, field: str, value: Any, says: str
) -> None:
    state = copy.deepcopy(SAVED_GUARDED)
    state["guards"][guard][field] = value
    with pytest.raises(ValueError, match=re.escape(f"loop state.{says}")):
        _guarded().load_state_dict(state)


def test_a_guarded_state_still_loads_and_decides_the_same() -> None:
    a, b = _guarded(), _guarded()
    a.load_state_dict(copy.deepcopy(SAVED_GUARDED))
    b.load_state_dict(copy.deepcopy(SAVED_GUARDED))
    assert a.state_dict()["guards"] == SAVED_GUARDED["guards"]
    assert a.decide(1e6).plan == b.decide(1e6).plan


def test_a_state_another_algorithm_saved_is_refused() -> None:
    # A policy is matched to a saved state by its name alone (the sidecar's snapshot, the fleet's
    # posteriors), and nearly every learner reads another's tables: a same-named policy of another
    # algorithm took UCB1's statistics into Thompson sampling without a word.
    with pytest.raises(ValueError, match=re.escape("loop state was saved by algorithm 'ucb1', not")):
        _loop("thompson").load_state_dict(copy.deepcopy(SAVED["ucb1"]))
    older = copy.deepcopy(SAVED["thompson"])
    del older["algorithm"]  # the states of older versions do not say: taken as before
    _loop("thompson").load_state_dict(older)
