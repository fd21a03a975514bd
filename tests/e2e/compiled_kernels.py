"""The run behind tests/e2e/test_kernels_compiled.py: the step-kernel tests, compiled, in vLLM's
environment (a pytest of its own there), in the foreground, or in the background beside the engine
tests (tests/e2e/conftest.py).

In the background it runs as one process at the lowest CPU priority: an engine test keeps about one
core of the 2-core CI machine busy (vmstat over a serial e2e run: 45-50 % CPU outside the kernel
tests), but a two-rank engine needs both, and must not be slowed (its step timing, its sidecar's
deadlines). What the engines leave, the kernel tests take.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import IO

from tests.e2e.harness import ROOT, VLLM_PY, checkout_pythonpath

#: The test files that run here for want of numba, torch, Triton or vLLM in the project's environment.
COMPILED = [
    "tests/controller/vllm/test_ngram.py",
    "tests/controller/vllm/test_ngram_long.py",
    "tests/controller/vllm/test_hotpath.py",
    "tests/controller/vllm/test_engine_hooks.py",
    "tests/controller/vllm/test_worker.py",
    "tests/controller/vllm/test_device_ngram.py",
    "tests/controller/vllm/test_device_kernels.py",
    "tests/controller/vllm/test_ranks.py",
    "tests/controller/vllm/test_v2.py",
    "tests/controller/vllm/test_v2_hostile.py",
    "tests/controller/vllm/test_device_ngram_hostile.py",
    "tests/controller/vllm/test_hotpath_hostile.py",
    "tests/controller/vllm/test_ngram_hostile.py",
    "tests/controller/vllm/test_engine_hooks_hostile.py",
    "tests/controller/vllm/test_request_reuse.py",
    "tests/controller/vllm/test_ngram_burst.py",
    "tests/benchmarks/test_worker_drafter.py",
    "tests/benchmarks/test_outputs.py",
    "tests/policies/test_rules.py",
    "tests/policies/test_jit.py",
    "tests/policies/test_engine_rules.py",
]


#: What makes a file's tests skip in the project's environment beyond the compiled half: a package
#: only vLLM's environment has.
_NEEDS_VLLM_PACKAGES = re.compile(r"(torch|triton) is not installed|importorskip\(\"(torch|triton|vllm)")

#: The whole run's limit.
TIMEOUT_S = 1800.0


@dataclass
class CompiledRun:
    """One pytest run of ``COMPILED`` in vLLM's environment; its output goes to a temporary file."""

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


def start(*, background: bool) -> CompiledRun:
    """Start the run. Only the compiled half of each ``kernels`` test in files the project's suite runs
    whole: their plain-Python half ran there. Files needing torch, Triton or vLLM run both halves here,
    the only place they run (SPECCONTROL_NUMBA=0 runs the plugin's kernels as Python inside vLLM)."""
    numba_only = [f for f in COMPILED if not _NEEDS_VLLM_PACKAGES.search((ROOT / f).read_text())]
    env = {
        **os.environ,
        "PYTHONPATH": checkout_pythonpath(),
        "SPECCONTROL_KERNELS_NUMBA_ONLY": os.pathsep.join(numba_only),
    }
    if background:  # one process, one thread, the lowest priority
        prefix, workers = ["nice", "-n", "19"], []
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    else:
        # Two workers where vLLM's environment has pytest-xdist (scripts/e2e_vllm.sh installs it): the
        # longest test (the device drafter at serving sizes in Triton's interpreter, ~50 s) then runs
        # beside the others (134 -> 91 s on the 2-core development machine, 148 -> 99 s in CI).
        xdist = subprocess.run([str(VLLM_PY), "-c", "import xdist"], capture_output=True).returncode == 0
        prefix, workers = [], (["-n", "2"] if xdist else [])
    out = tempfile.TemporaryFile()  # noqa: SIM115 - closed by CompiledRun.result, after the run
    proc = subprocess.Popen(
        [*prefix, str(VLLM_PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *workers, *COMPILED],
        cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return CompiledRun(proc, out)


#: The run started in the background at the session's start, if one was (tests/e2e/conftest.py).
background: CompiledRun | None = None
