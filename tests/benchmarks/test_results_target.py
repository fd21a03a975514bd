"""`make results` runs scripts/results.sh: every command it names exists and parses its own flags.

Cheap by design: each command is run with ``--help`` only (the real runs take over an hour and need
vLLM), and every ``--flag`` the script passes must appear in that command's help, so a renamed or
missing option fails here rather than an hour into `make results`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "results.sh"
#: The executables results.sh calls, as this test runs them (the vLLM venv's Python parses --help
#: alike: the benchmarks import vLLM only in their engine children).
RUNNERS = {
    '"$BIN/python"': [sys.executable],
    '"$VLLM_PY"': [sys.executable],
    '"$BIN/controllerctl"': [
        sys.executable,
        "-c",
        "import sys; from controller.cli import main; sys.exit(main())",
    ],
}


def commands() -> list[tuple[str, list[str], list[str]]]:
    """(line, argv without the runner's arguments, the runner) for every command line of results.sh."""
    out = []
    for line in SCRIPT.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        for runner, exe in RUNNERS.items():
            if runner in line and not line.startswith("#"):
                rest = line.split(runner, 1)[1].split(">")[0]
                out.append((line, shlex.split(rest.replace('"$seed"', "0").replace('"$JOBS"', "2")), exe))
    return out


def test_the_make_target_runs_the_script() -> None:
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    target = make.split("\nresults:", 1)[1].split("\n\n", 1)[0]
    assert "scripts/results.sh" in target
    assert os.access(SCRIPT, os.X_OK)


def test_the_script_names_every_generator() -> None:
    found = {" ".join(argv[:2]) for _, argv, _ in commands()}
    for needed in (
        "benchmarks/decision_quality.py --requests",
        "sim compare",
        "sim autoscale",
        "demo --seed",
        "benchmarks/demo_headroom.py --json",
        "benchmarks/sim_speed.py --json",
        "benchmarks/sim_calibration.py --json",
        "benchmarks/sidecar_load.py --engines",
        "benchmarks/plugin_overhead.py --json",
        "benchmarks/plugin_overhead.py --scripted",
        "benchmarks/sim_vs_engine.py --json",
        "benchmarks/readme_results.py",
    ):
        assert any(f.startswith(needed.split(" --")[0]) for f in found), needed
    # The last step rewrites the documents from everything before it.
    assert commands()[-1][1] == ["benchmarks/readme_results.py"]


@pytest.mark.parametrize(("line", "argv", "exe"), commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_command_exists_and_knows_its_flags(line: str, argv: list[str], exe: list[str]) -> None:
    if argv[0].endswith(".py"):
        words = [argv[0]]
    else:  # controllerctl SUBCOMMAND [SUBSUBCOMMAND]: the words before the first flag
        words = [w for w in argv[: next((i for i, w in enumerate(argv) if w.startswith("-")), len(argv))]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [*exe, *words, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"{line}: --help exited {r.returncode}: {r.stderr[-400:]}"
    assert "usage:" in r.stdout
    for flag in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", " ".join(argv)):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", r.stdout), f"{line}: {flag} not in --help"
