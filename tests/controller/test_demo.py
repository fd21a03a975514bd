"""The demo's pieces that need no sockets: bucket matching for the live lines, the table, the plot."""

from pathlib import Path

import pytest

from controller.demo import ADAPTIVE, STATIC_ARMS, _bucket_holds, engine_name, format_table, plot


@pytest.mark.parametrize(
    ("label", "batch", "holds"),
    [
        ("1", 1, True),
        ("1", 2, False),
        ("2-4", 4, True),
        ("5-8", 4, False),
        ("33+", 33, True),
        ("33+", 32, False),
    ],
)
def test_bucket_labels(label: str, batch: int, holds: bool) -> None:
    assert _bucket_holds(label, batch) is holds


def _result() -> dict:  # type: ignore[type-arg]
    names = [ADAPTIVE, *(engine_name(a) for a in STATIC_ARMS)]
    engines = [
        {
            "engine": n,
            "policy": n,
            "goodput_tok_s": 100.0 + i,
            "speedup_vs_no_spec": 1.0,
            "acceptance_rate": 0.5,
            "phase_goodput_tok_s": [10.0 + i, 20.0],
        }
        for i, n in enumerate(names)
    ]
    return {
        "engines": engines,
        "phases": ["chat, concurrency 1", "maths, concurrency 32"],
        "phase_starts_s": [0.0, 1.0],
        "phase_best_static": [names[-1], names[1]],
        "adaptive_vs_best_static_per_phase": [0.5, 1.0],
        "adaptive_vs_best_static": 0.9,
        "adaptive_vs_worst_static": 1.0,
        "best_static": names[-1],
        "worst_static": names[1],
        "wall_s": 1.0,
        "profile": "llama-3.1-8b-h100",
        "goodput_over_time": {n: [[0.0, 1.0], [0.5, 2.0]] for n in names},
    }


def test_every_static_arm_of_the_engine_and_no_speculation_are_played() -> None:
    assert STATIC_ARMS[0] == "off"
    assert {a.partition(":")[0] for a in STATIC_ARMS} == {"off", "eagle3", "ngram"}
    assert len(STATIC_ARMS) == len(set(STATIC_ARMS)) == 17


def test_table_has_ratios_per_engine_and_per_phase() -> None:
    out = format_table(_result())
    lines = out.splitlines()
    assert "vs best static" in lines[0]
    ratio_row = next(line for line in lines if line.startswith("adaptive / best"))
    assert "0.500" in ratio_row and "1.000" in ratio_row
    assert "worst phase: 0.500" in out and "best static ngram-8" in out


def test_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    p = tmp_path / "g.png"
    plot(_result(), str(p))
    assert p.read_bytes()[:4] == b"\x89PNG"


def test_plot_into_a_missing_directory_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from controller.cli import main

    png = tmp_path / "no" / "such" / "g.png"
    assert main(["demo", "--seconds", "1", "--plot", str(png)]) == 2
    assert capsys.readouterr().err == f"--plot {png}: no directory {png.parent} to write it in\n"
