"""SIGKILL the sidecar process under load: engines serve on, fall back after the TTL, re-attach to
the restarted sidecar, which restores policy and statistics from its last periodic snapshot."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import demo_workload
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from tests.integration.test_restart import Served
from tests.integration.test_sidecar_grpc import STATIC_EAGLE3_2, until

pytestmark = pytest.mark.integration

ENGINES = 4
TTL_S = 3.0
POLICY = STATIC_EAGLE3_2.replace("directive_ttl_s: 10.0", f"directive_ttl_s: {TTL_S}")


@pytest.fixture
def setup(tmp_path: Path, short_tmp_path: Path) -> tuple[Path, Path, Path]:
    sock_dir = short_tmp_path  # (tests/conftest.py: a socket path holds 107 bytes)
    state = tmp_path / "state"
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"engine_listen: unix://{sock_dir}/engine.sock\n"
        "admin_listen: 127.0.0.1:0\n"
        "metrics_listen: ''\n"
        f"state_dir: {state}\n"
        "decision_tick_s: 0.02\n"
        "snapshot_interval_s: 0.2\n"
        "ack_interval_s: 0.05\n"
    )
    return cfg, state, sock_dir


def _engines(resp: pb.ListEnginesResponse) -> dict[str, Any]:
    return {
        e.engine_id: (e.steps, e.rejected, e.policy, [(a.context, a.arm.method, a.arm.k) for a in e.arms])
        for e in resp.engines
    }


async def test_sigkill_under_load(setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    cfg, state, _ = setup
    first = Served(cfg, state)
    engines = [
        EmbeddedEngine(
            target=first.engine,
            settings=EngineSettings(engine_id=f"e{i}"),
            workload=demo_workload(seed=i, duration_s=60.0),
            link=LinkSettings(time_scale=1.0, backoff_initial_s=0.02, backoff_max_s=0.1),
        )
        for i in range(ENGINES)
    ]
    second: Served | None = None
    try:
        async with grpc.aio.insecure_channel(first.admin) as ch:
            admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            await admin.SetPolicy(pb.SetPolicyRequest(yaml=POLICY, source="ttl.yaml"))
            for e in engines:
                await e.start()
            await until(lambda: all(e.core.directive.policy == "static-eagle3-2" for e in engines))
            snap = state / "sidecar-state.json"

            def snapshot_steps() -> dict[str, int]:
                try:
                    doc = json.loads(snap.read_text())
                except (OSError, ValueError):
                    return {}
                return {k: v["loop"]["totals"]["steps"] for k, v in doc["state"]["engines"].items()}

            await until(lambda: len(snapshot_steps()) == ENGINES and min(snapshot_steps().values()) > 0)
            live = _engines(await admin.ListEngines(pb.ListEnginesRequest()))
        before = {e.settings.engine_id: e.core.directive.version for e in engines}

        first.proc.kill()  # SIGKILL: no final snapshot
        first.proc.wait()
        killed_at = {e.settings.engine_id: e.totals.steps for e in engines}
        saved = json.loads(snap.read_text())["state"]

        # Engines keep serving on their last directive...
        await until(lambda: all(e.totals.steps > killed_at[e.settings.engine_id] + 5 for e in engines))
        assert {e.settings.engine_id: e.core.directive.version for e in engines} == before
        # ... then, past its TTL, on their safe default.
        await until(lambda: all(e.totals.fallbacks >= 1 for e in engines))
        assert all(e.core.directive.version == 0 for e in engines)

        # What the restarted sidecar will restore is the last snapshot: checked on a copy, before
        # any engine can re-attach and add to it.
        copy = tmp_path / "copy"
        shutil.copytree(state, copy)
        probe = Sidecar(
            config=SidecarConfig(
                engine_listen="127.0.0.1:0",
                admin_listen="127.0.0.1:0",
                metrics_listen="",
                state_dir=str(copy),
            ),
            registry=CollectorRegistry(),
        )
        await probe.start()
        try:
            restored = _engines(pb.ListEnginesResponse(engines=probe.status().engines))
            assert probe.policy_store.default.spec.name == "static-eagle3-2"
            assert probe.policy_store.default.revision == 2
            for eid, e in saved["engines"].items():
                st = probe.engines()[eid]
                assert st.loop.totals.steps == e["loop"]["totals"]["steps"]
                assert (st.instance_id, st.last_sequence) == (e["instance_id"], e["last_sequence"])
            assert {k: v[0] for k, v in restored.items()} == snapshot_steps()
            # Policy and learned arms as they were live before the kill (the static policy's arms do
            # not move, so the snapshot's copy equals the live one).
            assert {k: (v[2], v[3]) for k, v in restored.items()} == {
                k: (v[2], v[3]) for k, v in live.items()
            }
        finally:
            await probe.stop(snapshot=False)

        t0 = time.monotonic()
        second = Served(cfg, state)
        up = time.monotonic() - t0
        await until(lambda: all(e.core.directive.version > max(before.values()) for e in engines))
        reattach = time.monotonic() - t0
        async with grpc.aio.insecure_channel(second.admin) as ch:
            admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            policy = await admin.GetPolicy(pb.GetPolicyRequest())
            assert (policy.name, policy.revision, policy.source) == ("static-eagle3-2", 2, "ttl.yaml")
            after = _engines(await admin.ListEngines(pb.ListEnginesRequest()))
            assert all(after[k][0] >= saved["engines"][k]["loop"]["totals"]["steps"] for k in after)
            status = await admin.ListEngines(pb.ListEnginesRequest())
            assert all(e.connected for e in status.engines)
        print(
            f"\nsigkill: sidecar restarted in {up:.2f} s, {ENGINES} engines re-attached with the restored "
            f"policy {reattach:.2f} s after the restart began (target 2 s)"
        )
    finally:
        for e in engines:
            await e.stop()
        first.kill()
        if second is not None:
            rc, out = second.terminate()
            assert rc == 0, out
            second.kill()
