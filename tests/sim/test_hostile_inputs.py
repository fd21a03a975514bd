"""Regression tests for the hostile-input review of the simulator's readers and CLI (findings 1-10).

Each test feeds one kind of bad input through the public reader or ``controllerctl``'s ``sim`` /
``trace`` / ``profile`` commands and checks what the rules ask: one ``FILE:LINE: field: message`` line,
exit 2, no traceback, and nothing written when the input is refused.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.params import shown
from sim.cli import main
from sim.costmodel import ProfileError, load_profile, profile_names
from sim.importer import import_token_ids, import_vllm_metrics
from sim.trace import TraceError, read_trace, validate_trace
from tests.sim.conftest import HEADER, write_lines

OK = {"id": "ok", "output_tokens": 2, "acc": {"eagle3": [1, 0], "ngram": [0, 0]}}
SHIPPED = Path(__file__).parents[2] / "sim" / "profiles" / "llama-3.1-8b-h100.yaml"
FAST = ["--scenario", "chat", "--requests", "3", "--policy", "static:eagle3:3", "--concurrency", "2"]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# -- finding 1: a header's methods holding a list or an object ---------------------------------------

json_values = st.recursive(
    # (no infinity: json.dumps writes it as Infinity, which is no JSON and refused as such)
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=json_values.filter(lambda v: v not in ("eagle3", "p_eagle", "ngram")))
def test_any_json_value_as_a_header_method_is_a_line_1_error(tmp_path: Path, method: Any) -> None:
    # ["eagle3"] or {"a": 1} crashed the reader (unhashable in a set test) with a traceback
    p = write_lines(tmp_path / "t.jsonl", {**HEADER, "methods": [method]}, OK)
    errors = validate_trace(p)
    assert [str(e) for e in errors] == [
        f"{p}:1: methods[0]: unknown method {shown(method)} (known: eagle3, p_eagle, ngram)"
    ]
    with pytest.raises(TraceError):
        read_trace(p)


def test_trace_validate_of_a_list_method_exits_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = write_lines(tmp_path / "t.jsonl", {**HEADER, "methods": [["eagle3"]]}, OK)
    assert main(["trace", "validate", str(p)]) == 2
    assert _one_line(capsys).startswith(f"{p}:1: methods[0]: unknown method ['eagle3']")


# -- finding 2: a bad output_tokens with an ngram_proposal unlike acc.ngram --------------------------


@pytest.mark.parametrize("out", [None, "x", 0])
def test_validate_collects_errors_when_output_tokens_is_bad_and_the_lists_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: Any
) -> None:
    row: dict[str, Any] = {"id": "r1", "acc": {"ngram": [0, 0, 0]}, "ngram_proposal": [1, 1]}
    if out is not None:
        row["output_tokens"] = out
    p = write_lines(tmp_path / "t.jsonl", {"spectrace": 1, "max_k": 8, "methods": ["ngram"]}, row)
    assert main(["trace", "validate", str(p)]) == 2  # was exit 1, a strict zip's ValueError
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{p}:2: output_tokens: required" in err
    assert f"{p}:2: ngram_proposal: length 2 != acc.ngram length 3" in err


# -- finding 3: lone surrogates ----------------------------------------------------------------------


def _surrogate_row(where: str) -> str:
    row = json.dumps({**OK, "class": "c", "meta_like": "m"})
    return {
        "class": row.replace('"class": "c"', '"class": "\\ud800"'),
        "id": row.replace('"id": "ok"', '"id": "o\\udfff"'),
        "extra": row.replace('"meta_like": "m"', '"meta_like": ["x", "\\udc80"]'),
        "key": row.replace('"meta_like"', '"\\ud83d"'),
    }[where]


@pytest.mark.parametrize(
    ("where", "field"),
    [("class", "class"), ("id", "id"), ("extra", "meta_like[1]"), ("key", "'\\ud83d'")],
)
def test_a_lone_surrogate_anywhere_in_a_trace_is_refused(tmp_path: Path, where: str, field: str) -> None:
    # validated "ok", then crashed the report writer (UnicodeEncodeError) with half a report written
    p = write_lines(tmp_path / "t.jsonl", HEADER, _surrogate_row(where))
    errors = validate_trace(p)
    assert [str(e) for e in errors] == [f"{p}:2: {field}: not valid Unicode (a lone UTF-16 surrogate)"]
    with pytest.raises(TraceError, match="not valid Unicode"):
        read_trace(p)


def test_a_surrogate_pair_is_text(tmp_path: Path) -> None:
    p = write_lines(
        tmp_path / "t.jsonl", HEADER, json.dumps(OK).replace("}}", '}, "class": "\\ud83d\\ude00"}')
    )
    assert read_trace(p).classes == ("\U0001f600",)


def test_import_refuses_a_surrogate_and_writes_no_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resp = tmp_path / "r.jsonl"
    resp.write_text(
        '{"id":"c1","traffic_class":"\\ud800","usage":{"prompt_tokens":10,"completion_tokens":8},'
        '"metrics":{"speculative_decoding":{"per_step_accepted":[2,0,1],"per_step_drafted":[3,3,3]}}}\n'
    )
    with pytest.raises(TraceError, match="traffic_class: not valid Unicode"):
        import_vllm_metrics(resp)
    out = tmp_path / "t.jsonl"
    assert main(["trace", "import", str(resp), "--out", str(out)]) == 2
    assert _one_line(capsys).startswith(f"{resp}:1: traffic_class: not valid Unicode")
    assert not out.exists()


def test_a_report_that_fails_leaves_nothing_behind(
    hand_trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sim.report

    def broken(*_: Any, **__: Any) -> str:
        return "\ud800"  # what a name from a non-UTF-8 file name renders as

    monkeypatch.setattr(sim.report, "markdown", broken)
    out = tmp_path / "out"
    argv = ["sim", "replay", "--trace", str(hand_trace), "--policy", "static:eagle3:3", "--concurrency", "2"]
    assert main([*argv, "--no-oracle", "--out", str(out)]) == 1
    assert not out.exists()  # was: a 0-byte report.md and the plots, no result.json
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hand.jsonl"]  # no temporary left either
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main([*argv, "--no-oracle", "--out", str(out)]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_a_directory_where_a_report_file_goes_is_refused_before_any_file_is_replaced(
    hand_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Into an existing --out the files are moved one by one: report.md was replaced, then the move of
    # result.json onto a directory failed, naming a temporary directory already deleted.
    out = tmp_path / "out"
    (out / "result.json").mkdir(parents=True)
    (out / "report.md").write_text("mine")
    from controller.cli import main as controllerctl  # its OSError handler says the path

    argv = ["sim", "replay", "--trace", str(hand_trace), "--policy", "static:eagle3:3", "--concurrency", "2"]
    assert controllerctl([*argv, "--no-oracle", "--out", str(out)]) == 1
    assert (out / "report.md").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "result.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hand.jsonl", "out"]  # no temporary left
    err = capsys.readouterr().err
    assert f"{out / 'result.json'}" in err and "is a directory" in err and ".tmp" not in err


# -- finding 4: profile names ------------------------------------------------------------------------


def _profile_text(**changes: str) -> str:
    text = SHIPPED.read_text()
    for old, new in changes.items():
        assert f"\n{old}" in text
        text = text.replace(f"\n{old}", f"\n{new}", 1)
    return text


@pytest.mark.parametrize("name", ["../../ESCAPED", "a/b", ".", "..", "a b", "é", "'a\\nb'", "x" * 129])
def test_a_profile_name_outside_the_policy_name_rules_is_refused(tmp_path: Path, name: str) -> None:
    p = tmp_path / "evil.yaml"
    p.write_text(_profile_text(**{"name: llama-3.1-8b-h100": f"name: {name}"}))
    with pytest.raises(ProfileError, match=rf"^{re.escape(str(p))}:4: name: must be 1-128 letters, digits"):
        load_profile(str(p))


def test_compare_never_writes_outside_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text(_profile_text(**{"name: llama-3.1-8b-h100": "name: ../../../ESCAPED"}))
    out = tmp_path / "o" / "res"
    argv = ["sim", "compare", *FAST, "--no-oracle", "--jobs", "1", "--profile", f"llama-3.1-8b-h100,{evil}"]
    assert main([*argv, "--out", str(out)]) == 2
    assert "name: must be 1-128 letters" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.yaml"]


def test_a_profile_is_named_never_by_a_path() -> None:
    with pytest.raises(ProfileError, match=re.escape("unknown profile '../profiles/llama-3.1-8b-h100'")):
        load_profile("../profiles/llama-3.1-8b-h100")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--name", "../../x"], "--name: must be 1-128 letters"),
        (["--name", "a\nb"], "--name: must be 1-128 letters"),
        (["--name", ""], "--name: must be 1-128 letters"),
    ],
)
def test_profile_fit_refuses_a_name_before_the_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    from sim.steplog import write_steps
    from tests.sim.test_fit import synthetic

    steps = tmp_path / "s.jsonl"
    write_steps(steps, synthetic(50, 1))
    d = tmp_path / "d"
    d.mkdir()
    assert main(["profile", "fit", str(steps), "--out", str(d / "p.yaml"), *argv]) == 2
    assert says in _one_line(capsys)
    assert not list(d.iterdir())


# -- finding 5: unknown keys in a profile ------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "append", "says"),
    [
        ({"scheduling:": "schedulng:"}, "", ":47: schedulng: unknown key (expected api_price,"),
        ({}, "no_such_key: 1\n", ":62: no_such_key: unknown key"),
        ({"  const_s: 5.88590713e-03": "  const: 5.88590713e-03"}, "", ":19: target.const: unknown key"),
        ({"    fit_k: 3": "    fitk: 3"}, "", ":25: draft.eagle3.fitk: unknown key"),
        ({"  ngram:": "  ngrams:"}, "", ":29: draft.ngrams: unknown key"),
        ({"  reserve_gb: 4": "  reserve: 4"}, "", ":38: memory.reserve: unknown key"),
        ({"  sync_step_s: 3.29e-04": "  sync_s: 3.29e-04"}, "", ":47: scheduling.sync_s: unknown key"),
        ({"api_price: llama-3.1-8b": "api_price: no-such-model"}, "", ":41: api_price: unknown model"),
    ],
)
def test_an_unknown_profile_key_is_refused_with_its_line(
    tmp_path: Path, changes: dict[str, str], append: str, says: str
) -> None:
    # a misspelt section or key silently became 0 (or dropped the API price), exit 0
    p = tmp_path / "p.yaml"
    p.write_text(_profile_text(**changes) + append)
    with pytest.raises(ProfileError) as e:
        load_profile(str(p))
    assert str(e.value).startswith(f"{p}{says}"), str(e.value)


def test_every_shipped_profile_still_loads() -> None:
    for name in profile_names():
        assert load_profile(name).name == name


# -- finding 6: trace import --tokens names the list that is too long -------------------------------


@pytest.mark.parametrize(
    ("prompt", "output", "says"),
    [
        (9, 3, "prompt_token_ids: 9 tokens, at most 8"),
        (3, 9, "output_token_ids: 9 tokens, at most 8"),
    ],
)
def test_import_tokens_names_the_list_over_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prompt: int, output: int, says: str
) -> None:
    import sim.importer

    monkeypatch.setattr(sim.importer, "MAX_PROMPT_TOKENS", 8)
    monkeypatch.setattr(sim.importer, "MAX_OUTPUT_TOKENS", 8)
    p = tmp_path / "ids.jsonl"
    p.write_text(json.dumps({"prompt_token_ids": [7] * prompt, "output_token_ids": [1] * output}) + "\n")
    with pytest.raises(TraceError) as e:
        import_token_ids(p)
    assert str(e.value).startswith(f"{p}:1: {says}")


# -- finding 7: a header line that is not JSON -------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "says"),
    [
        # cut off: the error was at "(column 1)", then line 2 was checked as the header
        (
            '{"spectrace":1,"max_k":8,"methods":["eagle3"]',
            "1: invalid JSON: Expecting ',' delimiter (at the end",
        ),
        # then "empty trace" for a file that is not empty
        ('{"spectrace":1,"max_k":8,,"methods":["eagle3"]}', "1: invalid JSON: Expecting property name"),
        ('\ufeff{"spectrace":1,"max_k":8,"methods":["eagle3"]}', "1: invalid JSON: Unexpected UTF-8 BOM"),
    ],
)
@pytest.mark.parametrize("rows", [0, 1])
def test_an_unreadable_header_is_the_only_error(tmp_path: Path, header: str, says: str, rows: int) -> None:
    ok = {"id": "r1", "output_tokens": 2, "acc": {"eagle3": [0, 0]}}
    p = write_lines(tmp_path / "t.jsonl", header, *[ok] * rows)
    assert [str(e) for e in validate_trace(p)] == [str(e) for e in validate_trace(p)[:1]]
    assert str(validate_trace(p)[0]).startswith(f"{p}:{says}")


def test_a_cut_off_request_line_says_where(tmp_path: Path) -> None:
    p = write_lines(
        tmp_path / "t.jsonl", HEADER, OK, '{"id": "r2", "output_tokens": 2, "acc": {"eagle3": [1, 0'
    )
    (e,) = validate_trace(p)
    assert str(e) == f"{p}:3: invalid JSON: Expecting ',' delimiter (at the end of the line: cut off?)"


def test_an_error_in_the_middle_of_a_line_names_its_column(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "t.jsonl", HEADER, '{"id": x}')
    (e,) = validate_trace(p)
    assert str(e) == f"{p}:2: invalid JSON: Expecting value (column 8)"


def test_an_empty_file_is_still_an_empty_trace(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text("")
    assert [str(e) for e in validate_trace(p)] == [f"{p}:1: empty trace: expected a header line"]


# -- finding 8: --out under a regular file -----------------------------------------------------------


@pytest.mark.parametrize("verb", ["replay", "compare"])
@pytest.mark.parametrize("sub", ["afile/sub", "afile/sub/deeper"])
def test_an_out_directory_under_a_file_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str, sub: str
) -> None:
    (tmp_path / "afile").write_text("")
    extra = ["--jobs", "1"] if verb == "compare" else []
    assert (
        main(["sim", verb, *FAST, "--no-oracle", *extra, "--out", str(tmp_path / sub)]) == 2
    )  # was 1, after the run
    err = _one_line(capsys)
    assert f"--out {tmp_path / sub}: {tmp_path / 'afile'} is a file, not a directory" in err
    assert capsys.readouterr().out == ""


# -- finding 10 (the cheap ones) ---------------------------------------------------------------------


def test_a_line_that_is_not_utf8_is_a_file_line_error(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes(
        json.dumps(HEADER).encode() + b"\n" + json.dumps(OK).encode().replace(b"ok", b"o\xff") + b"\n"
    )
    (e,) = validate_trace(p)
    assert str(e) == f"{p}:2: not valid UTF-8 text (byte 0xff at byte 10 of the line)"


def test_trace_validate_of_an_empty_name_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "validate", ""]) == 2
    assert _one_line(capsys) == "'': not a file name\n"  # was ".: cannot read: [Errno 21] Is a directory"


@pytest.mark.parametrize(
    "argv",
    [
        ["sim", "replay", "--trace", "", "--policy", "default"],
        ["sim", "compare", "--trace", ""],
        ["sim", "tune", "--trace", "", "--policy", "default", "--param", "explore=0.1"],
        ["profile", "fit", "", "--out", "OUT/p.yaml"],
        ["trace", "import", "", "--out", "OUT/t.jsonl"],
        ["trace", "import", "--tokens", "", "--out", "OUT/t.jsonl"],
        [
            "trace",
            "record",
            "--url",
            "http://127.0.0.1:1",
            "--model",
            "m",
            "--prompts",
            "",
            "--out",
            "OUT/t.jsonl",
        ],
    ],
)
def test_every_reader_of_an_empty_name_names_it(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Path('') is '.': each said ".: cannot read: [Errno 21] Is a directory: '.'", as trace validate did
    # (and sim replay took --trace '' for none, and ended in an AttributeError traceback).
    assert main([a.replace("OUT", str(tmp_path)) for a in argv]) == 2
    assert _one_line(capsys) == "'': not a file name\n"


@pytest.mark.parametrize("profile", ["", ",", " "])
def test_an_empty_profile_flag_is_named(capsys: pytest.CaptureFixture[str], profile: str) -> None:
    assert main(["sim", "replay", *FAST, "--profile", profile]) == 2
    assert _one_line(capsys) == f"--profile {profile!r}: not a profile name or file\n"


@pytest.mark.parametrize("gz", [False, True])
def test_a_trace_from_a_pipe_is_read(tmp_path: Path, gz: bool, capsys: pytest.CaptureFixture[str]) -> None:
    # `trace validate <(zcat t.jsonl.gz)`, or a FIFO a writer feeds: the reader sniffed gzip's magic
    # by seeking back, and a pipe cannot seek: "cannot read: File or stream is not seekable".
    text = (json.dumps(HEADER) + "\n" + json.dumps(OK) + "\n").encode()
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError), open(fifo, "wb") as f:
            f.write(gzip.compress(text) if gz else text)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        assert main(["trace", "validate", str(fifo)]) == 0, capsys.readouterr().err
    finally:
        if writer.is_alive():  # (a reader that never opened the FIFO leaves the writer waiting)
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(5)
    assert capsys.readouterr().out == f"{fifo}: ok\n"
