"""Engines churning over real gRPC: hundreds of attach/detach cycles beyond ``max_engines``, the same
ids re-attaching with new instances, racing Hellos, streams cancelled mid-flow.

What must hold after the churn: the registry never holds more than ``max_engines``, no engine is
shown connected (nor counted in the gauge) once its streams are gone, every metric series belongs to
an engine the sidecar holds, no asyncio task is left behind, and the sidecar still serves a new engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from controller.server import SidecarServer
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc

from .test_sidecar_grpc import WAIT_S, hello, loopback_config, sample, step, until

pytestmark = pytest.mark.integration


async def session(
    target: str, engine_id: str, instance: str, *, reports: int = 1, cancel: bool = False
) -> str:
    """One engine stream: Hello, a first directive, ``reports`` batches, then a clean close (or a
    cancel while batches are still in flight). Returns how it ended."""
    async with grpc.aio.insecure_channel(target) as ch:
        out: asyncio.Queue[pb.EngineMessage | None] = asyncio.Queue()
        h = hello(engine_id)
        h.instance_id = instance
        out.put_nowait(pb.EngineMessage(hello=h))

        async def messages() -> AsyncIterator[pb.EngineMessage]:
            while (m := await out.get()) is not None:
                yield m

        call = pb_grpc.EngineServiceStub(ch).Attach(messages())  # type: ignore[no-untyped-call]
        try:
            first = await asyncio.wait_for(call.read(), WAIT_S)
            assert first is not grpc.aio.EOF  # type: ignore[attr-defined]
            for s in range(reports):
                batch = pb.StepReportBatch(sequence=s + 1, steps=[step(t=1.0 + s, accepted=[1, 2])])
                out.put_nowait(pb.EngineMessage(reports=batch))
            if cancel:
                call.cancel()
                return "cancelled"
            out.put_nowait(None)
            while await asyncio.wait_for(call.read(), WAIT_S) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                pass
            return "ok"
        except grpc.aio.AioRpcError as e:
            return e.code().name


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[SidecarServer]:
    sc = SidecarServer(config=loopback_config(tmp_path, max_engines=20), registry=CollectorRegistry())
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


def consistent(sc: SidecarServer) -> None:
    engines = sc.engines()
    assert len(engines) <= sc.config.max_engines
    connected = [eid for eid, st in engines.items() if st.connected]
    assert sample(sc, "speccontrol_engines_connected") == len(connected)
    series = {
        s.labels["engine"]
        for m in sc.registry.collect()
        for s in m.samples
        if "engine" in s.labels and s.value
    }
    assert series <= set(engines), series - set(engines)


async def test_hundreds_of_engines_churning_beyond_max_engines_leave_nothing_behind(
    sidecar: SidecarServer,
) -> None:
    t = sidecar.engine_target
    await session(t, "warm", "w")
    tasks_before = {t.get_name() for t in asyncio.all_tasks()}
    ends: list[str] = []
    for r in range(15):  # 300 streams: 60 distinct ids, each back with a new instance
        ends += await asyncio.gather(
            *(session(t, f"e{(r * 20 + i) % 60}", f"i{r}", reports=2, cancel=i % 5 == 0) for i in range(20))
        )
        await until(lambda: not any(st.connected for st in sidecar.engines().values()))
        consistent(sidecar)
    assert set(ends) <= {"ok", "cancelled"}, ends
    # The handlers' and readers' tasks are gone (the poll of ``until`` is a task of its own).
    await until(lambda: len(asyncio.all_tasks()) <= len(tasks_before) + 1)
    assert await session(t, "late", "l") == "ok"
    consistent(sidecar)


async def test_racing_hellos_of_one_engine_id(sidecar: SidecarServer) -> None:
    """Two processes under one id at once: one is served, the other refused (ALREADY_EXISTS); two
    streams of one process (a re-attach while the old stream closes) are both served."""
    t = sidecar.engine_target
    for r in range(10):
        ends = await asyncio.gather(session(t, "dup", f"a{r}"), session(t, "dup", f"b{r}"))
        assert "ok" in ends and set(ends) <= {"ok", "ALREADY_EXISTS"}, ends
        same = await asyncio.gather(*(session(t, "same", "s", reports=0) for _ in range(4)))
        assert same == ["ok"] * 4
        await until(lambda: not any(st.connected for st in sidecar.engines().values()))
        consistent(sidecar)
    st = sidecar.engines()["dup"]
    assert st.loop.totals.steps >= 10  # every served stream's batch was applied


async def test_an_engine_flooding_past_its_rate_limit_leaves_the_others_served(tmp_path: Path) -> None:
    cfg = loopback_config(tmp_path, max_engine_steps_per_s=1.0, telemetry_burst_s=1.0, max_steps_per_batch=4)
    sc = SidecarServer(config=cfg, registry=CollectorRegistry())
    await sc.start()
    try:
        t = sc.engine_target
        flood, calm = await asyncio.gather(
            session(t, "flood", "f", reports=40), session(t, "calm", "c", reports=1)
        )
        assert flood == calm == "ok"
        assert sc.engines()["calm"].loop.totals.steps == 1 and sc.engines()["calm"].rejected == 0
        f = sc.engines()["flood"]
        # Each batch is applied or refused and counted, once; the stream stays up (it ended "ok").
        assert f.loop.totals.steps + f.rejected == 40 and f.rejected > 0
        assert sample(sc, "speccontrol_rejected_telemetry_total", reason="rate_limited") == f.rejected
    finally:
        await sc.stop()
