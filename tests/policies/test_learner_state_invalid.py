"""Learners' ``load_state_dict`` with saved statistics of the wrong shape or range: snapshots come from
disk and the fleet's posteriors from the network. Every learner checks every field it restores before
it takes any (shapes against its arms and params, finite, counts and shares >= 0, known keys, a cost
model that can be solved), raises ValueError naming the field, and is then left exactly as it was; a
state it saved itself always loads back. The loop prefixes the message with ``loop state.learner: ``
(tests/policies/test_loop_state_invalid.py) and the sidecar starts that engine's loop afresh with one
warning (tests/controller/test_sidecar_saved_loops.py)."""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.algorithms import REGISTRY, GoodputModel
from policies.algorithms.base import MAX_COUNT, saved_bucket
from policies.arms import MAX_K, Arm, Method
from policies.context import MAX_BATCH_SIZE, BatchBuckets, Context
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.presets import preset_names, preset_text
from policies.spec import parse_policy
from tests.policies.test_loop_state_invalid import _paths

ARMS = tuple(Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:4", "ngram:4", "off"))
ENGINE = EngineInfo("e1", "m", 4, ARMS, Granularity.REQUEST_METHOD)
#: One preset per learner, so every learner in the registry is tested with the params it ships with.
PRESET_OF = {parse_policy(preset_text(p)).algorithm: p for p in reversed(preset_names())}
PRESETS = sorted(set(PRESET_OF.values()))
#: Batch sizes of the steps each round: three buckets ("2-4", "5-8", "17-32") of the default bounds.
SIZES = (2, 6, 32)


def _loop(preset: str, seed: int = 0) -> ControlLoop:
    return ControlLoop(spec=parse_policy(preset_text(preset)), engine=ENGINE, seed=seed)


def _train(loop: ControlLoop, rounds: int, seed: int) -> ControlLoop:
    """Rounds of decisions, each followed by one report of a step per batch size in ``SIZES``: two
    classes, acceptance and step times drawn from ``seed``, n-gram scored on every row."""
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        d = loop.decide(float(r))
        steps = []
        for n in SIZES:
            cls = ["code", "chat"] * (n // 2)
            arms = [d.arm_for(c, n) for c in cls]
            k = [a.k for a in arms]
            steps.append(
                StepObservation.build(
                    time_s=float(r),
                    duration_s=float(rng.uniform(0.005, 0.05)),
                    traffic_class=cls,
                    method=[a.method for a in arms],
                    k=k,
                    drafted=k,
                    accepted=[int(rng.integers(0, kk + 1)) for kk in k],
                    counterfactual={Method.NGRAM: rng.integers(0, 5, n)},
                    prefill_tokens=int(rng.integers(0, 512)),
                )
            )
        loop.observe(StepBatch(steps=steps))
    return loop


def _json(x: Any) -> Any:
    return json.loads(json.dumps(x))


#: What each preset's learner saved after 12 rounds (seed 0): the states that get corrupted.
SAVED = {p: _json(_train(_loop(p), 12, 0).learner.state_dict()) for p in PRESETS}
#: Loops (saved whole) whose learners hold statistics of their own (seed 1, 7 rounds), unlike any of
#: ``SAVED``: a refused load must leave them as they were, which a partial load would not.
TARGETS = {p: _json(_train(_loop(p, seed=1), 7, 1).state_dict()) for p in PRESETS}


def _target(preset: str) -> ControlLoop:
    loop = _loop(preset, seed=1)
    loop.load_state_dict(copy.deepcopy(TARGETS[preset]))
    return loop


def _saved(learner: Any) -> str:
    return json.dumps(learner.state_dict(), sort_keys=True)


def _refused_unchanged(preset: str, state: Any, says: str | None = None) -> str:
    """Loading ``state`` raises ValueError (matching ``says``) and leaves the learner as it was; returns
    the message."""
    learner = _target(preset).learner
    before = _saved(learner)
    with pytest.raises(ValueError) as err:
        learner.load_state_dict(state)
    if says is not None:
        assert says in str(err.value)
    assert _saved(learner) == before
    return str(err.value)


def test_every_learner_has_a_preset_here() -> None:
    assert set(PRESET_OF) == set(REGISTRY)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_saved_state_loads_back_as_it_was(preset: str) -> None:
    loop = _target(preset)
    loop.learner.load_state_dict(copy.deepcopy(SAVED[preset]))
    assert _json(loop.learner.state_dict()) == SAVED[preset]
    _train(loop, 2, 2)  # and the learner goes on deciding and learning from it


@pytest.mark.parametrize("preset", PRESETS)
def test_a_learner_state_that_is_not_a_mapping_is_refused(preset: str) -> None:
    _refused_unchanged(preset, [], "learner state: a mapping expected, got list")


# -- the concrete cases --------------------------------------------------------------------------

Case = Callable[[dict[str, Any]], str]


def _first(d: dict[str, Any]) -> str:
    return next(iter(d))


def _put(d: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    d[key] = value
    return d


def _acc_table(s: dict[str, Any], key: str, value: Any) -> str:
    s["acc"][key] = value
    return f"acc[{key!r}]"


def _set_xtx(s: dict[str, Any], i: int, j: int, value: float) -> dict[str, Any]:
    s["xtx"][i][j] = s["xtx"][j][i] = value
    return s


def _indefinite(s: dict[str, Any]) -> str:
    x = s["xtx"]
    _set_xtx(s, 0, 1, 2.0 * math.sqrt(x[0][0] * x[1][1]))  # |x01| > sqrt(x00 x11): not a Gram matrix
    return "xtx: not positive definite"


def _overflowing_fit(s: dict[str, Any]) -> str:
    s["xtx"] = (np.eye(6) * 1e-9).tolist()  # the smallest ridge the params allow, nothing learnt
    s["xty"] = [1e300] * 6
    return "xtx, xty, yy, w: the cost model cannot be fitted to them"


GOODPUT: dict[str, Case] = {
    # The hostile-input review's cases, each restored without complaint before.
    "batch-one-number": lambda s: (
        _put(s["batch"], "5-8", [1.0]),
        "batch['5-8']: expected a list of numbers of shape (2), got [1.0]",
    )[1],
    "batch-2d": lambda s: (
        _put(s["batch"], "5-8", [[6.0, 1.0], [6.0, 1.0]]),
        "batch['5-8']: expected a list of numbers of shape (2)",
    )[1],
    "batch-three-numbers": lambda s: (
        _put(s["batch"], "5-8", [6.0, 1.0, 1.0]),
        "batch['5-8']: expected a list of numbers of shape (2), got [6.0, 1.0, 1.0]",
    )[1],
    "batch-unknown-bucket": lambda s: (
        _put(s["batch"], "huge", [6.0, 1.0]),
        "batch['huge']: 'huge' is not a batch bucket label (N, LO-HI or LO+)",
    )[1],
    "batch-mean-beyond-any-batch": lambda s: (
        _put(s["batch"], "5-8", [1e300, 1.0]),
        f"batch['5-8']: a mean batch size above {MAX_BATCH_SIZE}",
    )[1],
    "acc-negative-counts": lambda s: (
        where := _acc_table(s, "*|0", [[-1000.0] * 8] * 2),
        f"{where}: every value must be finite and in [0, inf]",
    )[1],
    "acc-method-code-99": lambda s: (
        where := _acc_table(s, "chat|99", s["acc"]["*|0"]),
        f"{where}: '99' is not the code of a drafting method (one of 0, 1, 2)",
    )[1],
    "acc-method-off": lambda s: (
        where := _acc_table(s, "chat|3", s["acc"]["*|0"]),
        f"{where}: '3' is not the code of a drafting method",
    )[1],
    "acc-method-code-padded": lambda s: (
        where := _acc_table(s, "chat| 0", s["acc"]["*|0"]),
        f"{where}: ' 0' is not the code of a drafting method",
    )[1],
    "acc-no-class": lambda s: (
        where := _acc_table(s, "|0", s["acc"]["*|0"]),
        f"{where}: expected a traffic class (a non-empty string), got ''",
    )[1],
    "acc-shape-of-another-max-k": lambda s: (
        where := _acc_table(s, "*|0", [row[:4] for row in s["acc"]["*|0"]]),
        f"{where}: expected a list of numbers of shape (2 x 8)",
    )[1],
    "acc-more-accepted-than-tried": lambda s: (
        where := _acc_table(s, "*|0", [[1.0] * 8, [1.0, 2.0] + [0.0] * 6]),
        f"{where}: more accepted than tried at draft position 2",
    )[1],
    "acc-not-a-mapping": lambda s: (
        _put(s, "acc", []),
        "acc: a mapping of 'CLASS|METHOD' to acceptance counts expected, got list",
    )[1],
    "acc-missing": lambda s: (s.pop("acc"), "acc: a mapping of")[1],
    "xtx-all-zero": lambda s: (_put(s, "xtx", [[0.0] * 6] * 6), "xtx: not positive definite")[1],
    "xtx-not-symmetric": lambda s: (
        s["xtx"][0].__setitem__(1, s["xtx"][0][1] + 1.0),
        "xtx: not symmetric",
    )[1],
    "xtx-indefinite": _indefinite,
    "xtx-negative": lambda s: (
        _set_xtx(s, 0, 1, -1.0),
        "xtx: every value must be finite and in [0, inf]",
    )[1],
    "xtx-nan": lambda s: (_set_xtx(s, 2, 2, math.nan), "xtx: every value must be finite")[1],
    "xtx-of-another-size": lambda s: (
        _put(s, "xtx", [[1.0]]),
        "xtx: expected a list of numbers of shape (6 x 6), got [[1.0]]",
    )[1],
    "xty-negative": lambda s: (
        s["xty"].__setitem__(0, -5.0),
        "xty: every value must be finite and in [0, inf]",
    )[1],
    "cost-fit-overflows": _overflowing_fit,
    "yy-a-string": lambda s: (_put(s, "yy", "1.5"), "yy: expected a finite number in [0, inf], got '1.5'")[1],
    "w-a-bool": lambda s: (_put(s, "w", True), "w: expected a finite number in [0, inf], got True")[1],
    "mix-negative-share": lambda s: (
        _put(s["mix"]["5-8"], "chat", -0.5),
        "mix['5-8']['chat']: expected a finite number in [0, inf], got -0.5",
    )[1],
    "mix-a-string": lambda s: (
        _put(s, "mix", "x"),
        "mix: a mapping of bucket to class shares expected, got str",
    )[1],
    "mix-unknown-bucket": lambda s: (
        _put(s["mix"], "5 to 8", {}),
        "mix['5 to 8']: '5 to 8' is not a batch bucket label",
    )[1],
    "mix-no-class": lambda s: (
        _put(s["mix"]["5-8"], "", 1.0),
        "mix['5-8']: expected a traffic class (a non-empty string), got ''",
    )[1],
    "ngram-rows-negative": lambda s: (
        _put(s["ngram_rows"], "5-8/*", [-1.0, 0.0, 0.0, 0.0]),
        "ngram_rows['5-8/*']: every value must be finite and in [0, inf]",
    )[1],
    "ngram-rows-more-than-rows": lambda s: (
        _put(s["ngram_rows"], "5-8/*", [1.0, 2.0, 2.0, 2.0]),
        "ngram_rows['5-8/*']: more n-gram rows than rows",
    )[1],
    "ngram-rows-too-many-tokens": lambda s: (
        _put(s["ngram_rows"], "5-8/*", [2.0, 1.0, 100.0, 5.0]),
        f"ngram_rows['5-8/*']: more than {MAX_K + 1} tokens per n-gram row",
    )[1],
    "ngram-rows-of-another-shape": lambda s: (
        _put(s["ngram_rows"], "5-8/*", [1.0]),
        "ngram_rows['5-8/*']: expected a list of numbers of shape (4)",
    )[1],
    "ngram-rows-not-a-context": lambda s: (
        _put(s["ngram_rows"], "chat", [1.0, 0.0, 0.0, 0.0]),
        "ngram_rows['chat']: context 'chat': expected BUCKET/CLASS",
    )[1],
    "ngram-rows-unknown-bucket": lambda s: (
        _put(s["ngram_rows"], "x/chat", [1.0, 0.0, 0.0, 0.0]),
        "ngram_rows['x/chat']: 'x' is not a batch bucket label",
    )[1],
    "head-a-string": lambda s: (_put(s, "head", "yes"), "head: expected true or false, got 'yes'")[1],
}


@pytest.mark.parametrize("case", list(GOODPUT.values()), ids=list(GOODPUT))
def test_a_goodput_model_field_of_the_wrong_shape_is_named_and_nothing_is_taken(case: Case) -> None:
    state = copy.deepcopy(SAVED["default"])
    says = case(state)
    _refused_unchanged("default", state, says)


def _ctx_of(field: str) -> Callable[[dict[str, Any]], str]:
    return lambda s: _first(s[field])


def _table(s: dict[str, Any], name: str, value: Any) -> str:
    ctx = _first(s["tables"])
    s["tables"][ctx][name] = value
    return f"tables[{ctx!r}].{name}"


def _at(s: dict[str, Any], field: str, value: Any) -> str:
    ctx = _first(s[field])
    s[field][ctx] = value
    return f"{field}[{ctx!r}]"


def _hist(s: dict[str, Any], pair: Any) -> str:
    ctx = _first(s["hist"])
    s["hist"][ctx][0] = pair
    return f"hist[{ctx!r}][0]"


TABULAR: dict[str, tuple[str, Case]] = {
    "tables-negative-weight": (
        "ucb1",
        lambda s: f"{_table(s, 'n', [-1.0] * 5)}: every value must be finite and in [0, {MAX_COUNT:g}]",
    ),
    "tables-nan-squares": (
        "thompson",
        lambda s: f"{_table(s, 'q', [math.nan] * 5)}: every value must be finite",
    ),
    "tables-negative-squares": ("epsilon-greedy", lambda s: f"{_table(s, 'q', [-1.0] * 5)}: every value"),
    "tables-weight-beyond-any-count": (
        "ucb1",
        lambda s: f"{_table(s, 'n', [1e300] * 5)}: every value must be finite and in [0, {MAX_COUNT:g}]",
    ),
    # Thompson squared a mean of 1e156 (a Python float's ** raised OverflowError in the decision).
    "tables-mean-beyond-any-reward": (
        "thompson",
        lambda s: (
            _table(s, "n", [1.0] * 5),
            f"{_table(s, 's', [1.5e156] + [1.0] * 4)}: arm 0's mean beyond 1e+18 for its weight 1",
        )[1],
    ),
    "tables-squares-beyond-any-reward": (
        "ucb1",
        lambda s: (
            _table(s, "n", [1.0] * 5),
            f"{_table(s, 'q', [0.0, 1e40, 0.0, 0.0, 0.0])}: arm 1's mean beyond 1e+36",
        )[1],
    ),
    "tables-of-another-arm-set": (
        "ucbspec",
        lambda s: f"{_table(s, 's', [1.0] * 4)}: expected a list of numbers of shape (5)",
    ),
    "tables-strings": (
        "static-eagle3-3",
        lambda s: f"{_table(s, 's', ['1'] * 5)}: expected a list of numbers",
    ),
    "tables-missing-statistic": (
        "vllm-schedule",
        lambda s: (s["tables"][_first(s["tables"])].pop("q"), f"tables[{_first(s['tables'])!r}].q: expected")[
            1
        ],
    ),
    "tables-entry-a-list": (
        "thompson-plain",
        lambda s: f"{_at(s, 'tables', [1])}: a mapping with n, s and q expected, got list",
    ),
    "tables-a-list": (
        "ucb1",
        lambda s: (_put(s, "tables", []), "tables: a mapping of context to arm table expected, got list")[1],
    ),
    "tables-not-a-context": (
        "ucb1",
        lambda s: (
            _put(s["tables"], "nowhere", s["tables"][_first(s["tables"])]),
            "tables['nowhere']: context 'nowhere': expected BUCKET/CLASS",
        )[1],
    ),
    "hist-arm-99": ("sw-ucb", lambda s: f"{_hist(s, [99, 1.0])}: 99 is not an arm index (0 to 4)"),
    "hist-arm-negative": ("sw-ucb", lambda s: f"{_hist(s, [-1, 1.0])}: -1 is not an arm index"),
    "hist-arm-a-bool": ("sw-ucb", lambda s: f"{_hist(s, [True, 1.0])}: True is not an arm index"),
    "hist-arm-a-float": ("sw-ucb", lambda s: f"{_hist(s, [1.5, 1.0])}: 1.5 is not an arm index"),
    "hist-reward-nan": ("sw-ucb", lambda s: f"{_hist(s, [0, math.nan])}[1]: expected a finite number"),
    "hist-reward-beyond-any": ("sw-ucb", lambda s: f"{_hist(s, [0, 1e300])}[1]: expected a finite number in"),
    "hist-not-a-pair": ("sw-ucb", lambda s: f"{_hist(s, [0, 1.0, 2.0])}: an [arm, reward] pair expected"),
    "hist-a-string": (
        "sw-ucb",
        lambda s: f"{_at(s, 'hist', 'x')}: a list of [arm, reward] pairs expected, got str",
    ),
    "exp3-negative-loss": (
        "exp3spec",
        lambda s: f"{_at(s, 'loss', [-1.0] * 5)}: every value must be a number",
    ),
    "exp3-nan-loss": (
        "exp3spec",
        lambda s: f"{_at(s, 'loss', [math.nan] * 5)}: every value must be a number and in [0, inf]",
    ),
    "exp3-loss-of-another-arm-set": (
        "exp3spec",
        lambda s: f"{_at(s, 'loss', [1.0] * 6)}: expected a list of numbers of shape (5)",
    ),
    "exp3-negative-rounds": (
        "exp3spec",
        lambda s: f"{_at(s, 't', -1)}: expected an integer in [0, {MAX_COUNT}], got -1",
    ),
    "exp3-fractional-rounds": ("exp3spec", lambda s: f"{_at(s, 't', 1.5)}: expected an integer"),
    "exp3-rounds-a-string": ("exp3spec", lambda s: f"{_at(s, 't', '3')}: expected an integer"),
    "exp3-negative-top": (
        "exp3spec",
        lambda s: f"{_at(s, 'top', -5)}: expected a finite number in [0, 1e+18], got -5",
    ),
    "exp3-top-beyond-any-reward": ("exp3spec", lambda s: f"{_at(s, 'top', 1e300)}: expected a finite number"),
    "exp3-nan-top": ("exp3spec", lambda s: f"{_at(s, 'top', math.nan)}: expected a finite number"),
    "hedge-negative-cum": ("hedge", lambda s: f"{_at(s, 'cum', [-1.0] * 5)}: every value must be finite"),
    # eta times 1e300 overflowed: the draw's weights were inf - inf, NaN.
    "hedge-cum-beyond-any-count": (
        "hedge",
        lambda s: f"{_at(s, 'cum', [1e300] * 5)}: every value must be finite and in [0, {MAX_COUNT:g}]",
    ),
    "hedge-cum-of-another-arm-set": (
        "hedge",
        lambda s: f"{_at(s, 'cum', [1.0])}: expected a list of numbers of shape (5)",
    ),
    "gate-closed-a-string": (
        "trtllm-gate",
        lambda s: (_put(s, "closed", "false"), "closed: expected true or false, got 'false'")[1],
    ),
    "fallback-classes-a-string": (
        "ngram-fallback",
        lambda s: (_put(s, "fell_back", "chat"), "fell_back: a list of traffic classes expected, got str")[1],
    ),
    "fallback-class-a-list": (
        "ngram-fallback",
        lambda s: (_put(s, "fell_back", [["x"]]), "fell_back[0]: expected a traffic class")[1],
    ),
    "fallback-rates-no-class": (
        "ngram-fallback",
        lambda s: (
            _put(s["rates"], "", [0.5]),
            "rates: expected a traffic class (a non-empty string), got ''",
        )[1],
    ),
}


@pytest.mark.parametrize(("preset", "case"), list(TABULAR.values()), ids=list(TABULAR))
def test_a_learner_field_of_the_wrong_shape_is_named_and_nothing_is_taken(preset: str, case: Case) -> None:
    state = copy.deepcopy(SAVED[preset])
    says = case(state)
    _refused_unchanged(preset, state, says)


def test_exp3_takes_the_infinite_losses_it_saves_itself_and_still_draws() -> None:
    # An arm played at a probability so small that 1 / p overflowed has an infinite loss; with every
    # allowed arm's loss infinite, the draw's weights were all NaN and the decision failed.
    state = copy.deepcopy(SAVED["exp3spec"])
    ctx = _first(state["loss"])
    state["loss"][ctx] = [math.inf] * 5
    loop = _target("exp3spec")
    loop.learner.load_state_dict(state)
    assert loop.learner.select(Context.parse(ctx), [0, 1, 2]) in (0, 1, 2)
    loop.learner.update(Context.parse(ctx), {0: 100.0})
    _train(loop, 2, 2)


def test_through_the_loop_the_message_names_the_learner_field() -> None:
    state = _json(_train(_loop("default"), 12, 0).state_dict())
    state["learner"]["batch"]["5-8"] = [1.0]
    with pytest.raises(ValueError, match=re.escape("loop state.learner: batch['5-8']: expected a list")):
        _loop("default").load_state_dict(state)


# -- properties ----------------------------------------------------------------------------------


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    _get(doc, path[:-1])[path[-1]] = value


NUMBERS = st.sampled_from(
    [0, 1, -1, 99, 2**53, 2**63, 10**400, 1e308, 5e-324, -5e-324, 0.5, -0.0, math.inf, -math.inf, math.nan]
) | st.floats(allow_nan=True, allow_infinity=True)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | NUMBERS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=250, deadline=None)
@given(data=st.data(), preset=st.sampled_from(PRESETS))
def test_any_value_anywhere_is_taken_or_refused_and_a_refusal_changes_nothing(
    data: st.DataObject, preset: str
) -> None:
    state = copy.deepcopy(SAVED[preset])
    for _ in range(data.draw(st.integers(1, 3))):
        places = _paths(state)
        if not places:
            break
        _set(state, data.draw(st.sampled_from(places)), data.draw(JSON_VALUES))
    loop = _target(preset)
    before = _saved(loop.learner)
    try:
        loop.learner.load_state_dict(state)
    except ValueError:
        assert _saved(loop.learner) == before
        return
    _train(loop, 2, 3)  # a state taken is one the learner can decide, learn and save from
    json.dumps(loop.state_dict())


def _signed(path: tuple[Any, ...]) -> bool:
    """The saved numbers that may be negative: sums of rewards (a reward is any finite number)."""
    return bool((path[0] == "tables" and path[2] == "s") or (path[0] == "hist" and path[-1] == 1))


def _infinite(path: tuple[Any, ...]) -> bool:
    """The saved numbers that may be infinite: EXP3's losses (1 / p overflows for an arm played at a
    probability that small; the learner saves such states itself, tests/policies/data holds one)."""
    return bool(path[0] == "loss")


BAD_ANYWHERE: st.SearchStrategy[Any] = st.sampled_from(
    [math.nan, -math.inf, 10**400, "1", None, True, [1.0], {}]
)
NEGATIVE: st.SearchStrategy[Any] = st.sampled_from([-1.0, -1, -5e-324, -1e300])


@settings(max_examples=250, deadline=None)
@given(data=st.data(), preset=st.sampled_from(PRESETS))
def test_a_bad_number_anywhere_is_refused_naming_its_field(data: st.DataObject, preset: str) -> None:
    state = copy.deepcopy(SAVED[preset])
    numbers = [
        p
        for p in _paths(state)
        if isinstance(_get(state, p), int | float) and not isinstance(_get(state, p), bool)
    ]
    path = data.draw(st.sampled_from(numbers))
    bad = data.draw(
        (BAD_ANYWHERE if _signed(path) else BAD_ANYWHERE | NEGATIVE)
        | (st.nothing() if _infinite(path) else st.just(math.inf))
    )
    _set(state, path, bad)
    said = _refused_unchanged(preset, state)
    assert said.startswith(str(path[0])), said


@settings(max_examples=60, deadline=None)
@given(
    ridge=st.sampled_from([1e-9, 1e-6, 1e-3, 1.0, 1e3]),
    memory=st.sampled_from([10.0, 2000.0, 1e7]),
    max_k=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
    one_arm=st.booleans(),
)
def test_a_goodput_model_loads_back_any_state_it_saved(
    ridge: float, memory: float, max_k: int, seed: int, one_arm: bool
) -> None:
    # Whatever it learnt from (one arm only: features that never varied; huge prefills; tiny ridges),
    # what it saved passes every check (wins <= trials, a symmetric positive definite X'X, ...).
    arms = (*ARMS, Arm.parse("p_eagle:3"))
    params = {k: p.default for k, p in GoodputModel.PARAMS.items()}
    params |= {"ridge": ridge, "memory_steps": memory, "max_k": max_k}
    rng = np.random.default_rng(seed)
    a = GoodputModel(arms=arms, params=params, rng=np.random.default_rng(0))
    labels = BatchBuckets().labels()
    for _ in range(int(rng.integers(1, 20))):
        steps, buckets = [], []
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(1, 300))
            arm = arms[0] if one_arm else arms[int(rng.integers(len(arms)))]
            k = [arm.k] * n
            steps.append(
                StepObservation.build(
                    time_s=0.0,
                    duration_s=float(rng.uniform(1e-4, 5.0)),
                    traffic_class=[("a", "b", "c")[i % 3] for i in range(n)],
                    method=[arm.method] * n,
                    k=k,
                    drafted=k,
                    accepted=rng.integers(0, arm.k + 1, n),
                    counterfactual={Method.NGRAM: rng.integers(-1, 6, n)},
                    prefill_tokens=int(rng.integers(0, 20000)),
                )
            )
            buckets.append(labels[BatchBuckets().index(n)])
        a.observe(StepBatch(steps=steps), buckets, per_class=bool(rng.integers(2)))
        for label in set(buckets):
            rows = rng.integers(0, 50, len(arms)).astype(np.float64)
            tokens = rows * (np.array([x.k for x in arms]) + 1) * rng.uniform(0, 1, len(arms))
            a.observe_round(Context(bucket=label, traffic_class="a"), rows, tokens)
    saved = _json(a.state_dict())
    b = GoodputModel(arms=arms, params=params, rng=np.random.default_rng(0))
    b.load_state_dict(saved)
    assert _json(b.state_dict()) == saved


@settings(max_examples=30, deadline=None)
@given(preset=st.sampled_from(PRESETS), rounds=st.integers(1, 20), seed=st.integers(0, 1000))
def test_every_learner_loads_back_any_state_it_saved(preset: str, rounds: int, seed: int) -> None:
    saved = _json(_train(_loop(preset, seed=seed), rounds, seed).learner.state_dict())
    loop = _loop(preset)
    loop.learner.load_state_dict(saved)
    assert _json(loop.learner.state_dict()) == saved


@given(
    bounds=st.lists(st.integers(1, MAX_BATCH_SIZE), min_size=1, max_size=8, unique=True).map(
        lambda b: tuple(sorted(b))
    )
)
def test_every_bucket_label_a_policy_can_have_is_a_saved_bucket(bounds: tuple[int, ...]) -> None:
    for label in BatchBuckets(bounds).labels():
        assert saved_bucket(label, "batch") == label


@pytest.mark.parametrize(
    "label", ["", "x", "0", "0-4", "05-8", "8-5", "5-5", "5-", "-5", "5+8", "+", "1-2-3", " 1", "١", 3, None]
)
def test_what_is_not_a_bucket_label_is_refused(label: Any) -> None:
    with pytest.raises(ValueError, match="is not a batch bucket label"):
        saved_bucket(label, "batch")


def test_an_open_bucket_past_the_largest_bound_is_a_label_and_no_larger_one_is() -> None:
    assert saved_bucket(f"{MAX_BATCH_SIZE + 1}+", "b") == f"{MAX_BATCH_SIZE + 1}+"
    for label in (f"{MAX_BATCH_SIZE + 2}+", f"{MAX_BATCH_SIZE + 1}", f"1-{MAX_BATCH_SIZE + 1}"):
        with pytest.raises(ValueError):
            saved_bucket(label, "b")
