"""The sidecar over real gRPC sockets on loopback (ephemeral ports): engine stream, admin, health, metrics."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.wire.codec import request_steps

pytestmark = pytest.mark.integration

#: Only a guard against hangs; no test asserts on how fast anything happens.
WAIT_S = 10.0

STATIC_EAGLE3_2 = """\
apiVersion: speccontrol/v1
kind: Policy
metadata:
  name: static-eagle3-2
spec:
  algorithm:
    name: static
    params:
      arm: "eagle3:2"
  decision_interval_s: 0.05
  directive_ttl_s: 10.0
  min_dwell_s: 0.0
"""

BROKEN = """\
apiVersion: speccontrol/v1
kind: Policy
metadata:
  name: broken
spec:
  algorithm:
    name: static
    params:
      arm: "eagle3:2"
  decision_interval_s: -5
"""


def hello(engine_id: str = "e1") -> pb.Hello:
    arms = [pb.Arm(method="eagle3", k=k) for k in (1, 2, 3, 4)] + [
        pb.Arm(method="ngram", k=4),
        pb.Arm(method="off"),
    ]
    return pb.Hello(
        engine_id=engine_id,
        model="tiny",
        max_k=4,
        arms=arms,
        granularity=pb.GRANULARITY_BATCH_STEP,
        max_batch_size=64,
        engine_version="test 0",
        protocol_version=1,
    )


def step(
    *, t: float, accepted: list[int], k: int = 2, method: str = "eagle3", drafted: int | None = None
) -> pb.StepReport:
    n = len(accepted)
    return pb.StepReport(
        time_s=t,
        duration_s=0.02,
        batch_size=n,
        queue_length=3,
        queue_wait_s=0.5,
        scheduled_k=k,
        requests=request_steps(
            request_ids=[f"r{i}" for i in range(n)],
            classes=["default"] * n,
            methods=[method] * n,
            ks=[k] * n,
            drafted=[k if drafted is None else drafted] * n,
            accepted=accepted,
        ),
    )


class TestEngine:
    """An engine on a real channel: Hello first, then whatever the test queues."""

    __test__ = False

    def __init__(self, target: str, first: pb.EngineMessage) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.out: asyncio.Queue[pb.EngineMessage | None] = asyncio.Queue()
        self.out.put_nowait(first)
        self.call = pb_grpc.EngineServiceStub(self.channel).Attach(self._messages())  # type: ignore[no-untyped-call]
        self.seq = 0

    async def _messages(self) -> AsyncIterator[pb.EngineMessage]:
        while (m := await self.out.get()) is not None:
            yield m

    def report(self, *steps: pb.StepReport) -> None:
        self.seq += 1
        self.out.put_nowait(pb.EngineMessage(reports=pb.StepReportBatch(sequence=self.seq, steps=steps)))

    async def directive(self, pred: Callable[[pb.Directive], bool] = lambda d: True) -> pb.Directive:
        async def read() -> pb.Directive:
            while True:
                d = await self.call.read()
                assert d is not grpc.aio.EOF, "stream ended"  # type: ignore[attr-defined]
                assert isinstance(d, pb.Directive)
                if pred(d):
                    return d

        return await asyncio.wait_for(read(), WAIT_S)

    async def close(self) -> None:
        self.out.put_nowait(None)
        await self.channel.close(None)


def loopback_config(tmp_path: Path, **overrides: object) -> SidecarConfig:
    """A sidecar on loopback with ephemeral ports, its state under ``tmp_path``, no metrics listener and
    a fast decision tick: what the socket-level tests start from (``overrides`` on top)."""
    fields: dict[str, object] = {
        "engine_listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "metrics_listen": "",
        "state_dir": str(tmp_path / "state"),
        "decision_tick_s": 0.02,
        **overrides,
    }
    return SidecarConfig(**fields)  # type: ignore[arg-type]


def _config(tmp_path: Path) -> SidecarConfig:
    return loopback_config(tmp_path, metrics_listen="127.0.0.1:0")


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    sc = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


@pytest.fixture
async def admin(sidecar: Sidecar) -> AsyncIterator[pb_grpc.AdminServiceStub]:
    async with grpc.aio.insecure_channel(sidecar.admin_target) as ch:
        yield pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]


async def until(cond: Callable[[], object]) -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), WAIT_S)


def sample(sc: Sidecar, name: str, **labels: str) -> float | None:
    return sc.registry.get_sample_value(name, labels)


async def test_engine_attaches_streams_reports_and_gets_directives(sidecar: Sidecar) -> None:
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello()))
    try:
        first = await eng.directive()
        assert first.version >= 1
        assert first.policy == "default"
        assert first.ttl_s == 10.0
        eng.report(step(t=1.0, accepted=[2, 1, 0]), step(t=1.1, accepted=[1, 1, 1]))
        eng.report(step(t=1.2, accepted=[0, 0, 2]))
        await until(lambda: sidecar.engines()["e1"].loop.totals.steps == 3)
        labels = {"engine": "e1", "method": "eagle3", "k": "2"}
        assert sample(sidecar, "speccontrol_drafted_tokens_total", **labels) == 18
        assert sample(sidecar, "speccontrol_accepted_tokens_total", **labels) == 8
        assert sample(sidecar, "speccontrol_emitted_tokens_total", **labels) == 17
        assert sample(sidecar, "speccontrol_acceptance_rate", **labels) == pytest.approx(8 / 18)
        assert sample(sidecar, "speccontrol_mean_accepted_per_step", **labels) == pytest.approx(8 / 9)
        assert sample(sidecar, "speccontrol_queue_wait_seconds", engine="e1") == pytest.approx(0.5)
        assert sample(sidecar, "speccontrol_queue_length", engine="e1") == 3
        assert sample(sidecar, "speccontrol_engines_connected") == 1
        current = sidecar.engines()["e1"].directive
        assert current is not None and current.version >= first.version
        assert sample(sidecar, "speccontrol_directive_version", engine="e1") == current.version
        # A replayed batch (same sequence) is dropped and counted, not observed twice.
        eng.out.put_nowait(
            pb.EngineMessage(reports=pb.StepReportBatch(sequence=eng.seq, steps=[step(t=1.3, accepted=[1])]))
        )
        await until(lambda: sample(sidecar, "speccontrol_duplicate_reports_total", engine="e1") == 1)
        assert sidecar.engines()["e1"].loop.totals.steps == 3
    finally:
        await eng.close()


async def test_set_policy_changes_the_directive(sidecar: Sidecar, admin: pb_grpc.AdminServiceStub) -> None:
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello()))
    watch = admin.WatchDecisions(pb.WatchDecisionsRequest(engine_id="e1"))
    try:
        first = await eng.directive()
        # The watch's handler must be subscribed before the change, or it never sees its decision
        # (a race CI's two workers lost once).
        await until(lambda: sidecar.watcher_count == 1)
        info = await admin.SetPolicy(pb.SetPolicyRequest(yaml=STATIC_EAGLE3_2, source="static.yaml"))
        assert (info.name, info.revision, info.source) == ("static-eagle3-2", 2, "static.yaml")
        d = await eng.directive(lambda d: d.policy == "static-eagle3-2")
        assert d.version > first.version
        assert [(r.bs_min, r.bs_max, r.k) for r in d.k_table] == [(1, 0, 2)]
        assert d.method == "eagle3"

        async def decision_for(version: int) -> pb.Decision:
            # The watch may or may not have seen the attach's first directive: skip to this one.
            while True:
                dec = await watch.read()
                assert isinstance(dec, pb.Decision)
                if dec.directive.version >= version:
                    return dec

        decision = await asyncio.wait_for(decision_for(d.version), WAIT_S)
        assert decision.engine_id == "e1"
        assert [a.arm.k for a in decision.arms] == [2] * 6
        assert decision.directive.version == d.version
        got = await admin.GetPolicy(pb.GetPolicyRequest())
        assert (got.name, got.revision) == ("static-eagle3-2", 2)
        listed = await admin.ListPolicies(pb.ListPoliciesRequest())
        assert "static-off" in [p.name for p in listed.presets]
        assert [(p.name, p.revision) for p in listed.history] == [("default", 1)]
        back = await admin.RollbackPolicy(pb.RollbackPolicyRequest())
        assert (back.name, back.revision) == ("default", 3)
        d2 = await eng.directive(lambda d: d.policy == "default")
        assert d2.version > d.version
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.RollbackPolicy(pb.RollbackPolicyRequest())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        watch.cancel()
        await eng.close()


async def test_bad_telemetry_is_rejected_and_counted(sidecar: Sidecar) -> None:
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello()))
    try:
        await eng.directive()
        bad = step(t=1.0, accepted=[1, 2], drafted=1, k=2)  # request 1 accepted 2 of 1 drafted
        eng.report(step(t=0.5, accepted=[1]), bad)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await eng.directive(lambda d: False)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "accepted_gt_drafted" in (err.value.details() or "")
        assert "steps[1].requests[1].accepted" in (err.value.details() or "")
        assert sample(sidecar, "speccontrol_rejected_telemetry_total", reason="accepted_gt_drafted") == 1
        # The whole batch was refused: its valid first step was not observed either.
        assert sidecar.engines()["e1"].loop.totals.steps == 0
        await until(lambda: not sidecar.engines()["e1"].connected)
    finally:
        await eng.close()


async def test_reports_before_hello_are_refused(sidecar: Sidecar) -> None:
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(reports=pb.StepReportBatch(sequence=1)))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await eng.directive()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert sample(sidecar, "speccontrol_rejected_telemetry_total", reason="hello_missing") == 1
        assert sidecar.engines() == {}
    finally:
        await eng.close()


@pytest.mark.parametrize("after_hello", [False, True])
async def test_bytes_that_are_no_engine_message_are_refused_and_counted(
    sidecar: Sidecar, after_hello: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # gRPC's deserializer failed inside the stream: first message, the call ended UNKNOWN with an
    # ERROR and a traceback; later ones were logged as the sidecar's own failure ("internal").
    async with grpc.aio.insecure_channel(sidecar.engine_target) as ch:
        call = ch.stream_stream("/controller.v1.EngineService/Attach")

        async def messages() -> AsyncIterator[bytes]:
            if after_hello:
                yield pb.EngineMessage(hello=hello("raw")).SerializeToString()
            yield b"\xff\xff\xff\xff"
            await asyncio.sleep(5)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call(messages()):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("not_a_message: a message that is not an EngineMessage")
    assert sample(sidecar, "speccontrol_rejected_telemetry_total", reason="not_a_message") == 1
    assert "Traceback" not in caplog.text


async def test_broken_policy_is_refused_and_changes_nothing(
    sidecar: Sidecar, admin: pb_grpc.AdminServiceStub
) -> None:
    before = await admin.GetPolicy(pb.GetPolicyRequest())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.SetPolicy(pb.SetPolicyRequest(yaml=BROKEN, source="broken.yaml"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("broken.yaml:10: spec.decision_interval_s: ")
    after = await admin.GetPolicy(pb.GetPolicyRequest())
    assert (after.name, after.revision) == (before.name, before.revision) == ("default", 1)


async def test_health_serving_on_both_servers(sidecar: Sidecar) -> None:
    for target in (sidecar.engine_target, sidecar.admin_target):
        async with grpc.aio.insecure_channel(target) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_metrics_endpoint_over_http(sidecar: Sidecar) -> None:
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello("scraped")))
    try:
        await eng.directive()
        eng.report(step(t=1.0, accepted=[1]))
        await until(lambda: sidecar.engines()["scraped"].loop.totals.steps == 1)

        def fetch() -> str:
            with urllib.request.urlopen(sidecar.metrics_url, timeout=WAIT_S) as r:
                body: bytes = r.read()
                return body.decode()

        text = await asyncio.to_thread(fetch)
        assert 'speccontrol_drafted_tokens_total{engine="scraped",k="2",method="eagle3"} 2.0' in text
        assert "speccontrol_queue_wait_seconds" in text
        assert "speccontrol_engines_connected 1.0" in text
    finally:
        await eng.close()


async def test_reconnect_and_set_policy_keep_statistics(
    sidecar: Sidecar, admin: pb_grpc.AdminServiceStub
) -> None:
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello()))
    await eng.directive()
    eng.report(step(t=1.0, accepted=[1, 2]), step(t=1.1, accepted=[0, 2]))
    await until(lambda: sidecar.engines()["e1"].loop.totals.steps == 2)
    loop = sidecar.engines()["e1"].loop
    await eng.close()
    await until(lambda: not sidecar.engines()["e1"].connected)

    again = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello()))
    try:
        d = await again.directive()
        assert sidecar.engines()["e1"].loop is loop  # same engine id, same description: same loop
        # Sequence numbers are per stream: the new stream's batch 1 is not a duplicate.
        again.report(step(t=2.0, accepted=[1, 1]))
        await until(lambda: loop.totals.steps == 3)
        await admin.SetPolicy(pb.SetPolicyRequest(yaml=STATIC_EAGLE3_2, source="s.yaml", engine_id="e1"))
        d2 = await again.directive(lambda x: x.policy == "static-eagle3-2")
        assert d2.version > d.version
        st = sidecar.engines()["e1"]
        assert st.loop is not loop
        assert (st.loop.totals.steps, st.loop.totals.accepted) == (3, 7)
        assert (await admin.GetPolicy(pb.GetPolicyRequest(engine_id="e1"))).name == "static-eagle3-2"
        assert (await admin.GetPolicy(pb.GetPolicyRequest())).name == "default"
    finally:
        await again.close()


async def test_directive_is_refreshed_before_its_ttl_lapses(
    sidecar: Sidecar, admin: pb_grpc.AdminServiceStub
) -> None:
    short = STATIC_EAGLE3_2.replace("directive_ttl_s: 10.0", "directive_ttl_s: 0.3")
    await admin.SetPolicy(pb.SetPolicyRequest(yaml=short, source="short.yaml"))
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello()))
    try:
        first = await eng.directive()
        assert first.ttl_s == 0.3
        again = await eng.directive()
        assert again.version == first.version
        assert again == first
    finally:
        await eng.close()


async def test_unix_socket_listener(tmp_path: Path, short_tmp_path: Path) -> None:
    sock_dir = short_tmp_path
    cfg = replace(_config(tmp_path), engine_listen=f"unix://{sock_dir}/engine.sock", metrics_listen="")
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc.start()
    try:
        assert sc.engine_target == f"unix://{sock_dir}/engine.sock"
        assert sc.metrics_url == ""
        eng = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello("uds")))
        try:
            assert (await eng.directive()).policy == "default"
        finally:
            await eng.close()
    finally:
        await sc.stop()


async def test_versions_skip_ahead_after_an_unclean_stop(tmp_path: Path) -> None:
    from controller.state import CRASH_VERSION_GAP

    a = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await a.start()
    eng = TestEngine(a.engine_target, pb.EngineMessage(hello=hello()))
    d = await eng.directive()
    await eng.close()
    assert a.save_snapshot()  # a periodic snapshot, then a crash: no final one
    await a.stop(snapshot=False)
    b = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await b.start()
    try:
        assert b.directive_version == d.version + CRASH_VERSION_GAP
    finally:
        await b.stop()
    c = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await c.start()
    try:
        assert c.directive_version == d.version + CRASH_VERSION_GAP  # b stopped cleanly: exact counter
    finally:
        await c.stop()
