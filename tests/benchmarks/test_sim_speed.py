"""benchmarks/sim_speed.py: a mistaken command line is a usage error (exit 2, no traceback) before the
run; --repeat 0 and --concurrency 0 ended in tracebacks inside it, a bad --json after it."""

from pathlib import Path

import pytest

from tests.benchmarks.usage import assert_usage_error

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_speed.py"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--repeat", "0"], "argument --repeat: must be an integer 1..100, got '0'"),
        (["--concurrency", "0"], "argument --concurrency: must be an integer 1..4096, got '0'"),
        (["--tokens", "-5"], "argument --tokens: must be an integer 1..100000000, got '-5'"),
        (["--json", "NO/x.json"], "--json NO/x.json: no directory NO to write it in"),
        (["--json", "FIFO"], "--json FIFO: is not a regular file"),
    ],
)
def test_usage_errors_exit_2_before_the_run(tmp_path: Path, args: list[str], says: str) -> None:
    import os

    os.mkfifo(tmp_path / "fifo")
    sub = {"NO": str(tmp_path / "no"), "FIFO": str(tmp_path / "fifo")}
    for k, v in sub.items():
        args = [a.replace(k, v) for a in args]
        says = says.replace(k, v)
    assert_usage_error(SCRIPT, args, says)
