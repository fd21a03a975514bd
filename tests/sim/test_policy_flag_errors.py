"""``--policy`` errors of every simulator command that takes one (``sim replay|compare|tune|autoscale``).

What must hold: a static arm out of range, a preset that is none, or a broken policy file is refused in
one line that names the flag (``--policy static:eagle3:99: ...``), as ``sim autoscale`` always said,
exit 2, before any replay; a policy file's own ``FILE:LINE: field`` stays in the line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.cli import main

QUICK = ["--scenario", "chat", "--requests", "4", "--concurrency", "1", "--no-oracle"]
COMMANDS = {
    "replay": ["sim", "replay", *QUICK],
    "compare": ["sim", "compare", *QUICK],
    "tune": [
        "sim",
        "tune",
        "--scenario",
        "chat",
        "--requests",
        "4",
        "--concurrency",
        "1",
        "--param",
        "epsilon=0",
    ],
    "autoscale": ["sim", "autoscale", "--duration", "20", "--triple-at", "10"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ("static:eagle3:99", "--policy static:eagle3:99: arm 'eagle3:99': k must be an integer 1..64"),
        ("no-such-preset", "--policy no-such-preset: unknown policy preset 'no-such-preset'"),
    ],
)
def test_a_policy_error_names_the_flag(
    command: str, policy: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # sim replay|compare|tune said "static:eagle3:99: arm ..." (the value, not the flag);
    # sim autoscale said "--policy static:eagle3:99: arm ...".
    assert main([*COMMANDS[command], "--policy", policy]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_broken_policy_file_keeps_its_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: p}\nspec:\n  algorithm: 3\n")
    assert main([*COMMANDS[command], "--policy", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"--policy {f}:5: spec.algorithm") and err.count("\n") == 1, err
