"""The plugin's step record on the wire: columns that the sidecar reads as the rows form read before."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, validate_batch
from controller.vllm.record import StepRecord
from controller.wire.codec import request_steps
from policies.arms import METHOD_CODES, METHODS_BY_CODE, Arm, Method
from policies.engine import EngineInfo, Granularity
from policies.observation import NOT_SCORED, StepObservation
from tests.controller.wire.test_codec import same_observation

ENGINE = EngineInfo(
    "e", "m", 4, tuple(Arm.parse(a) for a in ("eagle3:2", "ngram:4", "off")), Granularity.REQUEST_METHOD
)


def record(cf: list[int]) -> StepRecord:
    codes = [METHOD_CODES[m] for m in (Method.EAGLE3, Method.NGRAM, Method.OFF, Method.EAGLE3)]
    return StepRecord(
        time_s=5.0, duration_s=0.02, batch_size=6, queue_length=3, queue_wait_s=0.1, scheduled_k=2,
        directive_version=7, request_id=("a", "b", "c", "d"), class_names=("default", "chat", "code", ""),
        class_index=np.array([1, 2, 1, 3], dtype=np.int32),
        method=np.array(codes, dtype=np.int8), k=np.array([2, 4, 0, 2], dtype=np.int32),
        drafted=np.array([2, 4, 0, 1], dtype=np.int32), accepted=np.array([1, 3, 0, 1], dtype=np.int32),
        cf_ngram=np.array(cf, dtype=np.int32), finished=np.array([False, True, False, False]),
    )  # fmt: skip


def as_rows(r: StepRecord) -> pb.StepReport:
    """The per-request form the plugin sent before."""
    return pb.StepReport(
        time_s=r.time_s, duration_s=r.duration_s, batch_size=r.batch_size, queue_length=r.queue_length,
        queue_wait_s=r.queue_wait_s, scheduled_k=r.scheduled_k, directive_version=r.directive_version,
        requests=request_steps(
            request_ids=r.request_id, classes=[r.class_names[i] for i in r.class_index],
            methods=[METHODS_BY_CODE[int(c)].value for c in r.method], ks=r.k, drafted=r.drafted,
            accepted=r.accepted, counterfactual={"ngram": r.cf_ngram}, finished=r.finished,
        ),
    )  # fmt: skip


def _validated(step: pb.StepReport) -> StepObservation:
    """The step as the sidecar reads it (a report of one step)."""
    (obs,) = validate_batch(pb.StepReportBatch(sequence=1, steps=[step]), ENGINE, Limits())
    return obs


@pytest.mark.parametrize("cf", [[2, NOT_SCORED, 0, 1], [NOT_SCORED] * 4])
def test_columns_read_as_the_rows_did(cf: list[int]) -> None:
    r = record(cf)
    msg = r.to_pb()
    assert msg.HasField("columns") and not msg.requests
    assert msg.directive_version == 7 and list(msg.columns.classes) == ["chat", "code", ""]
    # An all-unscored n-gram column is left out, as rows leave their map entry out.
    assert len(msg.columns.counterfactual) == (0 if cf == [NOT_SCORED] * 4 else 1)
    same_observation(_validated(msg), _validated(as_rows(r)))


def test_prefill_tokens_travel_with_the_step() -> None:
    r = dataclasses.replace(record([NOT_SCORED] * 4), prefill_tokens=300)
    assert r.to_pb().prefill_tokens == 300
    assert _validated(r.to_pb()).prefill_tokens == 300
    assert json.loads(r.to_json())["prefill"] == 300


def test_ngram_proposal_travels_with_the_step_or_not_at_all() -> None:
    plain = record([NOT_SCORED] * 4)
    assert not plain.to_pb().columns.ngram_proposal
    assert _validated(plain.to_pb()).ngram_proposal is None
    assert all("ngram_proposal" not in r for r in json.loads(plain.to_json())["reqs"])
    r = dataclasses.replace(plain, ngram_proposal=np.array([0, 4, 2, 0], dtype=np.int32))
    assert list(r.to_pb().columns.ngram_proposal) == [0, 4, 2, 0]
    obs = _validated(r.to_pb())
    assert obs.ngram_proposal is not None and obs.ngram_proposal.tolist() == [0, 4, 2, 0]
    assert [x["ngram_proposal"] for x in json.loads(r.to_json())["reqs"]] == [0, 4, 2, 0]
    # A proposal beyond the engine's max K is refused by the sidecar, naming the row.
    bad = dataclasses.replace(plain, ngram_proposal=np.array([0, 5, 2, 0], dtype=np.int32))
    with pytest.raises(ValueError, match=r"ngram_proposal"):
        _validated(bad.to_pb())
