"""``sim tune``: grid parsing, parameter overrides, and a tiny search that writes the winning policy."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.spec import parse_policy
from sim.cli import main, resolve_policy
from sim.tune import parse_grid, with_params


def test_parse_grid_and_errors() -> None:
    assert parse_grid(["explore=0,0.3", "rule.min_run=2"]) == {"explore": [0.0, 0.3], "rule.min_run": [2.0]}
    with pytest.raises(ValueError, match="NAME=V1,V2"):
        parse_grid(["explore"])
    with pytest.raises(ValueError, match="numbers"):
        parse_grid(["explore=a"])


def test_with_params_overrides_algorithm_and_rule_and_validates() -> None:
    spec = with_params(resolve_policy("default"), {"explore": 0.0, "rule.min_run": 3.0})
    assert spec.params["explore"] == 0.0 and spec.rule.params["min_run"] == 3.0
    with pytest.raises(ValueError, match="explore"):
        with_params(resolve_policy("default"), {"explore": -1.0})


def test_tune_writes_the_winner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "best.yaml"
    rc = main(
        [
            "sim", "tune", "--policy", "default", "--scenario", "code-edit", "--requests", "4",
            "--concurrency", "1", "--param", "rule.min_run=2,8", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "rule.min_run" in text and "score" in text
    assert parse_policy(out.read_text()).algorithm == "goodput_model"


def test_tune_rejects_a_bad_param_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "tune", "--policy", "default", "--scenario", "chat", "--param", "nope=1"])
    assert rc != 0
    err = capsys.readouterr().err.strip()
    assert "nope" in err and "\n" not in err


def test_a_grid_counts_each_value_once_and_refuses_repeats_and_huge_sweeps() -> None:
    assert parse_grid(["max_k=1,2,1,2,2"]) == {"max_k": [1.0, 2.0]}
    # The second --param explore=... replaced the first without a word.
    with pytest.raises(ValueError, match=r"--param explore: given twice \(list every value once"):
        parse_grid(["explore=0.1", "explore=0.2"])
    assert len(parse_grid(["max_k=" + ",".join(["3"] * 5000)])["max_k"]) == 1
    with pytest.raises(ValueError, match="--param: 10201 grid points; at most 10000 per sweep"):
        parse_grid(
            [
                "explore=" + ",".join(str(i / 1000) for i in range(101)),
                "ridge=" + ",".join(str(i + 1) for i in range(101)),
            ]
        )


def test_an_unwritable_out_is_refused_before_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no" / "best.yaml"
    rc = main(
        ["sim", "tune", "--policy", "default", "--scenario", "chat", "--requests", "4", "--concurrency", "1",
         "--param", "explore=0.1,0.2", "--out", str(out)]
    )  # fmt: skip
    assert rc == 2
    assert capsys.readouterr().err == f"--out {out}: no directory {out.parent} to write it in\n"


def test_a_trace_the_engine_cannot_replay_is_a_usage_error_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # an EAGLE-3-only trace on the composite engine (which drafts n-gram too): exit 1 after the
    # baseline jobs ran, before
    t = tmp_path / "v.jsonl"
    t.write_text(
        '{"spectrace":1,"max_k":4,"methods":["eagle3"]}\n'
        '{"id":"a","output_tokens":6,"acc":{"eagle3":[3,0,5,4,0,0]}}\n'
    )
    out = tmp_path / "best.yaml"
    argv = ["sim", "tune", "--trace", str(t), "--policy", "default", "--engine", "composite"]
    rc = main([*argv, "--param", "switch_margin=0,0.1", "--out", str(out)])
    assert rc == 2 and not out.exists()
    assert "--engine: engine 'composite' drafts with ngram, which trace 'v' lacks" in capsys.readouterr().err


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="ab.=, 0123456789e-naif", max_size=12), max_size=3))
def test_a_grid_is_never_empty_and_any_mistake_is_a_value_error(items: list[str]) -> None:
    # "explore= ," parsed to no values: a grid of no points, "no candidates", then an IndexError.
    try:
        grid = parse_grid(items)
    except ValueError as e:
        assert str(e).startswith("--param") and "\n" not in str(e)
        return
    assert all(values for values in grid.values())
