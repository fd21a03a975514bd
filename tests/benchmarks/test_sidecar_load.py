"""The load generator of benchmarks/sidecar_load.py sends what it claims: each pre-encoded report
batch parses as the template batch with its own sequence (the generator appends the sequence to the
template's bytes instead of building a message per send)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sidecar_load  # noqa: E402

from tests.benchmarks.usage import assert_usage_error  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "sidecar_load.py"


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


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # --seconds 0 was a ZeroDivisionError after the run
        (["--seconds", "0"], "argument --seconds: must be a number in (0, 3600], got '0'"),
        (["--engines", "0"], "argument --engines: must be an integer 1..4096, got '0'"),
        (["--steps-per-s", "nan"], "argument --steps-per-s: must be a number in (0, 100000]"),
        (["--core", "4095"], "--core: this machine has cores 0.."),
        (["--json", "NO/x.json"], "--json NO/x.json: no directory NO to write it in"),
        (["--profile", "NO/p.pstats"], "--profile NO/p.pstats: no directory NO to write it in"),
    ],
)
def test_usage_errors_exit_2_before_the_sidecar_starts(tmp_path: Path, args: list[str], says: str) -> None:
    no = str(tmp_path / "no")
    assert_usage_error(SCRIPT, [a.replace("NO", no) for a in args], says.replace("NO", no))
