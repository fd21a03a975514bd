"""benchmarks/plugin_overhead.py: a mistaken command line is a usage error (exit 2, no traceback)
before anything starts (its measurements need the vLLM virtualenv and run in `make results`)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plugin_overhead.py"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cold-mb", "4"], "--cold-mb: 0..4096, with --scripted only"),
        (["--scripted", "--cold-mb", "-1"], "--cold-mb: 0..4096"),
        (["--scripted", "--repeat", "0"], "--repeat: 1..100"),
        (["--batches", "8,x"], "--batches: comma-separated integers"),
        (["--batches", "64"], "batches in 1..32"),
    ],
)
def test_usage_errors_exit_2_and_say_what(args: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert says in r.stderr
    assert "Traceback" not in r.stderr
