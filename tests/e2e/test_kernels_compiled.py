"""The step kernels compiled with the numba vLLM ships, in vLLM's own environment.

The project's environment need not have numba (the kernels then run as plain Python, the path the
rest of the suite tests); the plugin runs compiled inside vLLM. This runs the kernel tests there:
every ``kernels``-parametrised test in both modes, the index against vLLM's own matcher, and the device
drafter's Triton kernels (in Triton's interpreter, and compiled for CUDA targets without a GPU).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

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


@pytest.mark.vllm
@pytest.mark.integration
def test_kernel_tests_pass_compiled_in_the_vllm_environment() -> None:
    if not VLLM_PY.exists():
        if os.environ.get("SPECCONTROL_REQUIRE_VLLM"):
            pytest.fail(f"the vLLM virtualenv {VLLM_PY.parent.parent} is missing")
        pytest.skip(f"the vLLM virtualenv {VLLM_PY.parent.parent} is missing")
    # Only the compiled half of each ``kernels`` test in files the project's suite runs whole: their
    # plain-Python half ran there (in this run it took about a quarter of the time). Files needing
    # torch, Triton or vLLM run both halves here, the only place they run (SPECCONTROL_NUMBA=0 runs
    # the plugin's kernels as Python inside vLLM).
    numba_only = [f for f in COMPILED if not _NEEDS_VLLM_PACKAGES.search((ROOT / f).read_text())]
    env = {
        **os.environ,
        "PYTHONPATH": checkout_pythonpath(),
        "SPECCONTROL_KERNELS_NUMBA_ONLY": os.pathsep.join(numba_only),
    }
    # Two workers where vLLM's environment has pytest-xdist (scripts/e2e_vllm.sh installs it): the
    # longest test (the device drafter at serving sizes in Triton's interpreter, ~50 s) then runs
    # beside the others (this test: 134 -> 91 s on the 2-core development machine, 148 -> 99 s in CI).
    xdist = subprocess.run([str(VLLM_PY), "-c", "import xdist"], capture_output=True).returncode == 0
    workers = ["-n", "2"] if xdist else []
    proc = subprocess.run(
        [str(VLLM_PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *workers, *COMPILED],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # Nothing skipped for want of numba or vLLM: the compiled path and vLLM's matcher both ran.
    assert "numba is not installed" not in out and "could not import" not in out, out[-4000:]
    assert "torch is not installed" not in out, out[-4000:]
    # The device drafter's Triton kernels ran (interpreted) and compiled for CUDA targets.
    assert "triton is not installed" not in out and "ptxas" not in out, out[-4000:]


#: What makes a test file need vLLM's environment: the kernels fixture (its numba half skips here) or a
#: skip for want of one of vLLM's packages.
_NEEDS_VLLM_ENV = re.compile(
    r"usefixtures\(\"kernels\"\)|(numba|torch|triton) is not installed|importorskip\(\"(numba|torch|triton|vllm)"
)


def test_every_test_that_skips_here_runs_in_the_vllm_environment() -> None:
    # tests/controller/vllm/test_engine_hooks.py skipped its warm-up test here and was missing above:
    # it ran nowhere.
    needing = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if p.name != Path(__file__).name and _NEEDS_VLLM_ENV.search(p.read_text(encoding="utf-8"))
    }
    assert needing - set(COMPILED) == set()
