"""``python -m controller.serve`` as a real process: SIGTERM, snapshot, restart, nothing lost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from tests.integration.test_sidecar_grpc import STATIC_EAGLE3_2, WAIT_S, TestEngine, hello, step

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


class Served:
    """One ``python -m controller.serve`` process and the endpoints it wrote."""

    def __init__(self, config: Path, state: Path) -> None:
        self.endpoints_file = state / "endpoints.json"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controller.serve", "--config", str(config)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        deadline = time.monotonic() + WAIT_S
        while True:
            if self.endpoints_file.exists():
                ep = json.loads(self.endpoints_file.read_text())
                if ep["pid"] == self.proc.pid:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = self.proc.communicate(timeout=WAIT_S)[0] if self.proc.poll() is not None else ""
                raise AssertionError(f"sidecar did not come up (rc {self.proc.returncode}): {out}")
            time.sleep(0.02)
        self.engine: str = ep["engine"]
        self.admin: str = ep["admin"]

    def terminate(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=WAIT_S)
        return self.proc.returncode, out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def config(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    state = tmp_path / "state"
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        "engine_listen: 127.0.0.1:0\n"
        "admin_listen: 127.0.0.1:0\n"
        "metrics_listen: ''\n"
        f"state_dir: {state}\n"
        "decision_tick_s: 0.02\n"
        "snapshot_interval_s: 3600\n"
    )
    yield cfg, state


def _engines(resp: pb.ListEnginesResponse) -> dict[str, Any]:
    """What must survive a restart: totals, policy, arms and their estimates."""
    return {
        e.engine_id: (
            e.model,
            e.steps,
            e.rejected,
            e.acceptance_rate,
            e.policy,
            e.max_k,
            [(a.context, a.arm.method, a.arm.k, a.goodput_tok_s) for a in e.arms],
        )
        for e in resp.engines
    }


async def test_restart_keeps_policy_and_statistics(config: tuple[Path, Path]) -> None:
    cfg, state = config
    first = Served(cfg, state)
    try:
        eng = TestEngine(first.engine, pb.EngineMessage(hello=hello("e1")))
        async with grpc.aio.insecure_channel(first.admin) as ch:
            admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            d0 = await eng.directive()
            await admin.SetPolicy(pb.SetPolicyRequest(yaml=STATIC_EAGLE3_2, source="static.yaml"))
            d1 = await eng.directive(lambda d: d.policy == "static-eagle3-2")
            for i in range(5):
                eng.report(step(t=float(i), accepted=[2, 1, i % 3]))

            async def learned() -> pb.ListEnginesResponse:
                while True:
                    resp: pb.ListEnginesResponse = await admin.ListEngines(pb.ListEnginesRequest())
                    e = resp.engines[0]
                    if e.steps == 5 and any(a.goodput_tok_s > 0 for a in e.arms):
                        return resp
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(learned(), WAIT_S)
            await eng.close()

            async def detached() -> pb.ListEnginesResponse:
                while True:
                    resp: pb.ListEnginesResponse = await admin.ListEngines(pb.ListEnginesRequest())
                    if not resp.engines[0].connected:
                        return resp
                    await asyncio.sleep(0.02)

            before = _engines(await asyncio.wait_for(detached(), WAIT_S))
            policy_before = await admin.GetPolicy(pb.GetPolicyRequest())
        rc, out = first.terminate()
        assert rc == 0, out
        assert "sidecar listening" in out
    finally:
        first.kill()

    assert before["e1"][1] == 5
    assert (policy_before.name, policy_before.revision) == ("static-eagle3-2", 2)

    second = Served(cfg, state)
    try:
        async with grpc.aio.insecure_channel(second.admin) as ch:
            admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            policy_after = await admin.GetPolicy(pb.GetPolicyRequest())
            assert (policy_after.name, policy_after.revision, policy_after.source) == (
                "static-eagle3-2",
                2,
                "static.yaml",
            )
            listed = await admin.ListEngines(pb.ListEnginesRequest())
            assert [e.connected for e in listed.engines] == [False]
            assert _engines(listed) == before
            # Directive versions keep increasing across the restart.
            eng = TestEngine(second.engine, pb.EngineMessage(hello=hello("e1")))
            d2 = await eng.directive()
            assert d2.version > d1.version > d0.version
            assert d2.policy == "static-eagle3-2"
            await eng.close()
        rc, out = second.terminate()
        assert rc == 0, out
    finally:
        second.kill()


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("fleet: x\ndecision_tick_s: 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "controller.serve", "--config", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WAIT_S * 3,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2
    assert proc.stderr == f"error: {cfg}:2: decision_tick_s: must be between 0.005 and 60.0, got 0\n"
