"""Test runs that go on in the background of the end-to-end session, beside the real engine's tests.

An engine test keeps about one core of the 2-core CI machine busy (vmstat over a serial e2e run: 45-50 %
CPU outside the compiled-kernel tests), so CPU-bound tests that need no engine run beside them: the
compiled step-kernel tests (compiled_kernels.py) and the project tests ``make test`` hands over in
``SPECCONTROL_E2E_BESIDE_ENGINES`` (pure computation: no sockets, no deadlines). Each is one pytest
process, one thread, at the lowest CPU priority (``lowest_priority``): a two-rank engine needs both
cores and must not be slowed (its step timing, its sidecar's deadlines); what the engines leave, these
take. A test whose own timing they upset stops them meanwhile (``paused``). A test at the session's end
collects each run's result (tests/e2e/conftest.py orders them last).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.e2e.harness import ROOT

#: A run's limit.
TIMEOUT_S = 1800.0
#: The project test files ``make test`` leaves out of its suite run for the e2e session to run.
BESIDE_ENV = "SPECCONTROL_E2E_BESIDE_ENGINES"


@dataclass
class PytestRun:
    """One pytest process; its output goes to a temporary file."""

    proc: subprocess.Popen[bytes]
    out: IO[bytes]

    def result(self) -> tuple[int, str]:
        """Its exit status and output, once it has ended (killed past ``TIMEOUT_S``)."""
        try:
            self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
        self.out.seek(0)
        text = self.out.read().decode(errors="replace")
        self.out.close()
        return self.proc.returncode, text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def lowest_priority() -> list[str]:
    """The command prefix that runs a process on CPU time nothing else wants: Linux's SCHED_IDLE
    (``chrt --idle 0``) where util-linux has chrt, else ``nice -n 19``. A nice-19 process still takes
    its weight's share (15 against a normal process's 1,024) of a core it shares; a SCHED_IDLE one
    (3) is also preempted as soon as a normal one wakes there."""
    return ["chrt", "--idle", "0"] if shutil.which("chrt") else ["nice", "-n", "19"]


def start_pytest(
    python: Path | str, args: Sequence[str], env: Mapping[str, str], *, lowest: bool
) -> PytestRun:
    """``python -m pytest -q -p no:cacheprovider -rs ARGS`` from the checkout; ``lowest``: one thread at
    the lowest CPU priority (for the background)."""
    env = dict(env)
    prefix: list[str] = []
    if lowest:
        prefix = lowest_priority()
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        args = ["--hypothesis-profile=beside-engines", *args]  # (tests/conftest.py)
    out = tempfile.TemporaryFile()  # noqa: SIM115 - closed by PytestRun.result, after the run
    proc = subprocess.Popen(
        [*prefix, str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args],
        cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,  # (paused)
    )  # fmt: skip
    return PytestRun(proc, out)


def beside_files() -> list[str]:
    """The project test files handed over in ``SPECCONTROL_E2E_BESIDE_ENGINES`` (space separated)."""
    return os.environ.get(BESIDE_ENV, "").split()


def start_beside(files: Sequence[str], *, lowest: bool) -> PytestRun:
    """The handed-over project tests, with the project's own interpreter (this one)."""
    return start_pytest(sys.executable, ["-m", "not vllm", *files], os.environ, lowest=lowest)


#: The runs started in the background at the session's start, by name (tests/e2e/conftest.py).
started: dict[str, PytestRun] = {}


@contextmanager
def paused() -> Iterator[None]:
    """The background runs stopped (SIGSTOP to each one's process group) for a test whose timing
    depends on other processes getting the CPU at once, continued (SIGCONT) after, whatever happened.
    test_vllm_plugin's live switch sets a pin from this process while one request of 12-16 s runs. In
    2 of 2 e2e runs here with the background running beside it, the set missed the request in each of
    three tries (a fresh controllerctl took 8-15 s to start, an in-process call to the sidecar hit its
    deadline); in 1 run with it paused, the set missed at the first try and landed at the second."""
    running = [run for run in started.values() if run.proc.poll() is None]
    for run in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for run in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGCONT)
