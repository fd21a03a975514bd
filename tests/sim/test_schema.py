from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sim.trace import trace_lines
from sim.traffic import generate

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "spectrace.schema.json").read_text())


def _validator(part: str) -> Any:
    sub = {"$schema": SCHEMA["$schema"], "$defs": SCHEMA["$defs"], "$ref": f"#/$defs/{part}"}
    jsonschema.Draft202012Validator.check_schema(sub)
    return jsonschema.Draft202012Validator(sub)


def test_written_traces_match_the_schema(hand_trace: Path) -> None:
    lines = [json.loads(x) for x in trace_lines(generate("load-ramp", n_requests=5, seed=1))]
    lines += [json.loads(x) for x in hand_trace.read_text().splitlines()]
    header, request = _validator("header"), _validator("request")
    for obj in lines:
        (header if "spectrace" in obj else request).validate(obj)


@pytest.mark.parametrize(
    "bad",
    [
        {"id": "", "output_tokens": 1, "acc": {"eagle3": [0]}},
        {"id": "a", "output_tokens": 0, "acc": {"eagle3": []}},
        {"id": "a", "output_tokens": 1, "acc": {"medusa": [0]}},
        {"id": "a", "output_tokens": 1, "acc": {"eagle3": {"alpha": [1.5]}}},
        {"id": "a", "output_tokens": 1, "arrival_s": -2, "acc": {"eagle3": [0]}},
    ],
)
def test_schema_rejects_what_the_validator_rejects(bad: dict[str, Any]) -> None:
    assert list(_validator("request").iter_errors(bad))
