"""A replay of a trace naming more traffic classes than an engine's bound decides as the sidecar would.

What must hold: the sidecar pools every class an engine names beyond its first
``MAX_CLASSES_PER_ENGINE`` (``default`` among them) into ``default`` before its loop learns from a
step; the replay feeds its loop through the same rule, so the loop it ends with learnt about the same
classes, and no more. Before, the replay's loop learnt every class of the trace (a trace of 300
classes: 301 of them, where the sidecar's loop holds 256).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arms import Method
from policies.classes import DEFAULT_CLASS, MAX_CLASSES_PER_ENGINE, ClassBound
from policies.observation import StepBatch, StepObservation
from policies.spec import parse_policy
from sim.costmodel import load_profile
from sim.engines import ENGINES
from sim.replay import Replayer
from sim.trace import Trace

LIB = Path(__file__).resolve().parents[2] / "policies" / "library"


def _trace(n: int) -> Trace:
    """``n`` requests, each of a class of its own (``c000``, ``c001``, ...), in that order."""
    out = np.full(n, 6, np.int64)
    acc = np.concatenate([np.full(int(o), i % 4, np.int32) for i, o in enumerate(out)])
    return Trace(
        max_k=4,
        methods=(Method.EAGLE3, Method.NGRAM),
        ids=tuple(f"r{i}" for i in range(n)),
        classes=tuple(f"c{i:03d}" for i in range(n)),
        prompt_tokens=np.full(n, 10, np.int64),
        output_tokens=out,
        arrival_s=np.full(n, np.nan),
        acc={Method.EAGLE3: acc, Method.NGRAM: np.zeros_like(acc)},
    )


def _learned(state: dict[str, object]) -> set[str]:
    """The traffic classes a loop's state holds anything about (its contexts and its learner's mix)."""
    contexts = state["contexts"]
    assert isinstance(contexts, dict)
    out = {key.split("/", 1)[1] for key in contexts} - {"*"}
    learner = state["learner"]
    assert isinstance(learner, dict)
    for mix in learner.get("mix", {}).values():
        out |= set(mix)
    return out


def test_a_replay_of_300_classes_learns_no_more_classes_than_the_sidecar_would() -> None:
    policy = parse_policy((LIB / "default.yaml").read_text(), source="default")
    replay = Replayer(
        trace=_trace(300),
        profile=load_profile("llama-3.1-8b-h100"),
        engine=ENGINES["composite"],
        policy=policy,
        concurrency=1,  # one request a step: the classes come in trace order
        seed=0,
    )
    replay.run()
    assert replay.final_state is not None
    learned = _learned(replay.final_state)
    # The first 255 classes of the trace, and default with every later one pooled into it.
    allowed = {f"c{i:03d}" for i in range(MAX_CLASSES_PER_ENGINE - 1)} | {DEFAULT_CLASS}
    assert learned <= allowed, sorted(learned - allowed)[:5]
    assert len(learned) > 100  # it did learn, up to the bound


def _step(classes: list[str]) -> StepObservation:
    n = len(classes)
    codes = np.zeros(n, np.int8)
    ks = np.ones(n, np.int32)
    return StepObservation(
        time_s=0.0,
        duration_s=0.01,
        batch_size=n,
        queue_length=0,
        queue_wait_s=0.0,
        traffic_class=tuple(classes),
        method=codes,
        k=ks,
        drafted=ks,
        accepted=np.zeros(n, np.int32),
        counterfactual={},
    )


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), min_size=1, max_size=20),
    limit=st.integers(1, 12),
    split=st.integers(0, 20),
)
def test_the_bound_pools_the_same_way_however_the_steps_are_batched(
    steps: list[list[int]], limit: int, split: int
) -> None:
    # The sidecar gets steps in batches of any size, the replay one at a time: the classes learnt
    # and the steps pooled must not depend on that.
    obs = [_step([f"k{c}" for c in s]) for s in steps]
    whole = ClassBound(limit=limit)
    pooled_whole = whole.apply(StepBatch(steps=obs))
    parts = ClassBound(limit=limit)
    cut = min(split, len(obs))
    pooled_parts = [parts.apply(StepBatch(steps=obs[:cut])), parts.apply(StepBatch(steps=obs[cut:]))]
    assert whole.known == parts.known and whole.pooled_steps == parts.pooled_steps
    assert len(whole.known) <= max(limit, 1) and DEFAULT_CLASS in whole.known
    got_whole = [o.traffic_class for o in pooled_whole.steps]
    got_parts = [o.traffic_class for b in pooled_parts for o in b.steps]
    assert got_whole == got_parts
    assert all(set(c) <= whole.known for c in got_whole)
