"""benchmarks/decision_quality.py: unknown scenario or policy names and an --out that cannot be written
are usage errors (exit 2, no traceback) before any replay: they failed in a worker (KeyError,
FileNotFoundError), or after the 10-25 minute run (--out)."""

from pathlib import Path

import pytest

from tests.benchmarks.usage import assert_usage_error

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decision_quality.py"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--scenarios", "chat,bogus"], "--scenarios: unknown 'bogus' (known: chat, "),
        (["--scenarios", ","], "--scenarios: unknown none given"),
        (["--policies", "default,bogus"], "--policies: unknown 'bogus' (known: default, "),
        (["--policies", "../default"], "--policies: unknown '../default'"),
        (["--out", "NO/x.md"], "--out NO/x.md: no directory NO to write it in"),
        (["--requests", "0"], "argument --requests: must be an integer"),
    ],
)
def test_usage_errors_exit_2_before_any_replay(tmp_path: Path, args: list[str], says: str) -> None:
    args = [a.replace("NO", str(tmp_path / "no")) for a in ["--jobs", "1", "--scenarios", "chat", *args]]
    assert_usage_error(SCRIPT, args, says.replace("NO", str(tmp_path / "no")))
