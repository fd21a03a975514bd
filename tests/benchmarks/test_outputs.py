"""The benchmark scripts' output files and environments, checked before the run: a ``--json`` that
cannot be written, a ``--from`` that holds no kept run or a missing vLLM virtualenv is said in one line
(exit 2 for a mistaken command line, 1 for a missing environment) before any work, and leaves nothing
behind. They were tracebacks after the run (minutes of it, for some), or left a temporary directory."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.usage import assert_usage_error

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("sim_calibration.py", ["--requests", "5"]),
        ("demo_headroom.py", ["--requests", "5"]),
        ("plugin_overhead.py", ["--scripted"]),
        ("plugin_overhead.py", []),
        ("plugin_ab.py", [str(ROOT), str(ROOT)]),
        ("sim_vs_engine.py", []),
        ("worker_drafter.py", ["--device", "cpu"]),
    ],
)
@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("NO/x.json", "--json NO/x.json: no directory NO to write it in"),
        ("DIR", "--json DIR: is a directory, not a file"),
    ],
)
def test_an_unwritable_json_is_a_usage_error_before_the_run(
    tmp_path: Path, script: str, args: list[str], where: str, says: str
) -> None:
    sub = {"NO": str(tmp_path / "no"), "DIR": str(tmp_path)}
    for k, v in sub.items():
        where, says = where.replace(k, v), says.replace(k, v)
    assert_usage_error(BENCH / script, [*args, "--json", where], says)


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("sim_vs_engine.py", ["--from", "EMPTY"], "--from EMPTY: no settings.json there"),
        ("sim_vs_engine.py", ["--budget-s", "nan"], "--budget-s: a number of seconds > 0, got nan"),
        ("sim_vs_engine.py", ["--keep", "FILE"], "--keep FILE: is a file, not a directory"),
        (
            "plugin_ab.py",
            [str(ROOT), str(ROOT), "--cpu", "4095"],
            "--cpu: one of the CPUs this process may run on",
        ),
    ],
)
def test_other_mistakes_are_usage_errors(tmp_path: Path, script: str, args: list[str], says: str) -> None:
    (tmp_path / "file").write_text("")
    sub = {"EMPTY": str(tmp_path), "FILE": str(tmp_path / "file")}
    for k, v in sub.items():
        args = [a.replace(k, v) for a in args]
        says = says.replace(k, v)
    assert_usage_error(BENCH / script, args, says)


def _run(tmp: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp), **env},
    )


def test_sim_vs_engine_without_the_vllm_virtualenv_says_so_and_makes_nothing(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    r = _run(tmp_path / "tmp", "sim_vs_engine.py", VLLM_VENV=str(tmp_path / "none"))
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == f"sim_vs_engine: no vLLM virtualenv at {tmp_path / 'none'}/bin/python " + (
        "(make e2e-vllm, or set VLLM_VENV)"
    )
    assert not list((tmp_path / "tmp").iterdir())  # no empty run directory left in /tmp


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this Python has vLLM")
def test_plugin_overhead_without_vllm_says_which_python_and_makes_nothing(tmp_path: Path) -> None:
    r = _run(tmp_path, "plugin_overhead.py", "--tokens", "8", "--history", "10", "--batches", "2")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "the engine runs need vLLM" in r.stderr and ".venv-vllm/bin/python" in r.stderr
    assert not list(tmp_path.iterdir())  # (a plugin-bench-* directory was left by every run)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
@pytest.mark.parametrize("device", ["foo", "cuda:x", "mps"])
def test_worker_drafter_names_a_bad_device(tmp_path: Path, device: str) -> None:
    # It failed inside the first step, reported as the device drafter synchronising with the device.
    r = _run(tmp_path, "worker_drafter.py", "--device", device, "--batches", "2", "--steps", "4")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"worker_drafter: --device: cpu, cuda or cuda:N, got {device!r}"
