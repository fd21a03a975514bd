from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp: Path, hashseed: str, name: str) -> bytes:
    out = tmp / name
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "sim",
            "sim",
            "replay",
            "--scenario",
            "drift",
            "--requests",
            "30",
            "--policy",
            "default",
            "--engine",
            "composite",
            "--concurrency",
            "1,8",
            "--json",
            str(out),
        ],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=300,
    )
    return out.read_bytes()


@pytest.mark.integration
def test_same_seed_same_result_across_processes(tmp_path: Path) -> None:
    assert _run(tmp_path, "1", "a.json") == _run(tmp_path, "1", "b.json")


@pytest.mark.integration
def test_result_does_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    assert _run(tmp_path, "1", "a.json") == _run(tmp_path, "2", "b.json")
