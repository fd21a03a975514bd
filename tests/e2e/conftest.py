"""How the end-to-end tests share the machine: where a session runs the compiled step-kernel tests
(test_kernels_compiled.py) and real engines, the kernel tests start in the background as the session
starts, at the lowest CPU priority, and their test runs last, to collect the result. The engines run
one after another as before; the kernel tests take the CPU they leave (tests/e2e/compiled_kernels.py).
"""

from __future__ import annotations

import pytest

from tests.e2e import compiled_kernels
from tests.e2e.harness import VLLM_PY

KERNEL_TEST = "test_kernels_compiled.py::test_kernel_tests_pass_compiled_in_the_vllm_environment"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kernel = [i for i in items if i.nodeid.endswith(KERNEL_TEST)]
    engines = [i for i in items if i.get_closest_marker("vllm") and not i.nodeid.endswith(KERNEL_TEST)]
    if not kernel or not engines or config.option.collectonly or not VLLM_PY.exists():
        return
    items[:] = [i for i in items if i not in kernel] + kernel
    if compiled_kernels.background is None:
        compiled_kernels.background = compiled_kernels.start(background=True)


def pytest_sessionfinish() -> None:
    # (a session that ended before the kernel test collected the run: -x, Ctrl-C)
    if compiled_kernels.background is not None:
        compiled_kernels.background.stop()
