"""A step's prefill tokens reach the observation in both forms; an absurd count is refused by name."""

from __future__ import annotations

import pytest

from controller.v1 import controller_pb2 as pb
from controller.validation import MAX_PREFILL_TOKENS, TelemetryError, validate_batch
from controller.wire.codec import observation_from_pb, request_steps
from tests.controller.test_validation_columns import DEFAULT_LIMITS, ENGINE, step


def rows_step(**kw: object) -> pb.StepReport:
    reqs = request_steps(
        request_ids=["a"], classes=["code"], methods=["eagle3"], ks=[2], drafted=[2], accepted=[1]
    )
    return pb.StepReport(time_s=1.0, duration_s=0.02, batch_size=1, requests=reqs, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("form", ["columns", "rows"])
def test_prefill_tokens_reach_the_observation(form: str) -> None:
    s = step(prefill_tokens=512) if form == "columns" else rows_step(prefill_tokens=512)
    (obs,) = validate_batch(pb.StepReportBatch(sequence=1, steps=[s]), ENGINE, DEFAULT_LIMITS)
    assert obs.prefill_tokens == 512
    assert observation_from_pb(s).prefill_tokens == 512
    assert observation_from_pb(step()).prefill_tokens == 0  # unset: none, or an older engine


def test_absurd_prefill_is_refused_by_name() -> None:
    bad = step(prefill_tokens=MAX_PREFILL_TOKENS + 1)
    with pytest.raises(TelemetryError, match=r"steps\[1\]\.prefill_tokens: .* beyond any scheduler"):
        validate_batch(pb.StepReportBatch(sequence=1, steps=[step(), bad]), ENGINE, DEFAULT_LIMITS)
