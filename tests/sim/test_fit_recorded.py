"""A run recorded by a real sidecar round-trips through ``profile fit``.

``controllerctl serve --record-steps`` runs as its own process; an embedded engine (the demo's
simulated engine, known step costs) drives it over real gRPC with the default adaptive policy, so K
and the method vary; SIGTERM stops it. Every step the engine ran is in the file exactly once, and the
fitted profile prices the recorded steps as the engine did.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import demo_workload
from sim.costmodel import DEFAULT_PROFILE, load_profile
from sim.engines import ENGINES
from sim.fit import features
from sim.steplog import read_steps

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the sidecar did not start"
        time.sleep(0.05)


def test_recorded_run_round_trips_through_profile_fit(tmp_path: Path) -> None:
    cfg = tmp_path / "sidecar.yaml"
    state = tmp_path / "state"
    cfg.write_text(
        f"state_dir: {state}\nengine_listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\n"
    )
    steps_file = tmp_path / "steps.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "controller.cli", "serve", "--config", str(cfg)]
    proc = subprocess.Popen([*cmd, "--record-steps", str(steps_file)], env=env, stderr=subprocess.PIPE)
    try:
        _wait_for(state / "endpoints.json", proc)
        target = json.loads((state / "endpoints.json").read_text())["engine"]
        engine = EmbeddedEngine(
            target=target,
            settings=EngineSettings(engine_id="rec"),
            workload=demo_workload(seed=3, duration_s=12.0),
            link=LinkSettings(time_scale=0.0, flush_interval_s=0.01, await_directive_s=5.0),
        )

        async def drive() -> None:
            await engine.start()
            await asyncio.wait_for(engine.wait(), 120)

        asyncio.run(drive())
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    steps = read_steps(steps_file)
    # Nothing lost or counted twice between the engine and the file.
    tot = engine.totals
    assert steps.n == tot.steps >= 500
    assert float(steps.duration_s.sum()) == pytest.approx(tot.virtual_s, rel=1e-9)
    assert int(steps.accepted.sum()) == tot.accepted
    assert len(set(steps.engine)) == 1
    f = features(steps, ENGINES["stock-vllm-ngram"])
    assert (f["eagle_forwards"] > 0).any() and (f["ngram_rows"] > 0).any()
    assert len(np.unique(steps.k)) >= 3 and len(np.unique(steps.batch)) >= 3

    out, png = tmp_path / "fitted.yaml", tmp_path / "resid.png"
    fit = subprocess.run(
        [
            *(sys.executable, "-m", "sim", "profile", "fit", str(steps_file)),
            *("--out", str(out), "--plot", str(png), "--engine", "stock-vllm-ngram"),
            *("--prompt-tokens", "400", "--json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fit.returncode == 0, fit.stderr
    res = json.loads(fit.stdout)
    assert res["steps"] == steps.n
    # The fitted profile prices the recorded steps as the engine's own cost model did.
    prof = load_profile(str(out))
    pred = prof.step_time(**features(steps, ENGINES["stock-vllm-ngram"], prompt_tokens=400))
    rel = np.abs(pred - steps.duration_s) / steps.duration_s
    assert float(np.median(rel)) < 0.02 and res["r2"] > 0.98
    # The engine's verify cost per batched token (its profile's) is recovered within 10 %.
    truth = load_profile(DEFAULT_PROFILE).target.batched_s_per_token
    assert prof.target.batched_s_per_token == pytest.approx(truth, rel=0.1)
