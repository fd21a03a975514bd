"""Fuzzed engine telemetry: any bytes, any field values. Valid or TelemetryError, never a crash, and
through the sidecar every refusal is counted by reason and changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, TelemetryError, validate_batch, validate_hello
from tests.integration.test_sidecar_grpc import hello

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

METHODS = st.sampled_from(["eagle3", "ngram", "off", "p_eagle", "", "EAGLE3", "x" * 300])
U32 = st.integers(0, 2**32 - 1)
SMALL = st.integers(0, 8)
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.floats(0, 10)

requests = st.builds(
    pb.RequestStep,
    request_id=st.text(max_size=300),
    traffic_class=st.text(max_size=80),
    method=METHODS,
    k=SMALL | U32,
    drafted=SMALL | U32,
    accepted=SMALL | U32,
    counterfactual_accepted=st.dictionaries(METHODS, SMALL | U32, max_size=3),
    finished=st.booleans(),
)
steps = st.builds(
    pb.StepReport,
    time_s=FLOATS,
    duration_s=FLOATS,
    batch_size=SMALL | U32,
    queue_length=U32,
    queue_wait_s=FLOATS,
    scheduled_k=U32,
    requests=st.lists(requests, max_size=6),
    directive_version=st.integers(0, 2**64 - 1),
)
batches = st.builds(
    pb.StepReportBatch,
    sequence=st.integers(0, 2**64 - 1),
    steps=st.lists(steps, max_size=5),
    dropped_steps=st.integers(0, 2**64 - 1),
)
hellos = st.builds(
    pb.Hello,
    engine_id=st.text(max_size=200),
    model=st.text(max_size=50),
    max_k=st.integers(0, 100) | U32,
    arms=st.lists(st.builds(pb.Arm, method=METHODS, k=SMALL | U32), max_size=6),
    granularity=st.integers(0, 5),
    max_batch_size=U32,
    counterfactual_methods=st.lists(METHODS, max_size=3),
    p_eagle_partial_k_safe=st.booleans(),
    protocol_version=st.integers(0, 3),
    instance_id=st.text(max_size=200),
)


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_decode_or_fail_cleanly(raw: bytes) -> None:
    try:
        msg = pb.EngineMessage.FromString(raw)
    except DecodeError:
        return
    body = msg.WhichOneof("body")
    try:
        if body == "hello":
            validate_hello(msg.hello)
        elif body == "reports":
            validate_batch(msg.reports, _info(), Limits())
    except TelemetryError as e:
        assert e.reason and "\n" not in str(e)


@FUZZ
@given(hellos)
def test_hello_is_valid_or_refused_with_a_reason(h: pb.Hello) -> None:
    try:
        info = validate_hello(h)
    except TelemetryError as e:
        assert e.reason and "\n" not in str(e)
        return
    assert info.engine_id == h.engine_id and 1 <= info.max_k <= 64


def _info():  # type: ignore[no-untyped-def]
    return validate_hello(hello("fuzz"))


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    cfg = SidecarConfig(
        engine_listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        metrics_listen="",
        state_dir=str(tmp_path / "state"),
        max_engine_steps_per_s=1e6,
        max_engine_request_steps_per_s=1e10,  # (each example is a batch of its own, never a flood)
    )
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop(snapshot=False)


@pytest.mark.integration
async def test_fuzzed_batches_through_the_sidecar_are_counted(sidecar: Sidecar) -> None:
    info = _info()
    session = sidecar.attach(info, instance_id="fuzz")
    counts = {"refused": 0}

    def total_rejected() -> float:
        return sum(
            s.value
            for m in sidecar.registry.collect()
            if m.name == "speccontrol_rejected_telemetry"
            for s in m.samples
            if s.name.endswith("_total")
        )

    @FUZZ
    @given(batches)
    def run(batch: pb.StepReportBatch) -> None:
        st_ = session.engine
        st_.last_sequence = 0  # each example on its own: a huge sequence must not make the rest duplicates
        steps_before = st_.loop.totals.steps
        rejected_before = total_rejected()
        try:
            sidecar.ingest(session, batch)
        except TelemetryError as e:
            assert e.reason and "\n" not in str(e)
            counts["refused"] += 1
            assert total_rejected() == rejected_before + 1
            assert st_.loop.totals.steps == steps_before  # a bad batch changes nothing
            return
        assert st_.loop.totals.steps == steps_before + len(batch.steps)
        sidecar.tick()  # decisions on whatever was accepted must not fail either

    run()
    sidecar.detach(session)
    assert counts["refused"] > 0  # the fuzzer did reach the refusals
