from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from policies.arms import Method
from sim.trace import TraceError, read_trace, sample_counts, validate_trace, write_trace
from tests.sim.conftest import HEADER, write_lines


def test_reads_columns(hand_trace: Path) -> None:
    t = read_trace(hand_trace)
    assert t.ids == ("a", "b")
    assert t.classes == ("chat", "code")
    assert t.output_tokens.tolist() == [6, 4]
    assert t.offsets.tolist() == [0, 6, 10]
    assert t.acc[Method.EAGLE3].tolist() == [2, 0, 3, 0, 0, 0, 5, 5, 5, 5]
    assert t.acc[Method.NGRAM].tolist() == [0] * 6 + [3, 2, 1, 0]
    assert not t.has_arrivals
    assert t.name == "hand"


def test_gzip_round_trip(hand_trace: Path, tmp_path: Path) -> None:
    t = read_trace(hand_trace)
    gz = tmp_path / "copy.jsonl.gz"
    write_trace(t, gz)
    assert gz.read_bytes()[:2] == b"\x1f\x8b"
    u = read_trace(gz)
    assert u.ids == t.ids
    for m in t.methods:
        assert u.acc[m].tolist() == t.acc[m].tolist()
    assert validate_trace(gz) == []


def test_alpha_is_materialised_with_a_seed(tmp_path: Path) -> None:
    p = write_lines(
        tmp_path / "alpha.jsonl",
        {"spectrace": 1, "max_k": 3, "methods": ["eagle3"]},
        {"id": "x", "output_tokens": 5000, "acc": {"eagle3": {"alpha": [1.0, 0.5, 0.0]}}},
    )
    a = read_trace(p, seed=1).acc[Method.EAGLE3]
    assert set(np.unique(a).tolist()) == {1, 2}  # position 1 always, position 3 never
    assert 0.45 < float((a == 2).mean()) < 0.55
    assert read_trace(p, seed=1).acc[Method.EAGLE3].tolist() == a.tolist()


def test_sample_counts_follows_conditional_probabilities() -> None:
    c = sample_counts([0.8, 0.5], 20000, np.random.default_rng(0))
    assert abs(float((c >= 1).mean()) - 0.8) < 0.02
    assert abs(float((c >= 2).mean()) - 0.4) < 0.02


@pytest.mark.parametrize(
    ("row", "line", "field"),
    [
        ('{"id": "a", "output_tokens": 2, "acc": {"eagle3": [1, 0], "ngram": [0]}}', 3, "acc.ngram"),
        ('{"id": "a", "output_tokens": 0, "acc": {"eagle3": [], "ngram": []}}', 3, "output_tokens"),
        ('{"id": "a", "output_tokens": 2, "acc": {"eagle3": [1, -1], "ngram": [0, 0]}}', 3, "acc.eagle3[1]"),
        ('{"id": "a", "output_tokens": 2, "acc": {"eagle3": [1, 0]}}', 3, "acc.ngram"),
        (
            '{"id": "a", "output_tokens": 2, "acc": {"eagle3": [1, 0], "ngram": [0, 0], "medusa": [0, 0]}}',
            3,
            "acc.medusa",
        ),
        (
            '{"id": "a", "output_tokens": 2, "acc": {"eagle3": {"alpha": [0.5, 2, 0, 0]}, "ngram": [0, 0]}}',
            3,
            "acc.eagle3.alpha[1]",
        ),
        (
            '{"id": "a", "output_tokens": 2, "arrival_s": -1, "acc": {"eagle3": [0, 0], "ngram": [0, 0]}}',
            3,
            "arrival_s",
        ),
        ("{not json", 3, ""),
    ],
)
def test_errors_name_line_and_field(tmp_path: Path, row: str, line: int, field: str) -> None:
    ok = {"id": "ok", "output_tokens": 1, "acc": {"eagle3": [0], "ngram": [0]}}
    p = write_lines(tmp_path / "bad.jsonl", HEADER, ok, row)
    errors = validate_trace(p)
    assert len(errors) == 1
    e = errors[0]
    assert (e.line, e.field) == (line, field)
    assert str(e).startswith(f"{p}:{line}: ")
    with pytest.raises(TraceError) as exc:
        read_trace(p)
    assert str(exc.value) == str(e)


def test_header_errors(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "h.jsonl", {"spectrace": 2, "max_k": 4, "methods": ["eagle3"]})
    assert [(e.line, e.field) for e in validate_trace(p)] == [(1, "spectrace")]
    p = write_lines(tmp_path / "h2.jsonl", {"spectrace": 1, "max_k": 0, "methods": ["eagle3", "off"]})
    assert [(e.line, e.field) for e in validate_trace(p)] == [(1, "max_k"), (1, "methods[1]")]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert [e.line for e in validate_trace(empty)] == [1]


def test_duplicate_ids_and_partial_arrivals(tmp_path: Path) -> None:
    r = {"id": "a", "output_tokens": 1, "acc": {"eagle3": [0], "ngram": [0]}}
    p = write_lines(tmp_path / "d.jsonl", HEADER, r, r)
    (e,) = validate_trace(p)
    assert (e.line, e.field) == (3, "id") and "line 2" in e.message
    p = write_lines(tmp_path / "arr.jsonl", HEADER, {**r, "arrival_s": 0.5}, {**r, "id": "b"})
    (e,) = validate_trace(p)
    assert (e.line, e.field) == (3, "arrival_s")


def test_every_error_is_collected_with_its_line(tmp_path: Path) -> None:
    bad = {"id": "a", "output_tokens": 2, "acc": {"eagle3": [0], "ngram": [0, 0]}}
    p = write_lines(tmp_path / "many.jsonl", HEADER, bad, {**bad, "id": "b"}, {**bad, "id": "c"})
    assert [e.line for e in validate_trace(p)] == [2, 3, 4]


def test_corrupt_gzip_is_one_error(tmp_path: Path) -> None:
    p = tmp_path / "broken.jsonl.gz"
    p.write_bytes(gzip.compress(json.dumps(HEADER).encode())[:-8])
    errors = validate_trace(p)
    assert len(errors) == 1 and str(errors[0]).startswith(str(p))


def test_arrival_all_or_none_names_the_line_of_the_request_without_one(tmp_path: Path) -> None:
    # It counted requests, not lines: blank lines and refused requests moved it (line 3 was blank).
    hdr = {"spectrace": 1, "max_k": 4, "methods": ["eagle3"]}
    a = {"id": "a", "arrival_s": 1, "output_tokens": 3, "acc": {"eagle3": [1, 0, 0]}}
    b = {"id": "b", "output_tokens": 3, "acc": {"eagle3": [1, 0, 0]}}
    p = write_lines(tmp_path / "al.jsonl", hdr, "", "", "", a, "", b)
    errors = validate_trace(p)
    assert [(e.line, e.field) for e in errors] == [(7, "arrival_s")]


def test_a_key_given_twice_or_a_version_that_is_not_an_integer_is_refused(tmp_path: Path) -> None:
    # JSON keeps the last of two equal keys: "max_k": 4, "max_k": 2 read as 2 without a word
    row = '{"id": "a", "output_tokens": 2, "output_tokens": 3, "acc": {"eagle3": [1, 0, 0]}}'
    p = write_lines(
        tmp_path / "d.jsonl", '{"spectrace": 1, "max_k": 4, "max_k": 2, "methods": ["eagle3"]}', row
    )
    errors = validate_trace(p)
    assert (errors[0].line, str(errors[0])) == (1, f"{p}:1: max_k: given twice in one object")
    p = write_lines(tmp_path / "r.jsonl", {"spectrace": 1, "max_k": 4, "methods": ["eagle3"]}, row)
    assert [str(e) for e in validate_trace(p)] == [f"{p}:2: output_tokens: given twice in one object"]
    for version in (True, 1.0):  # both compared equal to 1
        p = write_lines(tmp_path / "v.jsonl", {"spectrace": version, "max_k": 4, "methods": ["eagle3"]})
        assert [(e.line, e.field) for e in validate_trace(p)] == [(1, "spectrace")]
