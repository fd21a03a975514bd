"""``trace import --tokens``: exact n-gram counts and proposals from greedy token ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arms import Method
from sim.cli import main
from sim.importer import import_token_ids, ngram_columns
from sim.trace import read_trace, validate_trace


def _naive(tokens: list[int], min_n: int, max_n: int) -> list[int]:
    """vLLM's rule written out by hand: longest suffix n-gram first, earliest earlier occurrence."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        for i in range(0, total - n):
            if tokens[i : i + n] == suffix:
                return tokens[i + n :]
    return []


def _reference(
    prompt: list[int], out: list[int], min_n: int, max_n: int, max_k: int
) -> tuple[list[int], list[int]]:
    acc, prop = [], []
    for t in range(len(out)):
        hist = prompt + out[: t + 1]
        d = _naive(hist, min_n, max_n)[:64]
        nxt = out[t + 1 :]
        a = 0
        while a < len(d) and a < len(nxt) and d[a] == nxt[a]:
            a += 1
        acc.append(a)
        prop.append(min(len(d), max_k))
    return acc, prop


def _write(path: Path, *rows: dict[str, object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_copied_span_by_hand() -> None:
    prompt = np.arange(1, 10)
    out = np.array([1, 2, 3, 4, 5, 6, 7, 10, 11])
    acc, prop = ngram_columns(prompt, out, min_n=4, max_n=5, max_k=8)
    # After 1 2 3 4 the prompt's 4-gram matches: it drafts 5 6 7 8 9 ..., and 5 6 7 come next.
    assert acc.tolist() == [0, 0, 0, 3, 2, 1, 0, 0, 0]
    # ... the match holds through 7 (proposing 8, wrongly) and is lost once 10 breaks the suffix.
    assert prop.tolist() == [0, 0, 0, 8, 8, 8, 8, 0, 0]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), min_size=0, max_size=30),
    out=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    max_k=st.integers(1, 8),
)
def test_matches_the_rule_written_out(
    prompt: list[int], out: list[int], min_n: int, extra: int, max_k: int
) -> None:
    acc, prop = ngram_columns(
        np.array(prompt, dtype=np.int64), np.array(out), min_n=min_n, max_n=min_n + extra, max_k=max_k
    )
    assert (acc.tolist(), prop.tolist()) == _reference(prompt, out, min_n, min_n + extra, max_k)
    assert not ((prop == 0) & (acc > 0)).any()  # no match, nothing accepted


def test_import_writes_a_valid_trace_with_the_signal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(120):
        prompt = rng.integers(0, 50, 200).tolist()
        # Greedy outputs that copy stretches of the prompt between fresh tokens.
        out: list[int] = []
        while len(out) < 150:
            if rng.random() < 0.5:
                s = int(rng.integers(0, 180))
                out += prompt[s : s + int(rng.integers(5, 20))]
            else:
                out += rng.integers(50, 1000, int(rng.integers(1, 10))).tolist()
        rows.append({"id": f"q{i}", "class": "edit", "prompt_token_ids": prompt, "output_token_ids": out,
                     "acc": {"eagle3": [1] * len(out)}})  # fmt: skip
    src = _write(tmp_path / "tok.jsonl", *rows)
    dst = tmp_path / "out.jsonl.gz"
    assert (
        main(["trace", "import", "--tokens", str(src), "--min-n", "3", "--max-n", "4", "--out", str(dst)])
        == 0
    )
    said = capsys.readouterr().out
    assert "n-gram match at" in said
    assert "(min_n 3, max_n 4)" in said, said  # the sizes given, as the header holds them
    assert validate_trace(dst) == []
    t = read_trace(dst)
    assert t.methods == (Method.EAGLE3, Method.NGRAM) and t.n == 120
    assert t.meta["ngram"] == {"min_n": 3, "max_n": 4}
    assert t.ngram_proposal is not None
    ng = t.acc[Method.NGRAM]
    matched = t.ngram_proposal > 0
    assert matched.any() and (ng[matched] > 0).mean() > 0.5  # copies are found and mostly accepted
    assert (ng[~matched] == 0).all()
    first = rows[0]
    acc, prop = _reference(first["prompt_token_ids"], first["output_token_ids"], 3, 4, 8)  # type: ignore[arg-type]
    assert (
        ng[: t.output_tokens[0]].tolist() == acc and t.ngram_proposal[: t.output_tokens[0]].tolist() == prop
    )


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"prompt_token_ids": [1]}, "output_token_ids"),
        ({"prompt_token_ids": [1], "output_token_ids": []}, "output_token_ids"),
        ({"prompt_token_ids": [1, -1], "output_token_ids": [2]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1], "output_token_ids": [2, 2**31]}, "output_token_ids[1]"),
        ({"prompt_token_ids": [1], "output_token_ids": [2], "acc": {"eagle3": [1, 2]}}, "acc.eagle3"),
        ({"prompt_token_ids": [1], "output_token_ids": [2], "acc": {"ngram": [0]}}, "acc.ngram"),
        ({"prompt_token_ids": [1], "output_token_ids": [2], "acc": {"eagle3": [2**31]}}, "acc.eagle3[0]"),
        ({"prompt_token_ids": [1], "output_token_ids": [2], "acc": {"eagle3": [0]}}, "acc"),
        ({"prompt_token_ids": [1], "output_token_ids": [2], "class": ""}, "class"),
        ({"prompt_token_ids": [1], "output_token_ids": [2], "traffic_class": 5}, "traffic_class"),
        ({"prompt_token_ids": [1], "output_token_ids": [2], "id": ""}, "id"),
        ({"prompt_token_ids": [1], "output_token_ids": [2], "id": [1]}, "id"),
    ],
)
def test_bad_lines_are_file_line_errors(
    tmp_path: Path, row: dict[str, object], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _write(tmp_path / "bad.jsonl", {"prompt_token_ids": [1], "output_token_ids": [2, 3]}, row)
    assert main(["trace", "import", "--tokens", str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{src}:2: {field}: "), err
    assert not (tmp_path / "o.jsonl").exists()


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _write(tmp_path / "t.jsonl", {"prompt_token_ids": [1], "output_token_ids": [2, 3]})
    out = str(tmp_path / "o.jsonl")
    assert main(["trace", "import", "--out", out]) == 2
    assert main(["trace", "import", str(src), "--tokens", str(src), "--out", out]) == 2
    assert main(["trace", "import", "--tokens", str(src), "--min-n", "5", "--max-n", "4", "--out", out]) == 2
    assert main(["trace", "import", str(src), "--min-n", "3", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "min_n <= max_n" in err
    # The defaults' own values were let through without --tokens, to be ignored as silently.
    for flag, value in (("--min-n", "4"), ("--max-n", "5"), ("--max-k", "8")):
        assert main(["trace", "import", str(src), flag, value, "--out", out]) == 2
        assert capsys.readouterr().err == "--min-n/--max-n/--max-k: only with --tokens\n"
    with pytest.raises(ValueError, match="max-k"):
        import_token_ids(src, max_k=65)


def test_a_null_class_is_the_default_class_and_an_integer_id_is_text(tmp_path: Path) -> None:
    # A null class was imported as the class 'None'.
    src = _write(
        tmp_path / "t.jsonl", {"prompt_token_ids": [1], "output_token_ids": [2, 3], "class": None, "id": 7}
    )
    t = import_token_ids(src)
    assert (t.ids, t.classes) == (("7",), ("default",))


def test_only_one_token_requests_are_refused_as_the_reader_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _write(tmp_path / "t.jsonl", {"prompt_token_ids": [1, 2], "output_token_ids": [3]})
    assert main(["trace", "import", "--tokens", str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert (
        capsys.readouterr().err
        == f"{src}: every request has 1 output token (prefill's): a replay needs one with >= 2\n"
    )
    assert not (tmp_path / "o.jsonl").exists()


def _per_position(
    prompt: np.ndarray, out: np.ndarray, min_n: int, max_n: int, max_k: int
) -> tuple[list[int], list[int]]:
    """The implementation before the index: ``match_ngram`` over the whole history at every position."""
    from policies.prompt_lookup import match_ngram

    tokens = np.concatenate([prompt, out]).astype(np.int32)
    acc, prop = [], []
    for t in range(len(out)):
        end = len(prompt) + t + 1
        draft = match_ngram(tokens[:end], min_n, max_n, 1 << 30, 64)
        nxt = tokens[end : end + len(draft)]
        same = draft[: len(nxt)] == nxt
        acc.append(0 if not len(draft) else (len(nxt) if same.all() else int(np.argmin(same))))
        prop.append(min(len(draft), max_k))
    return acc, prop


@pytest.mark.parametrize("seed", range(6))
def test_the_index_finds_what_the_matcher_found_at_every_position(seed: int) -> None:
    # ngram_columns called match_ngram per position: quadratic in the request (60k tokens: minutes).
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([2, 5, 50]))
    prompt = rng.integers(0, vocab, int(rng.integers(0, 300)))
    out = rng.integers(0, vocab, int(rng.integers(200, 500)))
    if len(prompt):
        out[100:160] = np.resize(prompt, 60)  # a copied span
    min_n = int(rng.integers(1, 6))
    max_n = min_n + int(rng.integers(0, 4))
    acc, prop = ngram_columns(prompt, out, min_n=min_n, max_n=max_n, max_k=8)
    assert (acc.tolist(), prop.tolist()) == _per_position(prompt, out, min_n, max_n, 8)


def test_a_long_request_imports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(2)
    src = _write(
        tmp_path / "long.jsonl",
        {"prompt_token_ids": [1, 2, 3], "output_token_ids": rng.integers(0, 1000, 60_000).tolist()},
    )
    assert main(["trace", "import", "--tokens", str(src), "--out", str(tmp_path / "o.jsonl")]) == 0
    assert read_trace(tmp_path / "o.jsonl").total_output_tokens == 60_000
    # No sizes given: vLLM's matcher's (import_token_ids' defaults), said and in the header.
    assert "(min_n 4, max_n 5)" in capsys.readouterr().out
    trace = read_trace(tmp_path / "o.jsonl")
    assert trace.meta["ngram"] == {"min_n": 4, "max_n": 5} and trace.max_k == 8


@pytest.mark.parametrize(("lo", "hi"), [(64, 64), (100_000, 100_000), (1, 64), (0, 4)])
def test_ngram_sizes_are_bounded_as_trace_record_bounds_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lo: int, hi: int
) -> None:
    # 100000 was taken: slow, and written into a header that trace validate refuses.
    src = _write(tmp_path / "t.jsonl", {"prompt_token_ids": [1], "output_token_ids": [2, 3]})
    out = tmp_path / "o.jsonl"
    assert (
        main(
            [
                "trace",
                "import",
                "--tokens",
                str(src),
                "--min-n",
                str(lo),
                "--max-n",
                str(hi),
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert f"need 1 <= min_n <= max_n <= 63, got {lo}, {hi}" in capsys.readouterr().err
    assert not out.exists()


def test_arrivals_on_some_lines_only_are_dropped_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``trace import`` of responses: every request's arrival was dropped silently."""
    row = {"prompt_token_ids": [1, 2, 3], "output_token_ids": [1, 2, 3, 4]}
    src = _write(tmp_path / "tok.jsonl", row, {**row, "id": "b", "arrival_s": 0.5}, {**row, "id": "c"})
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", "--tokens", str(src), "--out", str(out)]) == 0
    assert capsys.readouterr().err == (
        f"{src}:1: arrival_s: missing, but line 2 has one: arrival times dropped from every request "
        "(a trace has them on all or none)\n"
    )
    assert np.isnan(read_trace(out).arrival_s).all()


def test_a_method_with_token_ids_is_a_usage_error_not_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--tokens` computes acc.ngram; `--method eagle3` beside it used to be dropped without a word, the
    # trace holding no eagle3 although the command line named it.
    src = _write(tmp_path / "t.jsonl", {"prompt_token_ids": [1, 2], "output_token_ids": [1, 2, 1]})
    out = tmp_path / "o.jsonl"
    for method in ("eagle3", "ngram"):
        assert main(["trace", "import", "--tokens", str(src), "--method", method, "--out", str(out)]) == 2
        assert capsys.readouterr().err == (
            "--method: only with a FILE of vLLM responses (--tokens computes acc.ngram from the token "
            "ids; other methods' counts go in each line's acc)\n"
        )
        assert not out.exists()
    assert main(["trace", "import", "--tokens", str(src), "--out", str(out)]) == 0
