"""benchmarks/sim_vs_engine.py killed outright while its vLLM server and sidecar run: both go with it
(they are asked to get SIGTERM when the benchmark dies). Here, not in tests/benchmarks, because it needs
vLLM's virtualenv, which only the e2e run (scripts/e2e_vllm.sh) provides."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.benchmarks.test_interrupt import (
    BENCH,
    ENDS_WITHIN_S,
    _group_alive,
    _processes_naming,
    _start,
)
from tests.e2e.harness import skip_module_without_vllm

skip_module_without_vllm()


@pytest.mark.vllm
@pytest.mark.integration
def test_sim_vs_engine_killed_leaves_no_engine_or_sidecar_running(short_tmp_path: Path) -> None:
    # The vLLM server runs in a session of its own (a terminal's Ctrl-C must not reach it before the
    # benchmark stops it): killed (SIGKILL, no finally runs), the benchmark left it and the sidecar
    # running for good. (Ctrl-C and SIGTERM take the finally path tests/benchmarks/test_interrupt.py
    # covers on the other scripts.)
    # Its TMPDIR (where the benchmark's run and vLLM's engine-core socket go) is short.
    tmp_path = short_tmp_path
    args = [str(BENCH / "sim_vs_engine.py"), "--requests", "2", "--max-tokens", "8", "--rounds", "1"]
    p = _start(args, tmp_path)
    assert p.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        while "engine up" not in "".join(lines):
            if p.poll() is not None:
                pytest.fail("ended before its engine was up:\n" + "".join(lines)[-3000:])
            time.sleep(0.2)
        running = _processes_naming(str(tmp_path))  # the sidecar and the vLLM server
        assert running
        # vLLM's own process group: its server, engine core and worker (the core names no path)
        groups = {os.getpgid(int(line.split(":")[0])) for line in running} - {p.pid}
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=ENDS_WITHIN_S)
        for _ in range(600):
            left = _processes_naming(str(tmp_path))
            if not left:
                break
            time.sleep(0.1)
        assert not left, left
        for _ in range(600):
            if not any(_group_alive(g) for g in groups):
                break
            time.sleep(0.1)
        assert not any(_group_alive(g) for g in groups), "vLLM's engine core outlived the run"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        for line in _processes_naming(str(tmp_path)):  # never leave an engine behind, even on failure
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(os.getpgid(int(line.split(":")[0])), signal.SIGKILL)  # (vLLM's own group)
