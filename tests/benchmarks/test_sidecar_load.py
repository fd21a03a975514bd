"""The load generator of benchmarks/sidecar_load.py sends what it claims: each pre-encoded report
batch parses as the template batch with its own sequence (the generator appends the sequence to the
template's bytes instead of building a message per send)."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sidecar_load  # noqa: E402


@given(
    seq=st.integers(1, (1 << 53) - 1),
    steps=st.integers(1, 20),
    batch=st.integers(1, 64),
    rows=st.booleans(),
)
def test_each_encoded_batch_is_the_template_with_its_sequence(
    seq: int, steps: int, batch: int, rows: bool
) -> None:
    template = sidecar_load._batch(0, steps, batch, 0.0, rows=rows)
    got = pb.EngineMessage.FromString(sidecar_load._encoded_reports(template)(seq))
    want = pb.StepReportBatch()
    want.CopyFrom(template)
    want.sequence = seq
    assert got.WhichOneof("body") == "reports"
    assert got.reports == want


def test_messages_and_bytes_go_out_as_the_same_bytes() -> None:
    hello = pb.EngineMessage(hello=pb.Hello(engine_id="e"))
    assert sidecar_load._serialize(hello) == hello.SerializeToString()
    assert sidecar_load._serialize(b"\x12\x00") == b"\x12\x00"
