"""README.md's result blocks are exactly what benchmarks/readme_results.py derives from the results files."""

import copy
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_results as rr  # noqa: E402


def test_readme_blocks_are_up_to_date() -> None:
    assert rr.main(["--check"]) == 0, "README.md results are stale: run python benchmarks/readme_results.py"


def test_a_changed_result_changes_the_readme() -> None:
    readme = rr.README.read_text()
    md = rr.DECISION_QUALITY.read_text()
    doc = json.loads(rr.AUTOSCALE.read_text())
    row = next(line for line in md.splitlines() if line.startswith("| drift | 8 | default @ composite |"))
    cells = row.split("|")
    cells[5] = " 9.999 "  # × best static
    changed = rr.updated_readme(readme, md.replace(row, "|".join(cells)), doc)
    assert "| drift (goal ≥ 1.20) | " in changed and "| 9.999 |" in changed
    cold = copy.deepcopy(doc)
    cold["replica"]["time_to_95pct_s"]["cold"] = 42.0
    assert "; a cold one in 42 s (mean efficiency" in rr.updated_readme(readme, md, cold)


def test_missing_rows_and_markers_are_named() -> None:
    md = rr.DECISION_QUALITY.read_text()
    doc = json.loads(rr.AUTOSCALE.read_text())
    without = "\n".join(
        line for line in md.splitlines() if not line.startswith("| maths | 32 | default @ composite")
    )
    with pytest.raises(rr.ResultsError, match=re.escape("maths | 32 | default @ composite")):
        rr.decision_quality_table(without)
    with pytest.raises(rr.ResultsError, match="results:decision-quality"):
        rr.updated_readme("no markers here", md, doc)
    with pytest.raises(rr.ResultsError, match="replica"):
        rr.autoscale_sentence({})
