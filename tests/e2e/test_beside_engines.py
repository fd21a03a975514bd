"""The project tests ``make test`` hands over to the e2e session (``SPECCONTROL_E2E_BESIDE_ENGINES``,
the Makefile's BESIDE_ENGINES), run with the project's interpreter in the background, beside the engine
tests (tests/e2e/background.py): they pass. Without the variable there is nothing to run here (the
project's suite ran those files)."""

from __future__ import annotations

import pytest

from tests.e2e import background


@pytest.mark.vllm
@pytest.mark.integration
def test_the_project_tests_run_beside_the_engines_pass() -> None:
    files = background.beside_files()
    if not files:
        pytest.skip(f"{background.BESIDE_ENV} is not set: the project's suite runs every file")
    run = background.started.get("beside") or background.start_beside(files, lowest=False)
    returncode, out = run.result()
    assert returncode == 0, out[-4000:]
    assert " passed" in out, out[-4000:]
