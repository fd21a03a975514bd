"""The same step sent as rows and as columns gives the same StepObservation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, TelemetryError, validate_batch
from controller.wire.codec import (
    decode_columns,
    encode_columns,
    observation_from_pb,
    request_columns,
    request_steps,
)
from policies.arms import METHOD_CODES, Arm, Method
from policies.engine import EngineInfo
from policies.observation import NOT_SCORED, StepObservation

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


# -- one encoder, one decoder: round trips at realistic sizes and at the types' edges -------------

INT32_MAX = (1 << 31) - 1
MAX_K = 64  # validation's largest max_k
WIDE = EngineInfo(
    engine_id="e",
    model="m",
    max_k=MAX_K,
    arms=(Arm(Method.EAGLE3, 3), Arm(Method.NGRAM, 2), Arm(Method.OFF, 0)),
    max_batch_size=4096,
)


@dataclass(frozen=True)
class Encoded:
    """What an engine put in: one step's arrays (``class_index`` into ``class_names``)."""

    class_names: tuple[str, ...]
    class_index: np.ndarray
    method: np.ndarray
    k: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    request_id: tuple[str, ...]
    cf: np.ndarray
    finished: np.ndarray
    proposal: np.ndarray | None

    def encode(self, step_no: int, *, packed: bool = False) -> pb.StepReport:
        return pb.StepReport(
            time_s=float(step_no),
            duration_s=0.01,
            batch_size=len(self.k),
            columns=encode_columns(
                class_names=self.class_names,
                class_index=self.class_index,
                method=self.method,
                k=self.k,
                drafted=self.drafted,
                accepted=self.accepted,
                request_id=self.request_id,
                counterfactual={Method.NGRAM: self.cf},
                finished=self.finished,
                ngram_proposal=self.proposal,
                packed=packed,
            ),
        )

    def check(self, obs: StepObservation) -> None:
        """The decoded step is what was encoded."""
        names = tuple(c or "default" for c in self.class_names)
        assert obs.traffic_class == tuple(names[i] for i in self.class_index.tolist())
        assert obs.request_id == self.request_id
        for name in ("method", "k", "drafted", "accepted", "finished"):
            assert np.array_equal(getattr(obs, name), getattr(self, name)), name
        if (self.cf != NOT_SCORED).any():
            assert np.array_equal(obs.counterfactual[Method.NGRAM], self.cf)
        else:
            assert obs.counterfactual == {}  # a column nobody scored is left out
        if self.proposal is None:
            assert obs.ngram_proposal is None
        else:
            assert obs.ngram_proposal is not None and np.array_equal(obs.ngram_proposal, self.proposal)


def _step(rng: np.random.Generator, n: int, *, hi: int, cf_hi: int, table: tuple[str, ...]) -> Encoded:
    """n requests with values in 0..hi, the edges (0 and hi) always present once n allows."""
    k = rng.integers(0, hi, n, endpoint=True)
    k[0] = hi
    k[-1] = 0 if n > 1 else k[-1]
    drafted = np.minimum(k, rng.integers(0, hi, n, endpoint=True))
    accepted = np.minimum(drafted, rng.integers(0, hi, n, endpoint=True))
    cf = rng.integers(NOT_SCORED, cf_hi, n, endpoint=True)
    if rng.random() < 0.2:
        cf[:] = NOT_SCORED
    else:
        cf[0] = cf_hi
    codes = [METHOD_CODES[m] for m in (Method.EAGLE3, Method.NGRAM, Method.OFF)]
    method = rng.choice(codes, n).astype(np.int8)
    method[0] = METHOD_CODES[Method.EAGLE3]  # keeps k = hi
    off = method == METHOD_CODES[Method.OFF]  # drafts nothing (the sidecar refuses an off row with a K)
    k[off] = drafted[off] = accepted[off] = 0
    return Encoded(
        class_names=table,
        class_index=rng.integers(0, len(table), n),
        method=method,
        k=k.astype(np.int32),
        drafted=drafted.astype(np.int32),
        accepted=accepted.astype(np.int32),
        request_id=tuple(f"req-{rng.integers(1 << 62)}" for _ in range(n)),
        cf=cf.astype(np.int32),
        finished=rng.random(n) < 0.1,
        proposal=rng.integers(0, hi, n, endpoint=True).astype(np.int32) if rng.random() < 0.5 else None,
    )


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 1024),
    st.integers(1, 512),
    st.integers(1, 40),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["repeated", "packed", "mixed"]),
)
def test_a_batch_round_trips_through_the_sidecars_decoder(
    steps: int, requests: int, classes: int, seed: int, form: str
) -> None:
    """Encoded by the engines' encoder, read back by validation (the sidecar's decoder): the same
    arrays, whether the steps come packed (protocol 2), in repeated fields, or both in one batch."""
    rng = np.random.default_rng(seed)
    table = ("", *(f"class-{i}" for i in range(classes - 1)))  # "" is the default class
    sent = [
        _step(rng, int(rng.integers(1, requests, endpoint=True)), hi=MAX_K, cf_hi=MAX_K, table=table)
        for _ in range(steps)
    ]
    packed = [form == "packed" or (form == "mixed" and bool(rng.random() < 0.5)) for _ in sent]
    batch = pb.StepReportBatch(
        sequence=1, steps=[s.encode(i, packed=p) for i, (s, p) in enumerate(zip(sent, packed, strict=True))]
    )
    batch = pb.StepReportBatch.FromString(batch.SerializeToString())
    got = validate_batch(batch, WIDE, Limits(max_steps_per_batch=1024, max_requests_per_step=512))
    assert len(got) == steps
    for s, obs in zip(sent, got, strict=True):
        s.check(obs)


@pytest.mark.parametrize("packed", [False, True])
def test_the_largest_batch_round_trips(packed: bool) -> None:
    """1024 steps of 512 requests each: the limits' corner, through the wire and validation."""
    rng = np.random.default_rng(7)
    sent = [_step(rng, 512, hi=MAX_K, cf_hi=MAX_K, table=("code", "chat")) for _ in range(1024)]
    batch = pb.StepReportBatch.FromString(
        pb.StepReportBatch(
            sequence=1, steps=[s.encode(i, packed=packed) for i, s in enumerate(sent)]
        ).SerializeToString()
    )
    got = validate_batch(batch, WIDE, Limits(max_steps_per_batch=1024, max_requests_per_step=512))
    for s, obs in zip(sent, got, strict=True):
        s.check(obs)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 512), st.integers(0, 2**32 - 1))
def test_values_to_the_types_edges_round_trip(n: int, seed: int) -> None:
    """Beyond what validation allows but within the wire's types (counts to 2^31 - 1 in int32,
    counterfactuals to int32 max): the codec itself loses nothing."""
    s = _step(np.random.default_rng(seed), n, hi=INT32_MAX, cf_hi=INT32_MAX, table=("a", "b", "c"))
    for packed in (False, True):
        s.check(observation_from_pb(pb.StepReport.FromString(s.encode(0, packed=packed).SerializeToString())))


def test_a_value_outside_uint32_is_refused_packed_as_in_repeated_fields() -> None:
    for packed in (False, True):
        with pytest.raises(ValueError):
            encode_columns(
                class_names=("a",), class_index=np.zeros(2, np.int64), method=np.zeros(2, np.int8),
                k=np.array([1, -1]), drafted=np.zeros(2), accepted=np.zeros(2), packed=packed,
            )  # fmt: skip


def test_only_the_used_classes_go_on_the_wire_in_table_order() -> None:
    cols = encode_columns(
        class_names=("a", "b", "c", "d"),
        class_index=np.array([3, 1, 3]),
        method=np.zeros(3, dtype=np.int8),
        k=np.ones(3, dtype=np.int32),
        drafted=np.ones(3, dtype=np.int32),
        accepted=np.zeros(3, dtype=np.int32),
    )
    assert list(cols.classes) == ["b", "d"] and list(cols.traffic_class) == [1, 0, 1]
    assert not cols.request_id and not cols.finished and not cols.ngram_proposal and not cols.counterfactual


def test_decode_keeps_what_validation_must_judge() -> None:
    """The decoder reads columns as sent (ragged, repeated, unknown): validation names the fault."""
    c = pb.RequestColumns(
        classes=["a"],
        traffic_class=[0, 5],
        method=[0],
        k=[1, 2],
        drafted=[1],
        accepted=[0, 0],
        counterfactual=[
            pb.CounterfactualColumn(method="ngram", accepted=[1]),
            pb.CounterfactualColumn(method="ngram", accepted=[1, 2, 3]),
        ],
    )
    d = decode_columns(c)
    assert d.n == 2 and d.traffic_class.tolist() == [0, 5] and d.drafted.tolist() == [1]
    assert [(m, v.tolist()) for m, v in d.counterfactual] == [("ngram", [1]), ("ngram", [1, 2, 3])]
    assert d.finished is None and d.ngram_proposal is None and d.request_id == ()


def test_a_huge_ngram_proposal_is_refused_not_wrapped() -> None:
    """uint32 max read as int32 would be -1 and pass; the decoder reads int64 so validation sees it."""
    s = _step(np.random.default_rng(1), 3, hi=4, cf_hi=4, table=("a",))
    step = s.encode(0)
    step.columns.ngram_proposal[:] = [0, 2**32 - 1, 1]
    with pytest.raises(TelemetryError, match=r"steps\[0\]\.columns\.ngram_proposal\[1\]: 4294967295 exceeds"):
        validate_batch(pb.StepReportBatch(sequence=1, steps=[step]), WIDE, Limits())
