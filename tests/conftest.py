"""Options and fixtures shared by the test packages: the soak test's length, and the two ways a step
kernel runs (policies/jit.py; ``SPECCONTROL_KERNELS_NUMBA_ONLY``: files whose plain-Python half is left out)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies import jit


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=None,
        help="how long tests/reliability/test_soak.py runs (default: $SPECCONTROL_SOAK_S or 60)",
    )


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A temporary directory with a short path, for Unix sockets: a socket path holds 107 bytes, and
    ``tmp_path`` (deeper still under pytest-xdist) leaves a socket name too few."""
    d = Path(tempfile.mkdtemp(prefix="sc-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["python", "numba"])
def kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with the kernels as plain Python, then compiled (where numba is importable)."""
    compiled = request.param == "numba"
    numba_only = os.environ.get("SPECCONTROL_KERNELS_NUMBA_ONLY")
    if not compiled and numba_only and str(request.node.path).endswith(tuple(numba_only.split(os.pathsep))):
        # tests/e2e/test_kernels_compiled.py: this file's plain-Python half ran in the project's suite
        pytest.skip("SPECCONTROL_KERNELS_NUMBA_ONLY: the project's suite ran this plain-Python half")
    if compiled and not jit.numba_available():
        pytest.skip(
            "numba is not installed here (tests/e2e/test_kernels_compiled.py runs these in the vLLM environment)"
        )
    jit.use_numba(compiled)
    yield request.param
    jit.use_numba(None)
