"""The demo end to end: sidecar + embedded engines over real gRPC, short run, JSON result."""

import json
from pathlib import Path

import pytest

from controller.cli import main
from controller.demo import ADAPTIVE, STATIC_ARMS, engine_name

pytestmark = pytest.mark.integration


def test_demo_json_table_and_adaptive_beats_the_worst_static(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--seconds", "6", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["engine"]: r for r in doc["engines"]}
    assert set(rows) == {ADAPTIVE, *(engine_name(a) for a in STATIC_ARMS)}
    for r in rows.values():
        assert set(r) >= {
            "goodput_tok_s",
            "speedup_vs_no_spec",
            "acceptance_rate",
            "phase_goodput_tok_s",
            "arm_steps",
        }
        assert r["tokens"] > 0 and r["virtual_s"] >= 6.0
        assert len(r["phase_goodput_tok_s"]) == len(doc["phases"]) == 4
    assert rows[engine_name("off")]["speedup_vs_no_spec"] == 1.0
    assert rows[engine_name("off")]["acceptance_rate"] == 0.0
    assert set(rows[engine_name("ngram:4")]["arm_steps"]) == {"ngram:4"}
    # Every engine heard the sidecar; the adaptive one switched arms.
    assert all(r["directives"] > 0 for r in rows.values())
    assert len(rows[ADAPTIVE]["arm_steps"]) > 2
    statics = [r["goodput_tok_s"] for n, r in rows.items() if n != ADAPTIVE]
    assert rows[ADAPTIVE]["goodput_tok_s"] > min(statics)
    assert doc["adaptive_vs_worst_static"] > 1.0
    assert doc["best_static"] in rows and doc["worst_static"] in rows
    # Ratios per phase against that phase's best static arm, and goodput over time for the plot.
    assert len(doc["adaptive_vs_best_static_per_phase"]) == len(doc["phase_best_static"]) == 4
    assert all(x > 0 for x in doc["adaptive_vs_best_static_per_phase"])
    assert doc["phase_starts_s"][0] == 0.0 and doc["phase_starts_s"] == sorted(doc["phase_starts_s"])
    assert set(doc["goodput_over_time"]) == set(rows)
    assert all(len(s) > 10 for s in doc["goodput_over_time"].values())


def test_demo_table_output_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    assert main(["demo", "--seconds", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "adaptive / best" in out and "worst phase: " in out
    assert "adaptive vs best static: " in out and "── phase 1/4" in out
    header = next(line for line in out.splitlines() if line.startswith("engine "))
    assert "goodput tok/s" in header and "vs off" in header
