"""Rewrites README.md's published results from the files that `make results` regenerates.

Between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` markers in README.md:

* ``decision-quality``: the summary table, read from docs/decision-quality.md (written by
  ``benchmarks/decision_quality.py --out``): the default policy on the composite drafter as a ratio
  to the best static arm, and to the clairvoyant per-step oracle for drift and mixed.
* ``autoscale``: the autoscaling sentence, from docs/example-report/autoscale.json
  (``controllerctl sim autoscale --out docs/example-report``).

What must hold: the README never states a figure these files do not hold (a test compares them), and
a missing row or marker is an error naming it, not a silently stale README.
Usage: python benchmarks/readme_results.py [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DECISION_QUALITY = ROOT / "docs" / "decision-quality.md"
AUTOSCALE = ROOT / "docs" / "example-report" / "autoscale.json"
LEVELS = (1, 8, 32)


class ResultsError(ValueError):
    """A results file lacks what the README needs; ``str()`` names the file and the row."""


def _rows(md: str) -> dict[tuple[str, int, str], list[str]]:
    """The main table of decision-quality.md: (scenario, c, 'policy @ engine') -> cells."""
    out: dict[tuple[str, int, str], list[str]] = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[1].isdigit():
            out[(cells[0], int(cells[1]), cells[2])] = cells
    return out


def _cell(rows: dict[tuple[str, int, str], list[str]], scenario: str, c: int, column: int) -> str:
    key = (scenario, c, "default @ composite")
    if key not in rows:
        raise ResultsError(f"{DECISION_QUALITY.name}: no row '{scenario} | {c} | default @ composite'")
    return rows[key][column]


def decision_quality_table(md: str) -> str:
    rows = _rows(md)
    best, per_step = 4, 6  # columns: × best static, × per-step

    def levels(fn: Any) -> list[str]:
        return [fn(c) for c in LEVELS]

    lines = [
        "| scenario | c=1 | c=8 | c=32 |",
        "|---|---|---|---|",
        "| chat / code / maths (stationary; goal ≥ 0.97) | "
        + " | ".join(levels(lambda c: " / ".join(_cell(rows, s, c, best) for s in ("chat", "code", "maths"))))
        + " |",
        "| drift (goal ≥ 1.20) | " + " | ".join(levels(lambda c: _cell(rows, "drift", c, best))) + " |",
        "| mixed (goal ≥ 1.20) | " + " | ".join(levels(lambda c: _cell(rows, "mixed", c, best))) + " |",
        f"| load ramp 1→32→1, open loop (goal ≥ 1.20) | | | {_cell(rows, 'load-ramp', 32, best)} |",
        "| drift / mixed × the clairvoyant per-step oracle, same drafters and engine (goal ≥ 0.85) | "
        + " | ".join(
            levels(lambda c: f"{_cell(rows, 'drift', c, per_step)} / {_cell(rows, 'mixed', c, per_step)}")
        )
        + " |",
    ]
    return "\n".join(lines)


def autoscale_sentence(doc: dict[str, Any]) -> str:
    try:
        t95 = doc["replica"]["time_to_95pct_s"]
        eff = doc["replica"]["first_60s_efficiency"]
        cold_t, warm_t, cold_e, warm_e = t95["cold"], t95["warm"], eff["cold"], eff["warm"]
    except (KeyError, TypeError) as e:
        raise ResultsError(f"{AUTOSCALE.name}: missing replica.{e}") from None

    warm = f"in {warm_t:g} s" if warm_t is not None else "not within the measured run"
    cold = (
        f"a cold one in {cold_t:g} s" if cold_t is not None else "a cold one had not within the measured run"
    )
    return (
        f"a replica started with shared posteriors reached 95 % of steady goodput {warm}; {cold} "
        f"(mean efficiency over its first minute {cold_e:.2f} cold vs {warm_e:.2f} warm)."
    )


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(
        rf"(<!-- results:{re.escape(name)} -->\n)(.*?)(\n<!-- /results:{re.escape(name)} -->)", re.S
    )
    if not pattern.search(text):
        raise ResultsError(f"README.md: no <!-- results:{name} --> ... <!-- /results:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


def updated_readme(readme: str, dq_md: str, autoscale: dict[str, Any]) -> str:
    text = replace_block(readme, "decision-quality", decision_quality_table(dq_md))
    return replace_block(text, "autoscale", autoscale_sentence(autoscale))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="only say whether README.md is up to date (exit 1 if not)"
    )
    a = ap.parse_args(argv)
    try:
        new = updated_readme(
            README.read_text(encoding="utf-8"),
            DECISION_QUALITY.read_text(encoding="utf-8"),
            json.loads(AUTOSCALE.read_text(encoding="utf-8")),
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.check:
        stale = new != README.read_text(encoding="utf-8")
        print(
            "README.md results are stale: run make results" if stale else "README.md results are up to date"
        )
        return 1 if stale else 0
    README.write_text(new, encoding="utf-8")
    print("updated README.md results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
