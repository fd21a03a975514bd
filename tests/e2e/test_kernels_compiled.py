"""The step kernels compiled with the numba vLLM ships, in vLLM's own environment.

The project's environment need not have numba (the kernels then run as plain Python, the path the
rest of the suite tests); the plugin runs compiled inside vLLM. This runs the kernel tests there:
every ``kernels``-parametrised test in both modes, the index against vLLM's own matcher, and the device
drafter's Triton kernels (in Triton's interpreter, and compiled for CUDA targets without a GPU).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.e2e import background, compiled_kernels
from tests.e2e.compiled_kernels import COMPILED
from tests.e2e.harness import ROOT, VLLM_PY


@pytest.mark.vllm
@pytest.mark.integration
def test_kernel_tests_pass_compiled_in_the_vllm_environment() -> None:
    if not VLLM_PY.exists():
        if os.environ.get("SPECCONTROL_REQUIRE_VLLM"):
            pytest.fail(f"the vLLM virtualenv {VLLM_PY.parent.parent} is missing")
        pytest.skip(f"the vLLM virtualenv {VLLM_PY.parent.parent} is missing")
    run = background.started.get("kernels") or compiled_kernels.start(background=False)
    returncode, out = run.result()
    assert returncode == 0, out[-4000:]
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
