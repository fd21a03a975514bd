"""The Makefile with another checkout's virtualenv (``BIN=...``, as a git worktree runs it): nothing is
installed into that virtualenv."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("target", ["lint", "typecheck", "test-fast", "demo", "proto-check"])
def test_a_bin_given_on_the_command_line_is_used_as_it_is(target: str, tmp_path: Path) -> None:
    # `make lint BIN=<main checkout>/.venv/bin` in a worktree ran `pip install -e .` with that BIN (the
    # worktree's .venv/.installed never exists): the main checkout's virtualenv then imported the
    # worktree's code, for everyone using it.
    r = subprocess.run(
        ["make", "-n", target, f"BIN={tmp_path}/bin", f"VENV={tmp_path}/venv"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "pip install" not in r.stdout and "-m venv" not in r.stdout, r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_the_default_virtualenv_is_still_built_on_first_use(tmp_path: Path) -> None:
    r = subprocess.run(
        ["make", "-n", "lint", f"VENV={tmp_path}/venv"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip
    assert f"-m venv {tmp_path}/venv" in r.stdout and "pip install -q -e" in r.stdout, r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_the_engine_environments_do_not_wait_for_the_project_virtualenv(tmp_path: Path) -> None:
    # `make test` builds them while the project virtualenv is built and the checks run (two jobs): a
    # prerequisite on that virtualenv put its build (about 45 s) in front of both again.
    r = subprocess.run(
        ["make", "-n", "engine-envs", f"VENV={tmp_path}/venv"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    assert "-m venv" not in r.stdout and "pip install" not in r.stdout, r.stdout
    assert "scripts/e2e_vllm.sh --prepare" in r.stdout and "scripts/e2e_vllm_033.sh --prepare" in r.stdout
    r = subprocess.run(
        ["make", "-n", "test", f"VENV={tmp_path}/venv"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    # (under a make of its own, CI's `make test`, the lines come with make[1]'s directory notes)
    lines = r.stdout.splitlines()
    two_jobs = next(i for i, line in enumerate(lines) if "-j2" in line)
    assert "engine-env " in lines[two_jobs] and "checks" in lines[two_jobs], r.stdout
    assert not any("-m venv" in line for line in lines[:two_jobs]), r.stdout
