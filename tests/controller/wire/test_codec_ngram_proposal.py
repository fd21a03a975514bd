"""StepReport's n-gram proposal (RequestColumns.ngram_proposal = 10, RequestStep.ngram_proposal = 9):
conversion both ways, "not reported" distinct from "no match", and validation with a field path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, TelemetryError, validate_batch
from controller.wire.codec import ngram_proposal_from_pb, observation_from_pb, request_columns, request_steps
from policies.arms import Arm, Method
from policies.engine import EngineInfo

ENGINE = EngineInfo(
    engine_id="e1",
    model="m",
    max_k=8,
    arms=(Arm(Method.EAGLE3, 4), Arm(Method.NGRAM, 4), Arm(Method.OFF, 0)),
    max_batch_size=64,
)


def _kw(n: int) -> dict[str, object]:
    return dict(
        request_ids=[f"r{i}" for i in range(n)],
        classes=["chat"] * n,
        methods=["eagle3"] * n,
        ks=[4] * n,
        drafted=[4] * n,
        accepted=[1] * n,
    )


def _step(proposal: list[int] | None, *, columns: bool) -> pb.StepReport:
    n = 3 if proposal is None else len(proposal)
    if columns:
        return pb.StepReport(
            time_s=1.0,
            duration_s=0.02,
            batch_size=n,
            columns=request_columns(**_kw(n), ngram_proposal=proposal),
        )
    return pb.StepReport(
        time_s=1.0, duration_s=0.02, batch_size=n, requests=request_steps(**_kw(n), ngram_proposal=proposal)
    )


def _validate(*steps: pb.StepReport) -> list[object]:
    return list(validate_batch(pb.StepReportBatch(sequence=1, steps=steps), ENGINE, Limits()))


@pytest.mark.parametrize("columns", [True, False])
def test_no_match_is_not_the_same_as_not_reported(columns: bool) -> None:
    (zero,) = _validate(_step([0, 0, 0], columns=columns))
    (none,) = _validate(_step(None, columns=columns))
    assert zero.ngram_proposal is not None and zero.ngram_proposal.tolist() == [0, 0, 0]  # type: ignore[attr-defined]
    assert none.ngram_proposal is None  # type: ignore[attr-defined]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=64), st.booleans())
def test_round_trip_in_both_forms(proposal: list[int], columns: bool) -> None:
    s = pb.StepReport.FromString(_step(proposal, columns=columns).SerializeToString())
    (obs,) = _validate(s)
    assert obs.ngram_proposal.dtype == np.int32 and obs.ngram_proposal.tolist() == proposal  # type: ignore[attr-defined]
    assert observation_from_pb(s).ngram_proposal.tolist() == proposal  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("bad", "reason", "where"),
    [
        (_step([0, 9, 0], columns=True), "ngram_proposal_gt_max", "steps[1].columns.ngram_proposal[1]"),
        (
            _step([0, 0, 2**32 - 1], columns=False),
            "ngram_proposal_gt_max",
            "steps[1].requests[2].ngram_proposal",
        ),
    ],
)
def test_out_of_range_names_the_entry(bad: pb.StepReport, reason: str, where: str) -> None:
    with pytest.raises(TelemetryError) as e:
        _validate(_step([1, 1, 1], columns=True), bad)
    assert e.value.reason == reason
    assert str(e.value).startswith(where + ":"), str(e.value)


def test_a_column_of_the_wrong_length_is_refused() -> None:
    s = _step([1, 2, 3], columns=True)
    del s.columns.ngram_proposal[2]
    with pytest.raises(TelemetryError) as e:
        _validate(s)
    assert e.value.reason == "columns_length" and "steps[0].columns.ngram_proposal" in str(e.value)


def test_rows_report_it_on_every_row_or_none() -> None:
    s = _step([1, 2, 3], columns=False)
    s.requests[1].ClearField("ngram_proposal")
    with pytest.raises(TelemetryError) as e:
        _validate(s)
    assert e.value.reason == "ngram_proposal_partial" and str(e.value).startswith(
        "steps[0].requests[1].ngram_proposal"
    )
    assert ngram_proposal_from_pb(_step(None, columns=False)) is None
