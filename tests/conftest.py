"""Options and fixtures shared by the test packages: the soak test's length, the two ways a step
kernel runs (policies/jit.py; ``SPECCONTROL_KERNELS_NUMBA_ONLY``: files whose plain-Python half is left
out), a FIFO with no writer that cannot hang the test that reads it, and the Hypothesis profile of the
runs beside the engine tests (tests/e2e/background.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from policies import jit

#: ``--hypothesis-profile=beside-engines``: tests run at the lowest CPU priority beside the engine tests
#: can be held off the CPU for seconds while an engine needs both cores, so no example has a deadline
#: (Hypothesis's default, 200 ms, would fail an example for the wait, not for what it computed).
settings.register_profile("beside-engines", deadline=None)


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


@pytest.fixture
def fifo_without_writer(tmp_path: Path) -> Iterator[Path]:
    """A FIFO that nothing writes to: what a file given in place of a token or a certificate must be
    refused as, before it is opened. Code that opens it anyway (``open()`` of a FIFO without a writer
    blocks until one comes) is let go by a writer that comes and leaves at once, so it reads an empty
    file and the test fails on what it then says, rather than hanging for good."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = threading.Event()

    def let_readers_go() -> None:
        while not done.wait(0.01):
            # (succeeds only while a reader is there, which it then sends an end of file)
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    t = threading.Thread(target=let_readers_go, daemon=True)
    t.start()
    yield fifo
    done.set()
    t.join()


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
