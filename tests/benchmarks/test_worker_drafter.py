"""benchmarks/worker_drafter.py: usage errors exit 2 before anything starts; where torch is installed
(vLLM's environment; tests/e2e/test_kernels_compiled.py runs this file there) a short CPU run finds the
two drafters' drafts equal and writes its figures as JSON numbers."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.usage import assert_usage_error

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "worker_drafter.py"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--batches", "8,x"], "--batches: comma-separated integers"),
        (["--batches", "0"], "batches in 1..1024"),
        (["--steps", "2"], "--steps in 4..100000"),
        (["--ngram-share", "1.5"], "--ngram-share: 0..1"),
        # A seed below -batch reached numpy (default_rng(seed + batch)): a ValueError traceback after
        # torch and the Triton check had loaded.
        (["--seed", "-100"], "argument --seed: must be an integer 0..4294967295"),
    ],
)
def test_usage_errors_exit_2_and_say_what(args: list[str], says: str) -> None:
    assert_usage_error(SCRIPT, args, says)


def test_a_short_cpu_run_agrees_and_writes_numbers(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (it runs in vLLM's environment)")
    out = tmp_path / "wd.json"
    triton = importlib.util.find_spec("triton") is not None
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--batches", "4,16", "--history", "300", "--steps", "24",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [row["batch"] for row in doc["rows"]] == [4, 16]
    for row in doc["rows"]:
        assert row["mismatched_steps"] == 0
        assert isinstance(row["host_drafter_host_us"], float) and row["host_drafter_host_us"] > 0
        assert isinstance(row["device_host_ratio"], float)
        assert "device_drafter_device_us" not in row  # CUDA events only on a GPU
        ops = row["device_ops_per_step"]
        # a step without n-gram rows only copies its tokens; one with some matches and merges
        assert ops["no_ngram"] == 1 and ops["ngram"] > ops["no_ngram"], ops
        if triton:  # (Triton's interpreter on CPU: the drafts and the launches, not the times)
            tri = row["triton"]
            assert tri["kernels"] == "triton" and tri["mismatched_steps"] == 0
            assert tri["device_ops_per_step"]["no_ngram"] == 1
            assert 1 < tri["device_ops_per_step"]["ngram"] < ops["ngram"] // 4, (tri, ops)
    assert (doc["triton_problem"] is None) == triton
