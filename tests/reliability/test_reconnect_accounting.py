"""An engine whose connection is cut mid-stream, again and again: every step counted exactly once.

Real sockets: the embedded engine talks to the sidecar through a loopback TCP proxy that aborts its
connections (RST) while batches are in flight. Report sequences run across streams for the engine
instance, the sidecar acknowledges what it applied, the engine resends the rest after reconnecting
and the sidecar drops what it already had.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import demo_workload
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from tests.integration.test_sidecar_grpc import WAIT_S, TestEngine, hello, loopback_config, step, until
from tests.reliability.proxy import CuttableProxy

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, **kw: object) -> SidecarConfig:
    return loopback_config(tmp_path, **{"decision_tick_s": 0.01, "ack_interval_s": 0.05, **kw})


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    sc = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop(snapshot=False)


def sample(sc: Sidecar, name: str, **labels: str) -> float:
    return sc.registry.get_sample_value(name, labels) or 0.0


async def test_cut_connections_lose_and_duplicate_nothing(sidecar: Sidecar) -> None:
    proxy = CuttableProxy(upstream=sidecar.engine_target)
    await proxy.start()
    engine = EmbeddedEngine(
        target=proxy.target,
        settings=EngineSettings(engine_id="cut"),
        workload=demo_workload(seed=1, duration_s=2.0),
        link=LinkSettings(
            time_scale=1.0, flush_interval_s=0.005, max_steps_per_batch=8, backoff_initial_s=0.02
        ),
    )
    try:
        await engine.start()
        cut = 0
        for _ in range(6):
            await until(lambda c=cut: engine.stats.connects > c)  # type: ignore[misc]
            await until(lambda: engine.stats.sent_steps > 0)
            await asyncio.sleep(0.15)
            if proxy.cut():
                cut += 1
        await asyncio.wait_for(engine.wait(), WAIT_S * 3)
    finally:
        await engine.stop()
        await proxy.stop()
    st = sidecar.engines()["cut"]
    sent = engine.totals.steps
    assert cut >= 3 and engine.stats.connects >= 4
    assert engine.stats.dropped_steps == 0 and engine.stats.evicted_steps == 0
    assert not engine.outstanding  # every batch acknowledged before the engine stopped
    # Exactly what the engine produced: nothing lost, nothing counted twice.
    assert (st.loop.totals.steps, st.loop.totals.drafted, st.loop.totals.accepted) == (
        sent,
        engine.totals.drafted,
        engine.totals.accepted,
    )
    assert sample(sidecar, "speccontrol_engine_steps_total", engine="cut") == sent
    assert sample(sidecar, "speccontrol_lost_report_batches_total", engine="cut") == 0
    assert st.last_sequence == engine.stats.acked_sequence
    print(
        f"\nreconnect accounting: {sent} steps, {cut} cuts, {engine.stats.connects} connects, "
        f"{engine.stats.resent_batches} batches resent, "
        f"{sample(sidecar, 'speccontrol_duplicate_reports_total', engine='cut'):.0f} duplicates dropped"
    )


async def test_resend_after_reconnect_is_dropped_and_counted(sidecar: Sidecar) -> None:
    """The protocol by hand: a new stream of the same instance starts from the acknowledged sequence."""
    h = hello("inst")
    h.instance_id = "a" * 32
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h))
    first = await eng.directive()
    assert first.HasField("acked_sequence") and first.acked_sequence == 0
    eng.report(step(t=1.0, accepted=[1, 2]))
    eng.report(step(t=1.1, accepted=[0, 2]))
    acked = await eng.directive(lambda d: d.acked_sequence == 2)  # a refresh carries the ack
    assert acked.version == first.version
    await eng.close()
    await until(lambda: not sidecar.engines()["inst"].connected)

    again = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h))
    try:
        d = await again.directive()
        assert d.acked_sequence == 2  # the new stream knows what the sidecar has
        # A resent batch 2 is a duplicate; batch 3 is new.
        again.out.put_nowait(
            pb.EngineMessage(reports=pb.StepReportBatch(sequence=2, steps=[step(t=1.1, accepted=[0, 2])]))
        )
        again.out.put_nowait(
            pb.EngineMessage(reports=pb.StepReportBatch(sequence=3, steps=[step(t=1.2, accepted=[1])]))
        )
        await until(lambda: sidecar.engines()["inst"].last_sequence == 3)
        assert sidecar.engines()["inst"].loop.totals.steps == 3
        assert sample(sidecar, "speccontrol_duplicate_reports_total", engine="inst") == 1
        # A gap (batch 4 never arrived) is counted as lost.
        again.out.put_nowait(
            pb.EngineMessage(reports=pb.StepReportBatch(sequence=5, steps=[step(t=1.3, accepted=[1])]))
        )
        await until(lambda: sidecar.engines()["inst"].loop.totals.steps == 4)
        assert sample(sidecar, "speccontrol_lost_report_batches_total", engine="inst") == 1
    finally:
        await again.close()

    # A new engine process (new instance id) starts its sequences again at 1.
    h2 = hello("inst")
    h2.instance_id = "b" * 32
    fresh = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h2))
    try:
        assert (await fresh.directive()).acked_sequence == 0
        fresh.report(step(t=2.0, accepted=[1]))
        await until(lambda: sidecar.engines()["inst"].loop.totals.steps == 5)
    finally:
        await fresh.close()


async def test_a_refused_batch_is_acknowledged_so_it_is_not_resent_forever(sidecar: Sidecar) -> None:
    h = hello("poison")
    h.instance_id = "c" * 32
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h))
    await eng.directive()
    eng.report(step(t=1.0, accepted=[3], drafted=2))  # accepted > drafted: refused
    with pytest.raises(grpc.aio.AioRpcError):
        await eng.directive(lambda d: False)
    await eng.close()
    again = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h))
    try:
        # Acknowledged once a snapshot holds it (the refusal consumed its sequence).
        await again.directive(lambda d: d.acked_sequence == 1)
    finally:
        await again.close()


async def test_engines_without_an_instance_id_keep_per_stream_sequences(sidecar: Sidecar) -> None:
    """Older engines (no Hello.instance_id): a new stream starts at 1 and is not a duplicate."""
    for t in (1.0, 2.0):
        eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello("old")))
        try:
            await eng.directive()
            eng.report(step(t=t, accepted=[1]))
            await until(lambda t=t: sidecar.engines()["old"].loop.totals.steps == int(t))  # type: ignore[misc]
        finally:
            await eng.close()
        await until(lambda: not sidecar.engines()["old"].connected)


async def test_rate_limited_batches_are_refused_counted_and_the_stream_stays(tmp_path: Path) -> None:
    sc = Sidecar(
        config=_config(tmp_path, max_engine_steps_per_s=1.0, telemetry_burst_s=2.0, max_steps_per_batch=2),
        registry=CollectorRegistry(),
    )
    await sc.start()
    try:
        h = hello("fast")
        h.instance_id = "d" * 32
        eng = TestEngine(sc.engine_target, pb.EngineMessage(hello=h))
        try:
            await eng.directive()
            for i in range(3):  # burst of 2 steps, then refused
                eng.report(step(t=float(i), accepted=[1]))
            await until(
                lambda: sample(sc, "speccontrol_rejected_telemetry_total", reason="rate_limited") == 1
            )
            assert sc.engines()["fast"].loop.totals.steps == 2
            assert sc.engines()["fast"].connected
            await eng.directive(lambda d: d.acked_sequence == 3)  # refused for good: acknowledged
        finally:
            await eng.close()
    finally:
        await sc.stop(snapshot=False)


async def test_a_flood_over_the_rate_limit_is_logged_once_not_per_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The stream stays up for a rate-limited engine, so each of its batches was refused with a warning
    # line of its own: an engine sending one-step batches as fast as it could wrote the sidecar's log
    # as fast (20,000 batches, 19,992 lines), the flood the limit is there to stop.
    sc = Sidecar(
        config=_config(tmp_path, max_engine_steps_per_s=1.0, telemetry_burst_s=2.0, max_steps_per_batch=2),
        registry=CollectorRegistry(),
    )
    await sc.start()
    caplog.set_level(logging.WARNING, logger="controller.sidecar")
    try:
        eng = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello("flood")))
        try:
            await eng.directive()
            for i in range(500):  # burst of 2 steps, then 498 refused
                eng.report(step(t=float(i), accepted=[1]))
            await until(
                lambda: sample(sc, "speccontrol_rejected_telemetry_total", reason="rate_limited") == 498
            )
            assert sc.engines()["flood"].connected and sc.engines()["flood"].rejected == 498
        finally:
            await eng.close()
    finally:
        await sc.stop(snapshot=False)
    lines = [r.getMessage() for r in caplog.records if "rate_limited" in r.getMessage()]
    assert len(lines) == 1, len(lines)


async def test_too_many_engines_forgets_idle_ones_then_refuses(tmp_path: Path) -> None:
    sc = Sidecar(config=_config(tmp_path, max_engines=2), registry=CollectorRegistry())
    await sc.start()
    try:
        a = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello("a")))
        await a.directive()
        await a.close()
        await until(lambda: not sc.engines()["a"].connected)
        b = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello("b")))
        c = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello("c")))
        try:
            await b.directive()
            await c.directive()  # "a" was idle: forgotten to make room
            assert sorted(sc.engines()) == ["b", "c"]
            d = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello("d")))
            try:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await d.directive()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert sample(sc, "speccontrol_rejected_telemetry_total", reason="too_many_engines") == 1
            finally:
                await d.close()
        finally:
            await b.close()
            await c.close()
    finally:
        await sc.stop(snapshot=False)
