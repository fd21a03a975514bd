"""``controllerctl serve`` as a real child process, for tests that SIGKILL and restart it.

Its output goes to a file (a pipe nobody reads would block a chatty sidecar once full).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.test_sidecar_grpc import WAIT_S

REPO = Path(__file__).resolve().parents[2]
CTL = [sys.executable, "-c", "import sys; from controller.cli import main; sys.exit(main())"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


class Serve:
    """``controllerctl serve --config FILE``, up once its endpoints file names its pid."""

    def __init__(self, config: Path, state: Path, *, log: Path | None = None) -> None:
        self.endpoints = state / "endpoints.json"
        self.log = log if log is not None else state.parent / "serve.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*CTL, "serve", "--config", str(config)],
                cwd=REPO,
                env=ENV,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + WAIT_S
        while True:
            if self.endpoints.exists():
                try:
                    ep = json.loads(self.endpoints.read_text())
                except ValueError:
                    ep = {}
                if ep.get("pid") == self.proc.pid:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait(timeout=WAIT_S)
                raise AssertionError(f"sidecar did not come up (rc {self.proc.returncode}): {self.output()}")
            time.sleep(0.02)
        self.admin: str = ep["admin"]
        self.engine: str = ep["engine"]
        self.metrics: str = ep["metrics"]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=WAIT_S)

    def stop(self) -> int:
        """SIGTERM and wait (SIGKILL if it hangs); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    """``controllerctl ARGS`` to completion."""
    return subprocess.run([*CTL, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=WAIT_S)
