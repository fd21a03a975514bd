"""The demo's pieces that need no sockets: bucket matching for the live lines, the table, the plot."""

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.demo import ADAPTIVE, STATIC_ARMS, _bucket_holds, engine_name, format_table, plot
from controller.demo import _result as _demo_result
from controller.embedded.core import BINS, EngineTotals
from controller.embedded.workload import Phase, Schedule
from sim.costmodel import DEFAULT_PROFILE, load_profile
from sim.files import FileReplacement

PROFILE = load_profile(DEFAULT_PROFILE)


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


NAMES = [ADAPTIVE, *(engine_name(a) for a in STATIC_ARMS)]
SCHEDULE = Schedule(tuple(Phase(0.5, {c: 1.0}, n) for c, n in (("chat", 1), ("code-edit", 8), ("maths", 32))))


def _engines_stepped_in(
    phase_s: dict[int, float], per_engine: dict[str, dict[int, float]] | None = None
) -> dict:  # type: ignore[type-arg]
    """Stand-ins for the demo's engines (what ``_result`` reads): every one stepped in ``phase_s``
    (or in its own, from ``per_engine``)."""
    out = {}
    for i, name in enumerate(NAMES):
        t = EngineTotals(bin_s=0.1, bins=BINS)
        for p, s in (per_engine or {}).get(name, phase_s).items():
            t.phase_s[p] = s
            t.phase_tokens[p] = int(100 * s) + i
        t.tokens = sum(t.phase_tokens.values())
        t.virtual_s = sum(t.phase_s.values())
        out[name] = SimpleNamespace(
            totals=t, stats=SimpleNamespace(dropped_steps=0), core=SimpleNamespace(profile=PROFILE)
        )
    return out


def test_a_phase_no_engine_stepped_in_is_not_measured_as_zero() -> None:
    # A run shorter than its steps (--seconds 0.01): one step spans the last phases. They were 0 tok/s,
    # their ratio 0.000, "worst phase: 0.000" and best static "off" (the first of equal zeros).
    schedule = Schedule(tuple(Phase(0.5, {c: 1.0}, n) for c, n in (("chat", 1), ("maths", 32))))
    result = _demo_result(
        _engines_stepped_in({0: 0.6}),  # type: ignore[arg-type]
        SimpleNamespace(schedule=schedule),  # type: ignore[arg-type]
        seconds=1.0,
        seed=0,
        wall_s=1.0,
    )
    doc = json.loads(json.dumps(result))
    assert all(r["phase_goodput_tok_s"][1] is None for r in doc["engines"])
    assert all(isinstance(r["phase_goodput_tok_s"][0], float) for r in doc["engines"])
    assert doc["phase_best_static"] == [engine_name(STATIC_ARMS[-1]), None]
    assert doc["adaptive_vs_best_static_per_phase"][1] is None
    assert 0 < doc["adaptive_vs_best_static_per_phase"][0] < 1
    table = format_table(result)
    assert f"worst phase: {doc['adaptive_vs_best_static_per_phase'][0]:.3f}" in table
    assert "phase 2: maths, concurrency 32; best static - (no step in it)" in table
    ratio_row = next(line for line in table.splitlines() if line.startswith("adaptive / best"))
    assert ratio_row.split()[-1] == "-"


def test_ctrl_c_while_the_plot_is_written_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C between replace_file's write of FILE.tmp and its rename left FILE.tmp in the user's
    # directory; now it waits for the file, then interrupts as usual.
    pytest.importorskip("matplotlib")
    written = FileReplacement.write

    def write_then_press(self: FileReplacement, data: bytes) -> None:
        written(self, data)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(FileReplacement, "write", write_then_press)
    p = tmp_path / "g.png"
    with pytest.raises(KeyboardInterrupt):
        plot(_result(), str(p))
    assert [f.name for f in tmp_path.iterdir()] == ["g.png"]
    assert p.read_bytes()[:4] == b"\x89PNG"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from([None, 0.004, 0.3]), min_size=3, max_size=3),
        min_size=len(NAMES),
        max_size=len(NAMES),
    )
)
def test_per_phase_figures_use_only_the_phases_engines_stepped_in(rows: list[list[float | None]]) -> None:
    per_engine = {
        name: {p: s for p, s in enumerate(row) if s is not None} or {0: 0.01}
        for name, row in zip(NAMES, rows, strict=True)
    }
    result = _demo_result(
        _engines_stepped_in({}, per_engine),  # type: ignore[arg-type]
        SimpleNamespace(schedule=SCHEDULE),  # type: ignore[arg-type]
        seconds=1.5,
        seed=0,
        wall_s=1.0,
    )
    doc = json.loads(json.dumps(result))
    by_name = {r["engine"]: r for r in doc["engines"]}
    for p in range(3):
        measured = {n: r["phase_goodput_tok_s"][p] for n, r in by_name.items() if p in per_engine[n]}
        assert all(r["phase_goodput_tok_s"][p] is None for n, r in by_name.items() if p not in per_engine[n])
        statics = {n: g for n, g in measured.items() if n != ADAPTIVE}
        best = doc["phase_best_static"][p]
        assert best == (max(statics, key=lambda n: statics[n]) if statics else None)
        ratio = doc["adaptive_vs_best_static_per_phase"][p]
        if ADAPTIVE in measured and statics:
            assert ratio == pytest.approx(measured[ADAPTIVE] / statics[best], rel=1e-3, abs=1e-4)
        else:
            assert ratio is None
    ratios = [x for x in doc["adaptive_vs_best_static_per_phase"] if x is not None]
    assert (
        format_table(result)
        .splitlines()[-2]
        .endswith(f"worst phase: {min(ratios):.3f}" if ratios else "worst phase: -")
    )
