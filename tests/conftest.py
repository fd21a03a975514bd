"""Options and fixtures shared by the test packages: the soak test's length, and the two ways a step
kernel runs (policies/jit.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from policies import jit


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=None,
        help="how long tests/reliability/test_soak.py runs (default: $SPECCONTROL_SOAK_S or 60)",
    )


@pytest.fixture(params=["python", "numba"])
def kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with the kernels as plain Python, then compiled (where numba is importable)."""
    compiled = request.param == "numba"
    if compiled and not jit.numba_available():
        pytest.skip(
            "numba is not installed here (tests/e2e/test_kernels_compiled.py runs these in the vLLM environment)"
        )
    jit.use_numba(compiled)
    yield request.param
    jit.use_numba(None)
