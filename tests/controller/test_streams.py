"""Stream queues and the Attach handler under a writer held by flow control, driven in-process.

What must hold: a stream's end (``StreamEnd``) always reaches its writer, however many directives
are pushed after it while the writer cannot write; the handler of a stream whose engine stops
reading then still ends (with the reason), detaches, and leaves the other engines served.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.engine_service import EngineService
from controller.sidecar import Sidecar
from controller.streams import STREAM_QUEUE, StreamEnd, put_latest
from controller.v1 import controller_pb2 as pb
from controller.validation import TelemetryError

from .test_sidecar_unit import Clock, batch, drain, info


@given(
    before=st.integers(min_value=0, max_value=3 * STREAM_QUEUE),
    after=st.integers(min_value=0, max_value=3 * STREAM_QUEUE),
)
def test_an_end_is_never_dropped_by_directives_pushed_after_it(before: int, after: int) -> None:
    async def run() -> list[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue(maxsize=STREAM_QUEUE)
        for v in range(before):
            put_latest(q, v)
        end = StreamEnd(TelemetryError("bad", "x"))
        put_latest(q, end)
        for v in range(after):
            put_latest(q, 1000 + v)
        return drain(q)

    items = asyncio.run(run())
    assert len(items) <= STREAM_QUEUE
    ends = [i for i in items if isinstance(i, StreamEnd)]
    assert len(ends) == 1 and ends[0].error is not None and ends[0].error.reason == "bad"
    # Before the end: the newest directives queued before it, in order.
    head = items[: items.index(ends[0])]
    assert head == sorted(head) and all(v < before for v in head)


def test_a_full_queue_without_an_end_keeps_the_newest() -> None:
    async def run() -> list[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue(maxsize=STREAM_QUEUE)
        for v in range(3 * STREAM_QUEUE):
            put_latest(q, v)
        return drain(q)

    assert asyncio.run(run()) == list(range(2 * STREAM_QUEUE, 3 * STREAM_QUEUE))


class Aborted(Exception):
    pass


class HeldContext:
    """A servicer context whose writes wait until ``release`` (an engine that stopped reading)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.written: list[pb.Directive] = []
        self.aborted: tuple[Any, str] | None = None

    async def write(self, msg: pb.Directive) -> None:
        await self.release.wait()
        self.written.append(msg)

    async def abort(self, code: Any, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(details)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    cfg = SidecarConfig(state_dir=str(tmp_path / "state"), max_policy_changes_per_s=1000.0)
    sc = Sidecar(config=cfg, registry=CollectorRegistry(), clock=Clock())
    sc.open()
    try:
        yield sc
    finally:
        sc.close(snapshot=False)


def hello(engine_id: str) -> pb.Hello:
    i = info(engine_id)
    arms = [pb.Arm(method=a.method.value, k=a.k) for a in i.arms]
    return pb.Hello(
        engine_id=engine_id,
        model="tiny",
        max_k=4,
        arms=arms,
        granularity=pb.GRANULARITY_BATCH_STEP,
        max_batch_size=64,
        protocol_version=1,
    )


async def test_a_stream_whose_engine_stopped_reading_still_ends_after_a_bad_batch(sidecar: Sidecar) -> None:
    """The engine sends a batch that is refused while its directives pile up unwritten: the handler
    must end the stream (with the reason) once the write goes through, not wait for good."""
    bad = batch(1, 1)
    bad.steps[0].duration_s = -1.0  # refused: the stream ends with the reason

    async def messages() -> AsyncIterator[pb.EngineMessage]:
        yield pb.EngineMessage(hello=hello("slow"))
        yield pb.EngineMessage(reports=bad)
        await asyncio.Event().wait()  # the engine keeps its side open

    ctx = HeldContext()
    handler = asyncio.create_task(EngineService(sidecar).Attach(messages(), ctx))  # type: ignore[arg-type]

    async def refused() -> None:  # the reader refused the batch and queued the end
        while "slow" not in sidecar.engines() or not sidecar.engines()["slow"].rejected:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(refused(), 10)
    slow = sidecar.engines()["slow"]
    other = sidecar.attach(info("other"))
    assert slow.directive is not None and other.engine.directive is not None
    for _ in range(3 * STREAM_QUEUE):  # directives keep coming while the writer is held
        slow.link.push(slow.directive)
        other.engine.link.push(other.engine.directive)
    assert other.queue.qsize() == STREAM_QUEUE  # the other engine is served meanwhile
    ctx.release.set()
    with pytest.raises(Aborted):
        await asyncio.wait_for(handler, 10)
    assert ctx.aborted is not None and "duration" in ctx.aborted[1]
    assert not slow.connected and other.engine.connected
