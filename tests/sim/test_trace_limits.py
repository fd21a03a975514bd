"""Trace reader limits (issue 15, finding 7): every oversize or out-of-range input is a FILE:LINE error.

Each test is a regression test for one finding: an ``acc`` of 2^31 that validated and then overflowed
in replay, 100k nested brackets (RecursionError), a gzip holding one huge line, a one-token trace
("argmax of an empty sequence"), and files over the size limits.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sim.importer import import_token_ids, import_vllm_metrics
from sim.trace import TraceError, TraceLimits, read_trace, validate_trace
from tests.sim.conftest import HEADER, write_lines

OK = {"id": "ok", "output_tokens": 2, "acc": {"eagle3": [1, 0], "ngram": [0, 0]}}


def _one_error(p: Path, limits: TraceLimits | None = None) -> TraceError:
    kw = {} if limits is None else {"limits": limits}
    errors = validate_trace(p, **kw)
    assert len(errors) == 1, errors
    with pytest.raises(TraceError) as exc:
        read_trace(p, **kw)
    assert str(exc.value) == str(errors[0])
    return errors[0]


@pytest.mark.parametrize("value", [2**31, 2**63, 10**400])
def test_counts_beyond_int32_are_refused(tmp_path: Path, value: int) -> None:
    row = {"id": "big", "output_tokens": 2, "acc": {"eagle3": [0, value], "ngram": [0, 0]}}
    p = write_lines(tmp_path / "big.jsonl", HEADER, OK, row)
    e = _one_error(p)
    assert (e.line, e.field) == (3, "acc.eagle3[1]") and "0..2147483647" in e.message


def test_the_largest_count_is_accepted(tmp_path: Path) -> None:
    row = {"id": "max", "output_tokens": 2, "acc": {"eagle3": [0, 2**31 - 1], "ngram": [0, 0]}}
    t = read_trace(write_lines(tmp_path / "max.jsonl", HEADER, OK, row))
    assert int(t.acc[next(iter(t.acc))].max()) == 2**31 - 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("output_tokens", 2**22 + 1),
        ("output_tokens", 2**64),
        ("prompt_tokens", 2**24 + 1),
        ("arrival_s", 1e10),
    ],
)
def test_sizes_have_physical_ranges(tmp_path: Path, field: str, value: float) -> None:
    # output_tokens 2^22 + 1 with an alpha spec would otherwise allocate counts for every position.
    row = {
        "id": "x",
        "output_tokens": 2,
        "acc": {"eagle3": {"alpha": [0.5] * 4}, "ngram": {"alpha": [0.1] * 4}},
    }
    row[field] = value
    p = write_lines(tmp_path / "r.jsonl", HEADER, row)
    e = _one_error(p)
    assert (e.line, e.field) == (2, field)


@pytest.mark.parametrize("depth", [33, 100_000])
def test_deep_nesting_is_an_error_not_a_recursion_error(tmp_path: Path, depth: int) -> None:
    p = tmp_path / "deep.jsonl"
    p.write_text(json.dumps(HEADER) + "\n" + json.dumps(OK) + "\n" + "[" * depth + "]" * depth + "\n")
    e = _one_error(p)
    assert e.line == 3 and "nested deeper than 32" in e.message


def test_nesting_inside_strings_does_not_count(tmp_path: Path) -> None:
    row = {**OK, "note": "[" * 1000}
    assert read_trace(write_lines(tmp_path / "s.jsonl", HEADER, row)).n == 1


def test_a_gzip_bomb_line_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    p = tmp_path / "bomb.jsonl.gz"
    # A 4 MiB line (the finding: 0.9 MB of gzip holding one 200 MB line) against a 1 MiB line limit.
    body = json.dumps(HEADER) + "\n" + '{"id": "x", "pad": "' + "a" * (4 << 20) + '"}\n'
    p.write_bytes(gzip.compress(body.encode()))
    assert p.stat().st_size < 64 << 10
    e = _one_error(p, TraceLimits(max_line_bytes=1 << 20))
    assert e.line == 2 and "line longer than the limit of 1048576" in e.message


def test_decompressed_size_is_bounded(tmp_path: Path) -> None:
    p = tmp_path / "many.jsonl.gz"
    rows = [json.dumps({**OK, "id": f"r{i}"}) for i in range(400)]
    p.write_bytes(gzip.compress((json.dumps(HEADER) + "\n" + "\n".join(rows) + "\n").encode()))
    e = _one_error(p, TraceLimits(max_decompressed_bytes=10_000))
    assert e.line is not None and e.line > 2 and "decompressed text exceeds" in e.message
    assert read_trace(p).n == 400  # the default limits take it


def test_file_size_is_checked_before_reading(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "f.jsonl", HEADER, OK)
    e = _one_error(p, TraceLimits(max_file_bytes=10))
    assert "over the limit of 10" in e.message and str(e).startswith(str(p))


def test_a_trace_of_one_token_requests_is_a_file_line_error(tmp_path: Path) -> None:
    one = {"id": "a", "output_tokens": 1, "acc": {"eagle3": [0], "ngram": [0]}}
    p = write_lines(tmp_path / "one.jsonl", HEADER, one, {**one, "id": "b"})
    e = _one_error(p)
    assert (e.line, e.field) == (2, "output_tokens") and ">= 2" in e.message
    # One-token requests beside a longer one replay normally.
    assert read_trace(write_lines(tmp_path / "mixed.jsonl", HEADER, one, OK)).n == 2


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_line_bytes"):
        TraceLimits(max_line_bytes=0)


def test_importers_share_the_limits(tmp_path: Path) -> None:
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 50_000 + "]" * 50_000 + "\n")
    for fn in (import_vllm_metrics, import_token_ids):
        with pytest.raises(TraceError) as exc:
            fn(deep)  # type: ignore[operator]
        assert str(exc.value).startswith(f"{deep}:1: ")
    big = tmp_path / "huge.jsonl"
    big.write_text('{"prompt_token_ids": [1], "output_token_ids": [' + ",".join(["1"] * 3000) + "]}\n")
    with pytest.raises(TraceError, match=r"huge.jsonl:1: line longer"):
        import_token_ids(big, limits=TraceLimits(max_line_bytes=1000))


def test_an_integer_too_long_to_convert_is_a_file_line_error(tmp_path: Path) -> None:
    # Python's int-string conversion limit raised a ValueError that was not a JSONDecodeError: a traceback.
    p = tmp_path / "long.jsonl"
    p.write_text(
        json.dumps(HEADER) + "\n" + json.dumps(OK) + '\n{"id": "x", "output_tokens": ' + "9" * 5000 + "}\n"
    )
    e = _one_error(p)
    assert e.line == 3 and "invalid JSON: a number longer than 4300 digits" in e.message


@pytest.mark.parametrize("line", ['{"id": "x", "n": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000])
def test_the_importers_name_the_line_of_a_long_integer_or_deep_nesting(tmp_path: Path, line: str) -> None:
    p = tmp_path / "in.jsonl"
    p.write_text("\n" + line + "\n")
    for importer in (import_vllm_metrics, import_token_ids):
        with pytest.raises(TraceError) as exc:
            importer(p)
        assert str(exc.value).startswith(f"{p}:2: ") and (
            "longer than 4300 digits" in exc.value.message or "nested deeper" in exc.value.message
        )


def test_a_gzip_of_blank_lines_is_refused_at_the_blank_line_limit(tmp_path: Path) -> None:
    # 400M newlines in 400 KB of gzip hung every trace reader (one readline per blank line).
    p = tmp_path / "nl.jsonl.gz"
    p.write_bytes(gzip.compress((json.dumps(HEADER) + "\n" + json.dumps(OK) + "\n" + "\n" * 5000).encode()))
    e = _one_error(p, TraceLimits(max_blank_lines=1000))
    assert e.line == 1003 and "more than 1000 blank lines" in e.message
    assert read_trace(p).n == 1  # the default limit takes a few thousand
