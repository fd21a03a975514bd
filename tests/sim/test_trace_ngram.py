"""spectrace v1 ``ngram_proposal`` and ``meta.ngram``: reading, writing, validation as FILE:LINE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policies.arms import Method
from sim.trace import read_trace, trace_lines, validate_trace, write_trace
from sim.traffic import generate
from tests.sim.conftest import HEADER, write_lines

NG_HEADER = {**HEADER, "meta": {"ngram": {"min_n": 4, "max_n": 5}}}


def _req(rid: str, ngram: list[int], proposal: list[int] | None, **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "id": rid,
        "output_tokens": len(ngram),
        "acc": {"eagle3": [0] * len(ngram), "ngram": ngram},
    }
    if proposal is not None:
        r["ngram_proposal"] = proposal
    return {**r, **extra}


def test_proposal_is_read_flat_and_round_trips(tmp_path: Path) -> None:
    p = write_lines(
        tmp_path / "t.jsonl",
        NG_HEADER,
        _req("a", [0, 3, 2, 1, 0], [0, 4, 4, 4, 4]),
        _req("b", [0, 1, 0], [0, 1, 0]),
    )
    t = read_trace(p)
    assert t.has_ngram_proposal and t.ngram_proposal is not None
    assert t.ngram_proposal.dtype == np.int32
    assert t.ngram_proposal.tolist() == [0, 4, 4, 4, 4, 0, 1, 0]
    assert t.meta["ngram"] == {"min_n": 4, "max_n": 5}
    assert t.subset([1]).ngram_proposal.tolist() == [0, 1, 0]  # type: ignore[union-attr]
    out = tmp_path / "copy.jsonl.gz"
    write_trace(t, out)
    u = read_trace(out)
    assert u.ngram_proposal.tolist() == t.ngram_proposal.tolist()  # type: ignore[union-attr]
    assert validate_trace(out) == []


def test_traces_without_the_signal_still_read(hand_trace: Path) -> None:
    t = read_trace(hand_trace)
    assert t.ngram_proposal is None and not t.has_ngram_proposal
    assert all('"ngram_proposal"' not in line for line in trace_lines(t))


@pytest.mark.parametrize(
    ("row", "field", "words"),
    [
        (_req("x", [0, 0], [0]), "ngram_proposal", "length 1 != output_tokens 2"),
        (_req("x", [0, 0], [0, 5]), "ngram_proposal[1]", "0..4 (max_k)"),
        (_req("x", [0, 0], [-1, 0]), "ngram_proposal[0]", "0..4"),
        (_req("x", [0, 0], [0, True]), "ngram_proposal[1]", "0..4"),
        (_req("x", [0, 0], "no"), "ngram_proposal", "must be a list"),
        (_req("x", [0, 2], [0, 0]), "acc.ngram[1]", "cannot accept more than it proposes"),
        (_req("x", [0, 3], [0, 2]), "acc.ngram[1]", "cannot accept more than it proposes"),
    ],
)
def test_bad_proposals_name_line_and_field(
    tmp_path: Path, row: dict[str, Any], field: str, words: str
) -> None:
    ok = _req("ok", [0, 5, 4], [0, 4, 4])  # a full-length proposal may accept past max_k
    p = write_lines(tmp_path / "bad.jsonl", NG_HEADER, ok, row)
    (e,) = validate_trace(p)
    assert (e.line, e.field) == (3, field)
    assert words in e.message
    assert str(e).startswith(f"{p}:3: {field}: ")


def test_proposal_all_or_none(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "part.jsonl", NG_HEADER, _req("a", [0, 1], [0, 1]), _req("b", [0, 0], None))
    (e,) = validate_trace(p)
    assert (e.line, e.field) == (3, "ngram_proposal") and "all or none" in e.message


@pytest.mark.parametrize(
    ("ngram", "field"),
    [
        ([4, 5], "meta.ngram"),
        ({"min_n": 0, "max_n": 5}, "meta.ngram.min_n"),
        ({"min_n": 4, "max_n": 3}, "meta.ngram.max_n"),
        ({"min_n": 4}, "meta.ngram.max_n"),
        ({"min_n": 4.0, "max_n": 5}, "meta.ngram.min_n"),
    ],
)
def test_bad_meta_ngram(tmp_path: Path, ngram: Any, field: str) -> None:
    p = write_lines(tmp_path / "h.jsonl", {**HEADER, "meta": {"ngram": ngram}}, _req("a", [0, 0], [0, 0]))
    (e,) = validate_trace(p)
    assert (e.line, e.field) == (1, field)


def test_generated_traces_carry_a_valid_signal(tmp_path: Path) -> None:
    t = generate("mixed", n_requests=60, seed=3)
    p = tmp_path / "gen.jsonl"
    write_trace(t, p)
    assert validate_trace(p) == []
    u = read_trace(p)
    assert u.ngram_proposal is not None and u.meta["ngram"] == {"min_n": 4, "max_n": 5}


def test_ngram_counts_drawn_from_alpha_never_exceed_the_proposal(tmp_path: Path) -> None:
    # Given counts above the proposal are refused; drawn ones (alpha 1.0 at every position would
    # accept the whole draft) must be held to the same rule, none where the matcher finds nothing.
    proposal = [0, 2, 0, 4, 1, 0] * 50
    req = _req("a", [0] * len(proposal), proposal)
    req["acc"]["ngram"] = {"alpha": [1.0] * HEADER["max_k"]}
    t = read_trace(write_lines(tmp_path / "t.jsonl", NG_HEADER, req))
    drawn = t.acc[Method.NGRAM]
    assert drawn.tolist() == proposal
