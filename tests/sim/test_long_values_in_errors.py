"""Trace and import lines holding numbers of thousands of digits (JSON takes integers up to Python's
4,300-digit limit) or very long strings: each is refused as ``FILE:LINE: field: ...`` in a line of
readable length, the value shortened (``policies.params.shown``), never quoted in full.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sim.importer import import_token_ids, import_vllm_metrics
from sim.trace import TraceError, read_trace, validate_trace
from tests.sim.conftest import HEADER, write_lines

HUGE = int("9" * 4000)
OK = {"id": "a", "output_tokens": 2, "acc": {"eagle3": [1, 0], "ngram": [0, 0]}}
TOKENS = {"prompt_token_ids": [1, 2], "output_token_ids": [1, 2]}


@pytest.mark.parametrize(
    ("header", "row", "field"),
    [
        ({**HEADER, "max_k": HUGE}, OK, "max_k"),
        ({**HEADER, "spectrace": HUGE}, OK, "spectrace"),
        ({**HEADER, "meta": {"ngram": {"min_n": 1, "max_n": HUGE}}}, OK, "meta.ngram.max_n"),
        (HEADER, {**OK, "output_tokens": HUGE}, "output_tokens"),
        (HEADER, {**OK, "prompt_tokens": -HUGE}, "prompt_tokens"),
        (HEADER, {**OK, "arrival_s": HUGE}, "arrival_s"),
        (HEADER, {**OK, "acc": {"eagle3": [HUGE, 0], "ngram": [0, 0]}}, "acc.eagle3[0]"),
        (
            HEADER,
            {**OK, "acc": {"eagle3": {"alpha": [HUGE, 0, 0, 0]}, "ngram": [0, 0]}},
            "acc.eagle3.alpha[0]",
        ),
        (HEADER, {**OK, "ngram_proposal": [HUGE, 0]}, "ngram_proposal[0]"),
    ],
)
def test_a_huge_number_in_a_trace_is_named_in_a_short_line(
    tmp_path: Path, header: dict[str, Any], row: dict[str, Any], field: str
) -> None:
    p = write_lines(tmp_path / "t.jsonl", header, row)
    (err,) = validate_trace(p)
    assert err.field == field
    assert "an integer of 4000 digits" in err.message
    assert len(str(err)) < len(str(p)) + 200
    with pytest.raises(TraceError):
        read_trace(p)


def test_a_repeated_long_id_is_named_shortened(tmp_path: Path) -> None:
    row = {**OK, "id": "x" * 1_000_000}
    (err,) = validate_trace(write_lines(tmp_path / "t.jsonl", HEADER, row, row))
    assert (err.line, err.field) == (3, "id")
    assert len(err.message) < 200
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({**TOKENS, "id": "y" * 1_000_000}) + "\n" for _ in range(2)))
    with pytest.raises(TraceError) as e:
        import_token_ids(src)
    assert (e.value.line, e.value.field) == (2, "id")
    assert len(e.value.message) < 200


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({**TOKENS, "output_token_ids": [1, HUGE]}, "output_token_ids[1]"),
        ({**TOKENS, "acc": {"eagle3": [0, HUGE]}}, "acc.eagle3[1]"),
    ],
)
def test_a_huge_number_in_token_ids_is_named_in_a_short_line(
    tmp_path: Path, row: dict[str, Any], field: str
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(row) + "\n")
    with pytest.raises(TraceError) as e:
        import_token_ids(src)
    assert (e.value.line, e.value.field) == (1, field)
    assert "an integer of 4000 digits" in e.value.message and len(e.value.message) < 200


@pytest.mark.parametrize("key", ["prompt_tokens", "completion_tokens"])
def test_a_huge_usage_count_is_named_in_a_short_line(tmp_path: Path, key: str) -> None:
    usage = {"prompt_tokens": 4, "completion_tokens": 5, key: HUGE}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"usage": usage}) + "\n")
    with pytest.raises(TraceError) as e:
        import_vllm_metrics(src)
    assert (e.value.line, e.value.field) == (1, f"usage.{key}")
    assert "an integer of 4000 digits" in e.value.message and len(e.value.message) < 200
