"""The embedded simulated engine on the wire: the same EngineService.Attach stream a vLLM plugin uses.

Two concurrent parts under one supervised task: the step loop (``EngineCore.step`` paced in virtual
time) and the link (Hello, then batched reports with increasing ``sequence``; directives read as
they come). The step loop never waits on the link: reports go to a bounded queue and are dropped,
and counted, when it is full. When the sidecar goes away the link reconnects with backoff while the
engine keeps serving on its last directive, then on its safe default once that expires.

Nothing is counted twice or lost in a reconnect: the protocol (sequences across streams for this
engine instance, ``Hello.instance_id``; sent batches kept until a directive acknowledges them and
resent after a reconnect) is ``controller.wire.link.LinkCore``'s, the same the vLLM plugin's thread
drives; the sidecar drops any batch it had already applied. Steps still queued when the engine ends
(the sidecar unreachable for the last ``DRAIN_S``, or ``stop()`` mid-run) are counted as dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from controller.auth import ClientTLS, channel_credentials, channel_options
from controller.embedded.core import ENGINE_VERSION, EngineCore, EngineSettings, EngineTotals
from controller.embedded.workload import Workload
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.wire.convert import hello_from_engine_info
from controller.wire.link import LinkCore, LinkStats, RefusalLog
from sim.costmodel import Profile

log = logging.getLogger(__name__)

#: At the end of its schedule, how long the engine waits for its last reports to be acknowledged.
DRAIN_S = 3.0


@dataclass(frozen=True, slots=True)
class LinkSettings:
    #: Wall seconds per virtual second (1: real time; 0: as fast as possible).
    time_scale: float = 1.0
    #: Reports are sent at most this often (wall seconds); steps in between go in one batch.
    flush_interval_s: float = 0.05
    max_steps_per_batch: int = 256
    #: Steps the send queue holds while the link is slow or down; more are dropped and counted.
    send_queue_steps: int = 4096
    #: Sent steps kept until the sidecar acknowledges them, for a resend after a reconnect; beyond
    #: it the oldest batches are forgotten (counted in ``LinkStats.evicted_steps``).
    resend_steps: int = 8192
    #: After a reconnect, how long the link waits for the first directive (and its acknowledgement)
    #: before sending anything.
    ack_wait_s: float = 5.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    #: Before its first step, wait up to this long (wall) for a first directive. A real engine serves
    #: at once on its safe default; the demo waits so baselines run their own policy from step one.
    await_directive_s: float = 0.0

    def __post_init__(self) -> None:
        # Every duration a finite number: NaN passed every comparison (and ran as 0, or slept NaN),
        # and an infinite time_scale paced the first step into a sleep that never ends.
        for name in (
            "time_scale",
            "flush_interval_s",
            "ack_wait_s",
            "backoff_initial_s",
            "backoff_max_s",
            "await_directive_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"link settings: {name} must be a finite number >= 0, got {value!r}")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            # (a backoff of 0 stays 0 when doubled: a refused connection retried as fast as the loop turns)
            raise ValueError(
                "link settings: backoff_initial_s must be > 0 and backoff_max_s >= it, got "
                f"{self.backoff_initial_s!r} and {self.backoff_max_s!r}"
            )
        if self.max_steps_per_batch < 1 or self.send_queue_steps < 1 or self.resend_steps < 1:
            raise ValueError(
                "link settings: max_steps_per_batch, send_queue_steps and resend_steps must be >= 1, got "
                f"{self.max_steps_per_batch}, {self.send_queue_steps}, {self.resend_steps}"
            )


class EmbeddedEngine:
    """A simulated engine attached to a sidecar at ``target``; ``start()``/``stop()`` or ``run()``."""

    def __init__(
        self,
        *,
        target: str,
        settings: EngineSettings,
        workload: Workload,
        link: LinkSettings | None = None,
        profile: Profile | None = None,
        clock: Callable[[], float] = time.monotonic,
        tls: ClientTLS | None = None,
    ) -> None:
        self.target = target
        self.tls = tls
        self.settings = settings
        self.link = link or LinkSettings()
        self.core = EngineCore(settings=settings, workload=workload, profile=profile, clock=clock)
        self.wire: LinkCore[pb.StepReport] = LinkCore(
            encode=_as_is, queue_steps=self.link.send_queue_steps, resend_steps=self.link.resend_steps
        )
        #: Set when a step is queued: wakes the sender (made in ``run``, on the running loop).
        self._queued: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._first_directive: asyncio.Event | None = None
        self.instance_id = ""
        self._refusals = RefusalLog(time.monotonic)

    @property
    def stats(self) -> LinkStats:
        return self.wire.stats()

    @property
    def totals(self) -> EngineTotals:
        return self.core.totals

    @property
    def done(self) -> bool:
        return self.core.done

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"engine-{self.settings.engine_id}")

    async def wait(self) -> None:
        """Until the traffic schedule has run out (or the engine was stopped).

        A cancellation of the caller propagates (Ctrl-C must stop the demo); only the engine's own
        cancellation (``stop``) ends the wait quietly."""
        task = self._task
        if task is not None:
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        """Step through the whole schedule while keeping a link to the sidecar; returns when done."""
        self._queued = asyncio.Event()
        self._first_directive = asyncio.Event()
        self.instance_id = uuid.uuid4().hex
        link = asyncio.create_task(self._link_loop(), name=f"engine-link-{self.settings.engine_id}")
        try:
            if self.link.await_directive_s > 0:
                with contextlib.suppress(TimeoutError):  # (asyncio.timeout: 3.11's wait_for can eat a cancel)
                    async with asyncio.timeout(self.link.await_directive_s):
                        await self._first_directive.wait()
            await self._step_loop()
            await self._drain(timeout=DRAIN_S)
        finally:
            link.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await link
            # Steps never put in a batch (a sidecar gone, or stopped mid-run) are counted as dropped,
            # as the plugin's link does on close: every step made is sent, resent or counted.
            lost = self.wire.discard()
            if lost:
                log.info("engine %s: %d steps not sent (counted as dropped)", self.settings.engine_id, lost)

    # -- steps ---------------------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        assert self._queued is not None
        scale = self.link.time_scale
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not self.core.done:
            if self.wire.offer(self.core.step()):
                self._queued.set()
            if scale > 0:
                # Pace against the virtual clock, so time spent computing is not added on top.
                delay = start + self.core.totals.virtual_s * scale - loop.time()
                await asyncio.sleep(max(delay, 0.0))
            elif self.core.totals.steps % 16 == 0:
                await asyncio.sleep(0)

    async def _drain(self, *, timeout: float) -> None:
        """Give the link a moment to send the last reports and hear that the sidecar has them."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.outstanding and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    @property
    def outstanding(self) -> bool:
        """Reports not yet sent, or (with a sidecar that acknowledges) not yet acknowledged."""
        return self.wire.outstanding

    # -- link ----------------------------------------------------------------------------------------

    async def _link_loop(self) -> None:
        backoff = self.link.backoff_initial_s
        while True:
            ok = False
            self.wire.opened()
            try:
                ok = await self._attach_once()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                log.info("engine %s: link lost: %s", self.settings.engine_id, e.code().name)
            except Exception:
                log.exception("engine %s: link failed", self.settings.engine_id)
            finally:
                self.wire.closed()
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # Cancelled inside the gRPC call, which can swallow the cancel and just end (the
                # demo hung for good: ``run`` awaits this task, which went back to its backoff).
                raise asyncio.CancelledError
            backoff = self.link.backoff_initial_s if ok else min(backoff * 2, self.link.backoff_max_s)
            await asyncio.sleep(backoff)

    async def _attach_once(self) -> bool:
        """One stream; True when it got as far as a directive (resets the backoff)."""
        got_directive = False
        ready = asyncio.Event()
        if self.tls is not None:
            channel = grpc.aio.secure_channel(
                self.target, channel_credentials(self.tls), options=channel_options(self.tls)
            )
        else:
            channel = grpc.aio.insecure_channel(self.target)
        async with channel:
            stub = pb_grpc.EngineServiceStub(channel)  # type: ignore[no-untyped-call]
            call = stub.Attach(self._messages(ready))
            self.core.new_stream()
            async for msg in call:
                try:
                    d = self.wire.received(msg)
                except ValueError as e:  # (one line per interval: a sidecar may send them nonstop)
                    line = self._refusals.line(e)
                    if line is not None:
                        log.warning("engine %s: ignoring a bad directive: %s", self.settings.engine_id, line)
                    continue
                finally:
                    ready.set()  # after the acknowledgement: the sender resumes from it
                self.core.receive(d)
                got_directive = True
                if self._first_directive is not None:
                    self._first_directive.set()
        return got_directive

    async def _messages(self, ready: asyncio.Event) -> AsyncIterator[pb.EngineMessage]:
        queued = self._queued
        assert queued is not None
        hello = hello_from_engine_info(self.settings.info(), engine_version=ENGINE_VERSION)
        hello.instance_id = self.instance_id
        yield pb.EngineMessage(hello=hello)
        # The first directive says what the sidecar already has; resend only the rest.
        with contextlib.suppress(TimeoutError):  # (asyncio.timeout: 3.11's wait_for can eat a cancel)
            async with asyncio.timeout(self.link.ack_wait_s):
                await ready.wait()
        for batch in self.wire.resume():
            yield pb.EngineMessage(reports=batch)
        while True:
            if not self.wire.queued:
                queued.clear()
                await queued.wait()
                continue
            if self.link.flush_interval_s > 0:
                await asyncio.sleep(self.link.flush_interval_s)
            out = self.wire.next_batch(self.link.max_steps_per_batch)
            if out is not None:
                yield pb.EngineMessage(reports=out)


def _as_is(report: pb.StepReport, packed: bool) -> pb.StepReport:
    """The demo engine's steps are encoded when made (in repeated fields, which every sidecar reads)."""
    return report
