"""kill -9 of a real ``controllerctl serve`` loses no telemetry (issue 15): the sidecar acknowledges only
batches a written snapshot holds, so the engines keep the rest and resend them to the restarted sidecar.

Engines stream at 100 steps/s while the sidecar is SIGKILLed twice mid-stream (periodic snapshots
are off: only the acknowledgement-driven ones run). At the end each engine's step count in the
sidecar equals exactly what the engine made and sent, nothing was dropped or evicted on the engine.
Only counts are asserted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import demo_workload
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from tests.integration.test_sidecar_grpc import WAIT_S, until
from tests.reliability.serve_process import Serve

pytestmark = pytest.mark.integration

ENGINES = 3
KILLS = 2


@pytest.fixture
def sock_dir(short_tmp_path: Path) -> Path:
    return short_tmp_path  # (tests/conftest.py: a socket path holds 107 bytes)


def _grew(engines: list[EmbeddedEngine], counter: str, *, by: int) -> Callable[[], bool]:
    """True once every engine's ``stats.<counter>`` is more than ``by`` above its value now."""
    before = [getattr(e.stats, counter) for e in engines]
    return lambda: all(getattr(e.stats, counter) > n + by for e, n in zip(engines, before, strict=True))


async def test_kill9_loses_no_applied_batch(tmp_path: Path, sock_dir: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"engine_listen: unix://{sock_dir}/engine.sock\n"
        "admin_listen: 127.0.0.1:0\n"
        "metrics_listen: ''\n"
        f"state_dir: {state}\n"
        "decision_tick_s: 0.02\n"
        "snapshot_interval_s: 3600\n"  # no periodic snapshot: acknowledgements alone drive the writes
        "ack_interval_s: 0.3\n"
    )
    log = tmp_path / "serve.log"
    served = await asyncio.to_thread(Serve, cfg, state, log=log)
    link = LinkSettings(time_scale=1.0, flush_interval_s=0.02, backoff_initial_s=0.02, backoff_max_s=0.2)
    engines = [
        EmbeddedEngine(
            target=served.engine,
            settings=EngineSettings(engine_id=f"k{i}"),
            workload=demo_workload(seed=i, duration_s=12.0),
            link=link,
        )
        for i in range(ENGINES)
    ]
    try:
        for e in engines:
            await e.start()
        for _ in range(KILLS):
            # Kill while batches are in flight and some are applied but not yet on disk.
            await until(_grew(engines, "sent_steps", by=50))
            served.kill9()
            reconnected = _grew(engines, "connects", by=0)
            served = await asyncio.to_thread(Serve, cfg, state, log=log)
            await until(reconnected)
        for e in engines:
            await asyncio.wait_for(e.wait(), 60 + WAIT_S * 4)
        async with grpc.aio.insecure_channel(served.admin) as ch:
            admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            listed = {
                x.engine_id: x.steps for x in (await admin.ListEngines(pb.ListEnginesRequest())).engines
            }
        assert served.stop() == 0
    finally:
        for e in engines:
            await e.stop()
        served.stop()
    for e in engines:
        eid = e.settings.engine_id
        s = e.stats
        assert s.dropped_steps == 0 and s.evicted_steps == 0 and not e.outstanding, (eid, s)
        assert listed[eid] == e.totals.steps == s.sent_steps, (eid, listed[eid], e.totals.steps, s)
        assert s.resent_batches > 0, (eid, s)  # the kills did leave batches to resend
    assert "Traceback" not in log.read_text(errors="replace")
