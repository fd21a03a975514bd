"""Batch buckets, and ``Context``: its string form, order, validation, and snapshots that predate it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.arms import Arm, Method
from policies.context import ANY_CLASS, BatchBuckets, Context
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.presets import load_preset


def test_default_buckets_match_design() -> None:
    b = BatchBuckets()
    assert b.labels() == ["1", "2-4", "5-8", "9-16", "17-32", "33+"]
    assert [b.index(x) for x in (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 500)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert b.indices(np.array([1, 4, 5, 33])).tolist() == [0, 1, 2, 5]
    assert b.range(5) == (33, 0)


# 2**63: a bound no engine's batch reaches was taken (the policy validated)
@pytest.mark.parametrize("bounds", [(), (4, 4), (0, 2), (8, 4), (1, 2, 2**63), (1, (1 << 20) + 1)])
def test_invalid_bounds(bounds: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="batch buckets"):
        BatchBuckets(bounds)


# -- Context: the typed (bucket, class) of a bandit problem ----------------------------------------

_LABELS = st.text(alphabet=st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), min_size=1)
_CLASSES = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1)


@given(bucket=_LABELS, traffic_class=_CLASSES)
def test_context_string_form_round_trips(bucket: str, traffic_class: str) -> None:
    ctx = Context(bucket=bucket, traffic_class=traffic_class)
    assert ctx.key == f"{bucket}/{traffic_class}" == str(ctx)
    assert Context.parse(ctx.key) == ctx
    assert ctx.pooled == (traffic_class == ANY_CLASS)


@given(st.lists(st.tuples(_LABELS, _CLASSES), min_size=2, max_size=20))
def test_contexts_sort_as_their_string_forms(pairs: list[tuple[str, str]]) -> None:
    ctxs = [Context(bucket=b, traffic_class=c) for b, c in pairs]
    assert [c.key for c in sorted(ctxs)] == sorted(c.key for c in ctxs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket": ""}, "context bucket: expected a non-empty string"),
        ({"bucket": "2-4", "traffic_class": ""}, "context traffic_class: expected a non-empty string"),
        ({"bucket": "2/4"}, "context bucket: a bucket label has no '/'"),
        ({"bucket": 4}, "context bucket: expected a non-empty string, got 4"),
    ],
)
def test_invalid_contexts_name_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Context(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "2-4", "/code", "2-4/"])
def test_parse_refuses_what_is_not_bucket_slash_class(text: str) -> None:
    with pytest.raises(ValueError, match="context"):
        Context.parse(text)


# -- snapshots written before contexts were typed --------------------------------------------------

#: Loop snapshots (string context keys throughout) written by the code before ``Context`` existed
#: (commit 51af80b), from the feed in ``_feed``, one per preset.
OLD_STATES = Path(__file__).parent / "data" / "loop_states_string_contexts.json"
_ARMS = tuple(Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:4", "ngram:4", "off"))
_ENGINE = EngineInfo("e1", "m", 4, _ARMS, Granularity.REQUEST_METHOD)


def _feed(loop: ControlLoop, steps: int) -> None:
    """Steps of 1-39 requests of two classes over every arm, a decision after each (the fixture is
    this feed, 400 steps, into a fresh loop of seed 3)."""
    rng = np.random.default_rng(0)
    t = 0.0
    for i in range(steps):
        arm = _ARMS[i % len(_ARMS)]
        n = int(rng.integers(1, 40))
        acc = rng.integers(0, arm.k + 1, n) if arm.k else np.zeros(n, int)
        obs = StepObservation.build(
            time_s=t,
            duration_s=0.01 + 0.0005 * n,
            traffic_class=[("code", "chat")[j % 2] for j in range(n)],
            method=[arm.method] * n,
            k=[arm.k] * n,
            drafted=[arm.k] * n,
            accepted=acc.tolist(),
            counterfactual={Method.NGRAM: rng.integers(0, 5, n).tolist()},
        )
        loop.observe(StepBatch.of(obs))
        t += 0.05
        loop.decide(t)


@pytest.mark.parametrize("preset", sorted(json.loads(OLD_STATES.read_text(encoding="utf-8"))))
def test_old_snapshots_load_and_keep_learning(preset: str) -> None:
    """The string-keyed snapshot loads into typed contexts, saves back unchanged (but for counters
    added to ``totals`` and learner and guard state kept since, at zero or empty, and the algorithm
    that saved it), and the loop goes on.
    It holds no round in progress nor timers (saved since): none are saved back."""
    old = json.loads(OLD_STATES.read_text(encoding="utf-8"))[preset]
    loop = ControlLoop(spec=load_preset(preset), engine=_ENGINE, seed=3)
    loop.load_state_dict(old)
    added = {"bounded_moves": 0}
    assert not added.keys() & old["totals"].keys()
    # Learner state kept since (exp3spec's last draw probabilities, hedge's time per row): empty.
    # and hedge's round in progress (tokens and rows per arm); exp3spec's scale window starts with
    # the old all-time largest goodput, "top".
    windows = {c: [v] for c, v in old["learner"].get("top", {}).items()}
    learner_added = {
        "exp3spec": {"p": {}, "tops": windows},
        "hedge": {"time": {}, "tokens": {}, "rows": {}},
    }.get(preset, {})
    assert not learner_added.keys() & old["learner"].keys()
    # The TPOT guard's recent TPOTs (none: the guard is off in every preset).
    tpot = {**old["guards"]["tpot"], "windows": {}}
    assert "decision" not in old and not any({"acc", "since_s"} & v.keys() for v in old["contexts"].values())
    want = {
        **old,
        "algorithm": loop.spec.algorithm,  # (saved since: absent, the state loads as the policy's)
        "totals": {**old["totals"], **added},
        "learner": {**old["learner"], **learner_added},
        "guards": {**old["guards"], "tpot": tpot},
    }
    assert json.dumps(loop.state_dict(), sort_keys=True) == json.dumps(want, sort_keys=True)
    assert sorted(k.key for k in loop.current_arms()) == sorted(
        k for k, v in old["contexts"].items() if v["arm"] >= 0
    )
    before = loop.totals.steps
    _feed(loop, 50)
    assert loop.totals.steps == before + 50
    assert all(isinstance(k, Context) for k in loop.current_arms()) and loop.decide(1e6).plan


@pytest.mark.parametrize(
    "preset", sorted(p.stem for p in (Path(__file__).parents[2] / "policies" / "library").glob("*.yaml"))
)
def test_a_saved_state_is_a_snapshot_later_steps_do_not_change(preset: str) -> None:
    # The sidecar collects a loop's state on its event loop and writes it on another thread while
    # the loop goes on learning: a state that shares the learner's live tables would be written
    # holding steps past the sequence it records (learnt twice after a kill -9 and the resend).
    loop = ControlLoop(spec=load_preset(preset), engine=_ENGINE, seed=3)
    _feed(loop, 30)
    state = loop.state_dict()
    frozen = json.dumps(state, sort_keys=True)
    _feed(loop, 30)
    assert json.dumps(state, sort_keys=True) == frozen
