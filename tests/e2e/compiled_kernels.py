"""The run behind tests/e2e/test_kernels_compiled.py: the step-kernel tests, compiled, in vLLM's
environment (a pytest of its own there), in the foreground, or in the background beside the engine
tests (tests/e2e/background.py).
"""

from __future__ import annotations

import os
import re
import subprocess

from tests.e2e.background import PytestRun, start_pytest
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


def start(*, background: bool) -> PytestRun:
    """Start the run. Only the compiled half of each ``kernels`` test in files the project's suite runs
    whole: their plain-Python half ran there. Files needing torch, Triton or vLLM run both halves here,
    the only place they run (SPECCONTROL_NUMBA=0 runs the plugin's kernels as Python inside vLLM)."""
    numba_only = [f for f in COMPILED if not _NEEDS_VLLM_PACKAGES.search((ROOT / f).read_text())]
    env = {
        **os.environ,
        "PYTHONPATH": checkout_pythonpath(),
        "SPECCONTROL_KERNELS_NUMBA_ONLY": os.pathsep.join(numba_only),
    }
    workers: list[str] = []
    if not background:
        # Two workers where vLLM's environment has pytest-xdist (scripts/e2e_vllm.sh installs it): the
        # longest test (the device drafter at serving sizes in Triton's interpreter, ~50 s) then runs
        # beside the others (134 -> 91 s on the 2-core development machine, 148 -> 99 s in CI, when CI still
        # ran it alone).
        xdist = subprocess.run([str(VLLM_PY), "-c", "import xdist"], capture_output=True).returncode == 0
        workers = ["-n", "2"] if xdist else []
    return start_pytest(VLLM_PY, [*workers, *COMPILED], env, lowest=background)
