"""EngineService.Attach against hostile or careless clients, over real gRPC sockets on loopback.

What must hold: a stream that sends no Hello is ended DEADLINE_EXCEEDED after the Hello timeout and
counted (``hello_timeout``), while an attached stream may stay quiet for as long as it likes; streams
opened and abandoned, half-closed or written to after their end leave no engine shown as connected
and nothing behind; the registry holds ``max_engines`` engines on open streams and refuses the next
one (RESOURCE_EXHAUSTED, counted), and ``max_engines`` streams arriving at once while the sidecar's
loop is busy are all served (none dropped by gRPC before the sidecar sees it); one engine id holds
``MAX_STREAMS_PER_ENGINE`` streams at most; an engine whose batches may hold more requests than
``max_requests_per_step`` is refused at its Hello (FAILED_PRECONDITION, naming the key); a stop while
streams are sending ends every stream and writes the final snapshot.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

import controller.engine_service as engine_service
import controller.streams as streams
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from tests.integration.test_sidecar_grpc import WAIT_S, hello, loopback_config, sample, step, until

pytestmark = pytest.mark.integration

#: The Hello timeout the tests inject: short, so a test waits for it briefly (no assertion is on time).
HELLO_S = 0.3


@pytest.fixture
def short_hello(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hello timeout of streams opened from now on is ``HELLO_S`` (only where a test waits for it:
    under the load of a thousand streams a Hello may well take longer than that to be read)."""
    # (raising=False: on a sidecar without the timeout the tests fail on their hang guard instead)
    monkeypatch.setattr(engine_service, "HELLO_TIMEOUT_S", HELLO_S, raising=False)


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    sc = Sidecar(config=loopback_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


def _rejected(sc: Sidecar, reason: str) -> float:
    return sample(sc, "speccontrol_rejected_telemetry_total", reason=reason) or 0.0


async def _forever() -> AsyncIterator[pb.EngineMessage]:
    await asyncio.Event().wait()
    yield pb.EngineMessage()  # (never reached)


@pytest.mark.usefixtures("short_hello")
async def test_a_stream_that_never_sends_its_hello_is_ended_and_counted(sidecar: Sidecar) -> None:
    async with grpc.aio.insecure_channel(sidecar.engine_target) as ch:
        call = pb_grpc.EngineServiceStub(ch).Attach(_forever())  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), WAIT_S)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    details = err.value.details() or ""
    assert details.startswith("hello_timeout: no Hello within 0.3 s of opening the stream"), details
    assert _rejected(sidecar, "hello_timeout") == 1
    assert sidecar.engines() == {}


@pytest.mark.usefixtures("short_hello")
async def test_many_silent_openers_are_all_ended(sidecar: Sidecar) -> None:
    # 200 streams on one connection (under its 256 concurrent streams), none sending anything.
    async with grpc.aio.insecure_channel(sidecar.engine_target) as ch:
        stub = pb_grpc.EngineServiceStub(ch)  # type: ignore[no-untyped-call]
        calls = [stub.Attach(_forever()) for _ in range(200)]
        codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls)), WAIT_S * 3)
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
    assert _rejected(sidecar, "hello_timeout") == 200


@pytest.mark.usefixtures("short_hello")
async def test_the_hello_timeout_does_not_end_an_attached_quiet_stream(sidecar: Sidecar) -> None:
    out: asyncio.Queue[pb.EngineMessage] = asyncio.Queue()
    out.put_nowait(pb.EngineMessage(hello=hello("quiet")))

    async def messages() -> AsyncIterator[pb.EngineMessage]:
        while True:
            yield await out.get()

    async with grpc.aio.insecure_channel(sidecar.engine_target) as ch:
        call = pb_grpc.EngineServiceStub(ch).Attach(messages())  # type: ignore[no-untyped-call]
        assert isinstance(await asyncio.wait_for(call.read(), WAIT_S), pb.Directive)
        await asyncio.sleep(HELLO_S * 4)  # past the Hello timeout several times over, nothing sent
        assert not call.done()
        assert sidecar.engines()["quiet"].connected
        out.put_nowait(
            pb.EngineMessage(reports=pb.StepReportBatch(sequence=1, steps=[step(t=1.0, accepted=[1])]))
        )
        await until(lambda: sidecar.engines()["quiet"].loop.totals.steps == 1)
        call.cancel()
    await until(lambda: not sidecar.engines()["quiet"].connected)
    assert _rejected(sidecar, "hello_timeout") == 0


def _channels(target: str, n: int) -> list[grpc.aio.Channel]:
    """``n`` channels on ``n`` connections (gRPC shares one connection among same-argument channels,
    and a connection carries 256 streams at most: the sidecar's ``grpc.max_concurrent_streams``)."""
    return [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(n)
    ]


async def _attach(ch: grpc.aio.Channel, h: pb.Hello) -> grpc.aio.StreamStreamCall:  # type: ignore[type-arg]
    async def messages() -> AsyncIterator[pb.EngineMessage]:
        yield pb.EngineMessage(hello=h)
        await asyncio.Event().wait()

    return pb_grpc.EngineServiceStub(ch).Attach(messages())  # type: ignore[no-untyped-call, no-any-return]


async def test_one_engine_id_holds_a_bounded_number_of_streams(sidecar: Sidecar) -> None:
    limit = 16  # streams.MAX_STREAMS_PER_ENGINE (the last assertion checks it)
    h = hello("greedy")
    h.instance_id = "one-process"
    chans = _channels(sidecar.engine_target, 1)
    try:
        calls = [await _attach(chans[0], h) for _ in range(limit)]
        for c in calls:
            assert isinstance(await asyncio.wait_for(c.read(), WAIT_S), pb.Directive)
        over = await _attach(chans[0], h)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(over.read(), WAIT_S)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (err.value.details() or "").startswith(
            "too_many_streams: hello: this engine id already has 16"
        )
        assert _rejected(sidecar, "too_many_streams") == 1
        assert len(sidecar.engines()["greedy"].link.queues) == limit
        # One ends: the room is back.
        calls.pop().cancel()
        await until(lambda: len(sidecar.engines()["greedy"].link.queues) < limit)
        again = await _attach(chans[0], h)
        assert isinstance(await asyncio.wait_for(again.read(), WAIT_S), pb.Directive)
        calls.append(again)
        for c in calls:
            c.cancel()
        await until(lambda: not sidecar.engines()["greedy"].connected)
    finally:
        for ch in chans:
            await ch.close(None)
    assert getattr(streams, "MAX_STREAMS_PER_ENGINE", None) == limit


async def test_max_engines_streams_attach_and_the_next_engine_is_refused(sidecar: Sidecar) -> None:
    n = sidecar.config.max_engines  # the default: 1024 engines on open streams
    per = 200
    chans = _channels(sidecar.engine_target, n // per + 1)
    try:
        calls = [await _attach(chans[i // per], hello(f"engine-{i:04d}")) for i in range(n)]
        # (a hang guard only: on a loaded machine a thousand attaches take a minute or more)
        got = await asyncio.wait_for(asyncio.gather(*(c.read() for c in calls)), WAIT_S * 30)
        assert all(isinstance(d, pb.Directive) for d in got)
        assert sample(sidecar, "speccontrol_engines_connected") == n
        over = await _attach(chans[-1], hello("one-too-many"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(over.read(), WAIT_S)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (err.value.details() or "").startswith("too_many_engines: ")
        assert _rejected(sidecar, "too_many_engines") == 1
        assert "one-too-many" not in sidecar.engines()
        # Abandoned all at once (the engines' processes gone): every one shows as gone.
        for c in calls:
            c.cancel()
        await asyncio.wait_for(
            until_slow(lambda: sample(sidecar, "speccontrol_engines_connected") == 0), WAIT_S * 30
        )  # (a hang guard, as above)
        assert not any(st.connected for st in sidecar.engines().values())
        # And the room is there again for a new engine (the oldest idle one is forgotten).
        late = await _attach(chans[0], hello("late"))
        assert isinstance(await asyncio.wait_for(late.read(), WAIT_S), pb.Directive)
        late.cancel()
    finally:
        for ch in chans:
            await ch.close(None)


async def test_every_engine_attaching_at_once_to_a_busy_sidecar_is_served(tmp_path: Path) -> None:
    """``max_engines`` streams that all arrive while the sidecar's loop is busy (a restart's reconnect
    storm) are all served. They wait in gRPC's backlog of streams the server has not taken yet, and
    gRPC drops streams at random above its default bound on it (1000; ``server.engine_backlog_options``):
    before, a few of 1200 ended CANCELLED or INTERNAL without reaching the sidecar, nothing logged."""
    n = 1200  # above gRPC's default backlog bound, so a sidecar that keeps it loses streams
    cfg = replace(loopback_config(tmp_path), max_engines=n)
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc.start()
    storm = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.attach_storm", sc.engine_target, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert storm.stdin is not None and storm.stdout is not None
    try:
        # Blocking on purpose: the sidecar's loop (this one) takes no stream until every Hello is
        # written, so all of them wait in gRPC's backlog at once (the client guards this wait).
        assert storm.stdout.readline().strip() == "sent"
        outcome = await asyncio.get_running_loop().run_in_executor(None, storm.stdout.readline)
        assert json.loads(outcome) == {"directive": n}
        assert sample(sc, "speccontrol_engines_connected") == n
    finally:
        storm.stdin.close()  # the client lets its streams go and exits
        try:
            await asyncio.get_running_loop().run_in_executor(None, storm.wait, WAIT_S)
        except subprocess.TimeoutExpired:
            storm.kill()
            storm.wait()
        storm.stdout.close()
        await sc.stop()


@pytest.mark.parametrize("after_hello", [False, True])
async def test_a_half_closed_client_ends_its_stream_cleanly(sidecar: Sidecar, after_hello: bool) -> None:
    async with grpc.aio.insecure_channel(sidecar.engine_target) as ch:
        call = pb_grpc.EngineServiceStub(ch).Attach()  # type: ignore[no-untyped-call]
        if after_hello:
            await call.write(pb.EngineMessage(hello=hello("half")))
        await call.done_writing()
        code = await asyncio.wait_for(_drained(call), WAIT_S)
    assert code == grpc.StatusCode.OK
    if after_hello:
        await until(lambda: not sidecar.engines()["half"].connected)
    else:
        assert sidecar.engines() == {}
    assert _rejected(sidecar, "hello_timeout") == 0


async def test_messages_after_the_sidecar_ended_the_stream_change_nothing(sidecar: Sidecar) -> None:
    async with grpc.aio.insecure_channel(sidecar.engine_target) as ch:
        call = pb_grpc.EngineServiceStub(ch).Attach()  # type: ignore[no-untyped-call]
        await call.write(pb.EngineMessage(hello=hello("late-writer")))
        assert isinstance(await asyncio.wait_for(call.read(), WAIT_S), pb.Directive)
        bad = step(t=1.0, accepted=[3], k=2)  # accepted 3 of 2 drafted: the stream is ended
        await call.write(pb.EngineMessage(reports=pb.StepReportBatch(sequence=1, steps=[bad])))
        assert await asyncio.wait_for(_drained(call), WAIT_S) == grpc.StatusCode.INVALID_ARGUMENT
        # The engine keeps writing valid batches on the ended stream: refused by gRPC, never applied.
        for seq in range(2, 102):
            try:
                await call.write(
                    pb.EngineMessage(
                        reports=pb.StepReportBatch(sequence=seq, steps=[step(t=seq, accepted=[1])])
                    )
                )
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                break
    st = sidecar.engines()["late-writer"]
    await until(lambda: not st.connected)
    assert st.loop.totals.steps == 0
    assert _rejected(sidecar, "accepted_gt_drafted") == 1
    # The engine attaches again on a new stream and is served.
    async with grpc.aio.insecure_channel(sidecar.engine_target) as ch:
        call = await _attach(ch, hello("late-writer"))
        assert isinstance(await asyncio.wait_for(call.read(), WAIT_S), pb.Directive)
        call.cancel()


async def test_a_stop_while_engines_send_batches_ends_every_stream_and_loses_nothing(
    tmp_path: Path, sidecar: Sidecar
) -> None:
    engines, batch = 32, 64  # 32 engines sending 64-step batches, 100 a second each
    stop_sending, all_attached = asyncio.Event(), asyncio.Event()
    attached: list[int] = []

    async def pump(ch: grpc.aio.Channel, i: int) -> grpc.StatusCode:
        h = hello(f"busy-{i}")
        h.instance_id = f"process-{i}"
        call = pb_grpc.EngineServiceStub(ch).Attach()  # type: ignore[no-untyped-call]
        try:
            await call.write(pb.EngineMessage(hello=h))
            assert isinstance(await call.read(), pb.Directive)  # attached: now it sends
            attached.append(i)
            await all_attached.wait()
            seq = 0
            while not stop_sending.is_set():
                seq += 1
                steps = [step(t=seq + j / batch, accepted=[1, 0]) for j in range(batch)]
                await call.write(pb.EngineMessage(reports=pb.StepReportBatch(sequence=seq, steps=steps)))
                # (an engine flushes every 0.1 s or so; back to back, 32 of them in this process would
                # starve the sidecar's own handlers, which share its event loop)
                await asyncio.sleep(0.01)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass
        return await asyncio.wait_for(_drained(call), WAIT_S)

    chans = _channels(sidecar.engine_target, 4)
    try:
        pumps = [asyncio.create_task(pump(chans[i % 4], i)) for i in range(engines)]
        await until(lambda: len(attached) == engines)
        all_attached.set()
        await until(lambda: sum(st.loop.totals.steps > 0 for st in sidecar.engines().values()) == engines)
        await asyncio.wait_for(sidecar.stop(), WAIT_S)  # mid-batch: every pump is writing
        stop_sending.set()
        codes = await asyncio.wait_for(asyncio.gather(*pumps), WAIT_S * 2)
    finally:
        for ch in chans:
            await ch.close(None)
    assert grpc.StatusCode.INVALID_ARGUMENT not in codes and grpc.StatusCode.UNKNOWN not in codes
    assert not any(st.connected for st in sidecar.engines().values())
    applied = {eid: st.loop.totals.steps for eid, st in sidecar.engines().items()}
    # What was applied is what the next start restores (the final snapshot came after the streams).
    again = Sidecar(config=sidecar.config, registry=CollectorRegistry())
    await again.start()
    try:
        assert {eid: st.loop.totals.steps for eid, st in again.engines().items()} == applied
    finally:
        await again.stop()


async def until_slow(cond: Callable[[], object]) -> None:
    """``until`` without its guard (the caller sets one, sized to a thousand streams on a busy host)."""
    while not cond():
        await asyncio.sleep(0.05)


async def _drained(call: grpc.aio.StreamStreamCall) -> grpc.StatusCode:  # type: ignore[type-arg]
    """The call's status, once every directive it was sent is read (gRPC's client gives the status of a
    stream only after its messages)."""
    try:
        while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
            pass
    except grpc.aio.AioRpcError:
        pass
    code: grpc.StatusCode = await call.code()
    return code


async def test_an_engine_whose_batches_exceed_the_request_limit_is_refused_at_its_hello(
    tmp_path: Path,
) -> None:
    """An engine running more requests a step than ``max_requests_per_step`` is refused at its Hello,
    naming the key to raise: attached, its first full step got the whole report batch refused and the
    stream ended, at every reconnect (a stream of refusals and reconnects instead of one line)."""
    cfg = replace(loopback_config(tmp_path), max_requests_per_step=32)
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc.start()
    try:
        async with grpc.aio.insecure_channel(sc.engine_target) as ch:
            over = await _attach(ch, hello("big"))  # max_batch_size 64
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(over.read(), WAIT_S)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = err.value.details() or ""
            assert details.startswith("max_batch_size_over_limit: hello.max_batch_size: ")
            assert "64" in details and "max_requests_per_step (32)" in details
            assert _rejected(sc, "max_batch_size_over_limit") == 1
            assert "big" not in sc.engines()
            fits = hello("fits")
            fits.max_batch_size = 32
            call = await _attach(ch, fits)
            assert isinstance(await asyncio.wait_for(call.read(), WAIT_S), pb.Directive)
            call.cancel()
    finally:
        await sc.stop()
