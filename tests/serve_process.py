"""A real ``controllerctl serve`` process for tests that drive the CLI against it (no test in here).

What must hold: the process is stopped (SIGTERM, then killed after 30 s) however the test ends, and a
sidecar that fails to start fails the test with its stderr.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CTL = str(Path(sys.executable).parent / "controllerctl")


@contextlib.contextmanager
def serve_process(directory: Path) -> Iterator[dict[str, str]]:
    """``controllerctl serve`` with its config and state in ``directory`` (keep it short when engines
    attach over its Unix socket: a socket's path is limited); yields its endpoints (endpoints.json:
    ``engine``, ``admin``)."""
    state = directory / "s"
    cfg = directory / "sidecar.yaml"
    cfg.write_text(f"state_dir: {state}\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\n")
    p = subprocess.Popen(
        [CTL, "serve", "--config", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT
    )
    try:
        endpoints = state / "endpoints.json"
        for _ in range(300):  # bounded: 30 s
            if endpoints.exists() or p.poll() is not None:
                break
            time.sleep(0.1)
        assert endpoints.exists(), p.stderr.read().decode() if p.stderr and p.poll() is not None else ""
        yield {k: str(v) for k, v in json.loads(endpoints.read_text()).items()}
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
