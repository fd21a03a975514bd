"""The same step sent as rows and as columns gives the same StepObservation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, validate_batch
from controller.wire.codec import observation_from_pb, request_columns, request_steps
from policies.arms import METHOD_CODES, Arm, Method
from policies.engine import EngineInfo
from policies.observation import StepObservation

CASES: list[dict[str, object]] = [
    dict(
        request_ids=["a", "b", "c"],
        classes=["code", "chat", "code"],
        methods=["eagle3", "ngram", "off"],
        ks=[3, 2, 0],
        drafted=[3, 2, 0],
        accepted=[1, 2, 0],
        counterfactual={"ngram": [4, -1, 0], "eagle3": [-1, 3, -1]},
        finished=[False, True, False],
    ),
    dict(  # one class, "" meaning "default", nothing scored, no ids, finished not reported
        request_ids=["", ""],
        classes=["", ""],
        methods=["eagle3", "eagle3"],
        ks=[2, 2],
        drafted=[2, 1],
        accepted=[0, 1],
        counterfactual={"ngram": [-1, -1]},
    ),
    dict(request_ids=[], classes=[], methods=[], ks=[], drafted=[], accepted=[]),
]


def _both(case: dict[str, object]) -> tuple[StepObservation, StepObservation]:
    n = len(case["ks"])  # type: ignore[arg-type]
    head = dict(
        time_s=2.5, duration_s=0.03, batch_size=n + 1, queue_length=3, queue_wait_s=0.1, scheduled_k=2
    )
    rows = pb.StepReport(**head, requests=request_steps(**case))  # type: ignore[arg-type]
    cols = pb.StepReport(**head, columns=request_columns(**case))  # type: ignore[arg-type]
    # Through the wire, as the sidecar sees them.
    rows = pb.StepReport.FromString(rows.SerializeToString())
    cols = pb.StepReport.FromString(cols.SerializeToString())
    assert cols.HasField("columns") and not cols.requests
    return observation_from_pb(rows), observation_from_pb(cols)


def same_observation(a: StepObservation, b: StepObservation) -> None:
    for name in (
        "time_s",
        "duration_s",
        "batch_size",
        "queue_length",
        "queue_wait_s",
        "traffic_class",
        "request_id",
    ):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("method", "k", "drafted", "accepted", "finished"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.counterfactual.keys() == b.counterfactual.keys()
    for m in a.counterfactual:
        assert a.counterfactual[m].dtype == b.counterfactual[m].dtype
        assert np.array_equal(a.counterfactual[m], b.counterfactual[m]), m


ENGINE = EngineInfo(
    engine_id="e",
    model="m",
    max_k=4,
    arms=(Arm(Method.EAGLE3, 2), Arm(Method.EAGLE3, 3), Arm(Method.NGRAM, 2), Arm(Method.OFF, 0)),
)


@pytest.mark.parametrize("case", CASES)
def test_rows_and_columns_give_the_same_observation(case: dict[str, object]) -> None:
    rows, cols = _both(case)
    same_observation(rows, cols)


@pytest.mark.parametrize("case", CASES)
def test_validation_returns_the_same_observation_for_both_forms(case: dict[str, object]) -> None:
    # The sidecar uses what validation returns; it must be what observation_from_pb gives.
    n = len(case["ks"])  # type: ignore[arg-type]
    head = dict(time_s=2.5, duration_s=0.03, batch_size=n + 1, queue_length=3, queue_wait_s=0.1)
    steps = [
        pb.StepReport(**head, requests=request_steps(**case)),  # type: ignore[arg-type]
        pb.StepReport(**head, columns=request_columns(**case)),  # type: ignore[arg-type]
    ]
    rows, cols = validate_batch(pb.StepReportBatch(sequence=1, steps=steps), ENGINE, Limits())
    same_observation(rows, observation_from_pb(steps[0]))
    same_observation(cols, observation_from_pb(steps[1]))
    same_observation(rows, cols)


def test_the_columns_carry_the_values() -> None:
    _, obs = _both(CASES[0])
    assert obs.traffic_class == ("code", "chat", "code")
    assert obs.method.tolist() == [METHOD_CODES[m] for m in (Method.EAGLE3, Method.NGRAM, Method.OFF)]
    assert obs.counterfactual[Method.NGRAM].tolist() == [4, -1, 0]
    assert obs.finished is not None and obs.finished.tolist() == [False, True, False]
    _, obs = _both(CASES[1])
    assert obs.traffic_class == ("default", "default") and obs.counterfactual == {}


def test_proto_method_codes_match_the_policies_codes() -> None:
    # The proto documents the codes by hand; they must stay the numpy codes StepObservation uses.
    text = (Path(__file__).resolve().parents[3] / "proto/controller/v1/controller.proto").read_text()
    assert "0 = eagle3, 1 = p_eagle, 2 = ngram, 3 = off." in text
    assert [m.value for m in sorted(METHOD_CODES, key=METHOD_CODES.__getitem__)] == [
        "eagle3",
        "p_eagle",
        "ngram",
        "off",
    ]
