"""``NaN``, ``Infinity`` and ``-Infinity`` in a JSON Lines file: Python's json reads them, JSON has none.

What must hold: every reader that goes through ``load_json_line`` refuses them, ``FILE:LINE: field:``
naming where (the trace header's free-form ``meta`` took them, and ``trace import`` wrote them back out),
and the trace writer never writes one.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from sim.trace import TraceError, load_json_line, read_trace, trace_lines
from tests.sim.conftest import HEADER, write_lines

ROW = {
    "id": "a",
    "class": "chat",
    "prompt_tokens": 3,
    "output_tokens": 2,
    "acc": {"eagle3": [1, 0], "ngram": [0, 0]},
}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_the_header_meta_refuses_a_constant(tmp_path: Path, constant: str) -> None:
    p = tmp_path / "t.jsonl"
    header = json.dumps({**HEADER, "meta": {"model": "m", "x": [1, "__C__"]}}).replace('"__C__"', constant)
    p.write_text(header + "\n" + json.dumps(ROW) + "\n")
    with pytest.raises(TraceError) as e:  # was read, meta {"x": [1, nan]}
        read_trace(p)
    assert str(e.value) == f"{p}:1: meta.x[1]: {constant} is not a JSON number"


def test_a_string_naming_a_constant_is_text() -> None:
    assert load_json_line('{"a": "NaN", "b": "Infinity"}', source="f", line=1) == {
        "a": "NaN",
        "b": "Infinity",
    }


def test_the_writer_refuses_a_non_finite_meta(tmp_path: Path) -> None:
    trace = read_trace(write_lines(tmp_path / "t.jsonl", HEADER, ROW))
    with pytest.raises(TraceError, match="meta: cannot be written as JSON"):
        list(trace_lines(replace(trace, meta={"x": math.inf})))  # wrote "Infinity"
