"""A report read straight into columns (``read_batch``: the sidecar's ingest) teaches the control loop
exactly what the same steps teach it as whole steps: the same state, totals, drift alarms and
decisions, bit for bit. Random batches as engines send them (packed or repeated columns), with steps
that have no rows or no measured duration, several classes, counterfactual scores and drift alarms
that split a batch."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, read_batch
from controller.wire.codec import encode_columns, observation_from_pb
from policies.arms import METHOD_CODES, Arm, Method
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop
from policies.observation import NOT_SCORED, StepBatch
from policies.presets import load_preset

ARMS = tuple(Arm.parse(a) for a in ("eagle3:1", "eagle3:2", "eagle3:4", "ngram:2", "ngram:4", "off"))
ENGINE = EngineInfo(
    engine_id="e", model="m", max_k=4, arms=ARMS, granularity=Granularity.REQUEST_METHOD, max_batch_size=256
)
CLASSES = ("", "chat", "code", "rag")  # "" is the default class


def wire_step(
    rng: np.random.Generator, t: float, packed: bool, *, proposals: bool, finished: bool, level: float
) -> pb.StepReport:
    """A step; ``proposals`` / ``finished``: whether it reports them (an engine does on every step)."""
    n = int(rng.choice([0, 1, 3, 8, 32]))
    arms = [ARMS[i] for i in rng.integers(0, len(ARMS), size=n)]
    k = np.array([a.k for a in arms], dtype=np.int64)
    drafted = np.minimum(k, rng.integers(0, 5, n))
    accepted = np.where(rng.random(n) < level, drafted, 0)  # acceptance drifts with ``level``
    cf = np.where(rng.random(n) < 0.3, NOT_SCORED, rng.integers(0, 5, n))
    table = tuple(rng.permutation(CLASSES)[: int(rng.integers(1, 5))])
    return pb.StepReport(
        time_s=t,
        duration_s=float(rng.choice([0.0, 0.004, 0.011, 0.03])),
        batch_size=n + int(rng.integers(0, 8)),
        prefill_tokens=int(rng.choice([0, 17, 300])),
        columns=encode_columns(
            class_names=table,
            class_index=rng.integers(0, len(table), n),
            method=np.array([METHOD_CODES[a.method] for a in arms], dtype=np.int64),
            k=k,
            drafted=drafted,
            accepted=accepted,
            request_id=[f"r{rng.integers(1000)}" for _ in range(n)] if rng.random() < 0.5 else [],
            counterfactual={Method.NGRAM: cf} if rng.random() < 0.7 else None,
            finished=rng.random(n) < 0.1 if finished else None,
            ngram_proposal=rng.integers(0, 5, n) if proposals else None,
            packed=packed,
        ),
    )


def compare(seed: int, form: str) -> int:
    """Eight random reports through both paths, compared after each; returns the drift alarms fired."""
    rng = np.random.default_rng(seed)
    spec = load_preset("default")
    # A sensitive drift detector, so that alarms fire and split batches.
    spec = dataclasses.replace(
        spec,
        drift={**spec.drift, "detector": "page_hinkley", "threshold": 2.0, "delta": 0.0, "min_samples": 5},
    )
    columns = ControlLoop(spec=spec, engine=ENGINE, seed=seed)
    steps = ControlLoop(spec=spec, engine=ENGINE, seed=seed)
    t = 0.0
    for sequence in range(1, 9):
        reports = []
        proposals, finished = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
        level = 0.9 if sequence % 2 else 0.1
        for _ in range(int(rng.integers(1, 40))):
            t += 0.02
            packed = form == "packed" or (form == "mixed" and bool(rng.random() < 0.5))
            reports.append(wire_step(rng, t, packed, proposals=proposals, finished=finished, level=level))
        batch = pb.StepReportBatch(sequence=sequence, steps=reports)
        read = read_batch(batch, ENGINE, Limits())
        # The batch path (straight into columns) takes every batch of one form.
        assert (read._steps is None) == (
            form != "mixed"
            or len({s.columns.count > 0 for s in reports if s.columns.count or len(s.columns.k)}) < 2
        )
        columns.observe(read)
        steps.observe(StepBatch(steps=[observation_from_pb(s) for s in reports]))
        assert columns.totals == steps.totals
        assert columns.drift_events == steps.drift_events
        assert columns.decide(t) == steps.decide(t)
    assert json.dumps(columns.state_dict(), sort_keys=True) == json.dumps(steps.state_dict(), sort_keys=True)
    return columns.totals.drift_alarms


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), form=st.sampled_from(["packed", "repeated", "mixed"]))
def test_columns_read_at_once_teach_the_loop_what_whole_steps_do(seed: int, form: str) -> None:
    compare(seed, form)


def test_the_batches_above_fire_drift_alarms() -> None:
    # The comparison above covers batches split at alarms: most runs of it fire some.
    alarms = [compare(seed, form) for seed in range(10) for form in ("packed", "repeated", "mixed")]
    assert alarms and sum(a > 0 for a in alarms) >= len(alarms) // 2, alarms
