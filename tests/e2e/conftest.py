"""How the end-to-end session shares the machine (tests/e2e/background.py): the compiled step-kernel
tests and the project tests ``make test`` hands over start in the background as the session starts,
at the lowest CPU priority, beside the engine tests, which run one after another as before; the tests
that collect their results run last. vLLM's processes talk over ZeroMQ sockets it makes in
``VLLM_RPC_BASE_PATH`` (the temporary directory by default) and leaves there when a process is ended
by a signal: the session gives them a directory of their own, removed at its end (each run of the
end-to-end tests left about 150 in /tmp).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.e2e import background, compiled_kernels
from tests.e2e.harness import VLLM_PY

KERNEL_TEST = "test_kernels_compiled.py::test_kernel_tests_pass_compiled_in_the_vllm_environment"
BESIDE_TEST = "test_beside_engines.py::test_the_project_tests_run_beside_the_engines_pass"


@pytest.hookimpl(trylast=True)  # after -m and -k deselected: the project's suite selects none of these
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.collectonly:
        return
    last = [i for i in items if i.nodeid.endswith((KERNEL_TEST, BESIDE_TEST))]
    items[:] = [i for i in items if i not in last] + last
    collecting = {i.nodeid.rsplit("/", 1)[-1] for i in last}
    engines = any(i.get_closest_marker("vllm") for i in items if i not in last)
    if KERNEL_TEST in collecting and engines and VLLM_PY.exists() and "kernels" not in background.started:
        background.started["kernels"] = compiled_kernels.start(background=True)
    files = background.beside_files()
    if BESIDE_TEST in collecting and files and "beside" not in background.started:
        background.started["beside"] = background.start_beside(files, lowest=True)


def pytest_sessionfinish() -> None:
    # (a session that ended before a run's result was collected: -x, Ctrl-C)
    for run in background.started.values():
        run.stop()


@pytest.fixture(scope="session", autouse=True)
def _vllm_sockets_kept_apart() -> Iterator[None]:
    # Short (a socket's path has at most 107 bytes, and vLLM adds a 36-character name); every engine
    # process the tests start inherits it through the environment.
    d = tempfile.mkdtemp(prefix="vllm-rpc-")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_RPC_BASE_PATH", d)
            yield
    finally:
        shutil.rmtree(d, ignore_errors=True)
