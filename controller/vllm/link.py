"""The engine's link to the sidecar: telemetry out, directives in, over one gRPC ``Attach`` stream.

The engine step calls ``offer`` (never blocks: a full queue drops the step and counts it) and
``directive`` (a lock-free read of the latest directive and when it arrived). One background thread
owns the stream: it sends the Hello, every ``flush_s`` batches the queued steps into ``StepReportBatch``
messages (the engine step never wakes it: ``offer`` is one deque append), stores
every Directive it receives that the engine can apply (``controller.wire.convert.directive_for_engine``;
one it cannot is refused with one log line, at most one per ``REFUSED_LOG_S``, ``RefusalLog``, and the
one in force stays), and reconnects with backoff when the sidecar goes away. Whatever text of the
sidecar's it logs (a refused directive's fault, a stream's status details) is escaped and cut.

The protocol (sequences across streams for this engine process, ``Hello.instance_id``; batches kept
until the sidecar acknowledges them and resent after a reconnect) is ``controller.wire.link.LinkCore``'s;
this module only drives it from the thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.vllm.record import StepRecord
from controller.wire.link import LinkCore, LinkStats, RefusalLog, quoted
from policies.directive import Directive

log = logging.getLogger("vllm.speccontrol")

#: HTTP/2 pings on the stream's connection every this many seconds, each answered within half of it
#: or the connection counts as dead. Without them a connection whose peer vanished without a reset (a
#: partitioned network, a host that lost power) stayed open for the kernel's TCP timeout (hours): the
#: link never reconnected and the engine ran on its safe default long after the sidecar was back.
KEEPALIVE_S = 20.0


@dataclass(frozen=True, slots=True)
class Received:
    directive: Directive
    at: float  # the link's monotonic clock when it arrived


class SidecarLink:
    """The plugin's link: a ``LinkCore`` of ``StepRecord``s driven by one background thread."""

    def __init__(
        self,
        *,
        target: str,
        hello: pb.Hello,
        queue_size: int = 8192,
        batch_max: int = 256,
        flush_s: float = 0.1,
        backoff_s: tuple[float, float] = (0.2, 5.0),
        clock: Callable[[], float] = time.monotonic,
        resend_steps: int = 8192,
        ack_wait_s: float = 5.0,
        credentials: grpc.ChannelCredentials | None = None,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.target = target
        if not hello.instance_id:
            hello = pb.Hello.FromString(hello.SerializeToString())
            hello.instance_id = uuid.uuid4().hex
        self.hello = hello
        self.ack_wait_s = ack_wait_s
        self.credentials = credentials
        self.keepalive_s = keepalive_s
        # The engine step only appends to the core's queue (no lock, no wake-up: a lock release and a
        # GIL hand-off per step cost more than the plugin's whole step); the sender drains it every
        # flush_s and converts the records to protobuf there.
        self.core: LinkCore[StepRecord] = LinkCore(
            encode=StepRecord.to_pb, queue_steps=queue_size, resend_steps=resend_steps
        )
        self.batch_max = batch_max
        self.flush_s = flush_s
        self.backoff_s = backoff_s
        self.clock = clock
        self._latest: Received | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._call: grpc.Future | None = None  # type: ignore[type-arg]
        self._refusals = RefusalLog(clock)

    # -- engine side (called from the engine step; must stay cheap) -----------------------------

    def offer(self, record: StepRecord) -> bool:
        return self.core.offer(record)

    def directive(self) -> Received | None:
        return self._latest

    def fresh_directive(self, now: float | None = None) -> Directive | None:
        """The latest directive unless its TTL has lapsed (TTL <= 0: it never lapses)."""
        r = self._latest
        if r is None:
            return None
        t = self.clock() if now is None else now
        if r.directive.ttl_s > 0 and t - r.at > r.directive.ttl_s:
            return None
        return r.directive

    def stats(self) -> LinkStats:
        return self.core.stats()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="speccontrol-link", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        lost = self.core.discard()
        if lost:
            log.warning(
                "speccontrol: %d engine steps not sent to the sidecar before shutdown (counted as dropped)",
                lost,
            )

    # -- background thread -----------------------------------------------------------------------

    def _run(self) -> None:
        delay = self.backoff_s[0]
        warned = False
        ever_attached = False  # logged: the first attach ("attached"), one after a loss ("re-attached")
        while not self._stop.is_set():
            done = threading.Event()
            ready = threading.Event()
            self.core.opened()
            try:
                options = keepalive_options(self.keepalive_s)
                with (
                    grpc.secure_channel(self.target, self.credentials, options=options)
                    if self.credentials is not None
                    else grpc.insecure_channel(self.target, options=options)
                ) as channel:
                    stub = pb_grpc.EngineServiceStub(channel)  # type: ignore[no-untyped-call]
                    call = stub.Attach(self._messages(done, ready))
                    self._call = call
                    attached = False
                    for msg in call:
                        try:
                            self._latest = Received(self.core.received(msg), self.clock())
                        except ValueError as e:
                            self._refused(e)
                        ready.set()
                        if not attached:
                            attached = True
                            delay = self.backoff_s[0]
                            if ever_attached and warned:
                                log.warning("speccontrol: re-attached to the sidecar at %s", self.target)
                            elif not ever_attached:
                                log.info("speccontrol: attached to the sidecar at %s", self.target)
                            ever_attached = True
                            warned = False
            except grpc.RpcError as e:
                if not warned and not self._stop.is_set():
                    log.warning(
                        "speccontrol: sidecar at %s unavailable (%s); serving on, will retry",
                        self.target,
                        _describe(e),
                    )
                    warned = True
            except Exception:
                log.exception("speccontrol: link failed; retrying")
                warned = True
            finally:
                done.set()
                self._call = None
                self.core.closed()
            if self._stop.wait(delay):
                break
            delay = min(delay * 2, self.backoff_s[1])

    def _refused(self, e: ValueError) -> None:
        """One line for a directive the engine refused, at most one per ``REFUSED_LOG_S``
        (``RefusalLog``); the directive in force stays."""
        line = self._refusals.line(e)
        if line is not None:
            log.warning("speccontrol: ignoring an invalid directive (the one in force stays): %s", line)

    def _messages(self, done: threading.Event, ready: threading.Event) -> Iterator[pb.EngineMessage]:
        yield pb.EngineMessage(hello=self.hello)
        # The stream's first directive says which batches the sidecar already has.
        deadline = time.monotonic() + self.ack_wait_s
        while not ready.wait(0.05):
            if done.is_set() or self._stop.is_set() or time.monotonic() > deadline:
                break
        for kept in self.core.resume():
            yield pb.EngineMessage(reports=kept)
        while not done.is_set() and not self._stop.is_set():
            batch = self.core.next_batch(self.batch_max)
            if batch is None:
                done.wait(self.flush_s)
                continue
            yield pb.EngineMessage(reports=batch)


def keepalive_options(every_s: float) -> list[tuple[str, int]]:
    """gRPC channel options: a ping every ``every_s`` seconds, even between calls and without data (the
    sidecar permits them: ``controller.server``), a connection dead after ``every_s / 2`` unanswered."""
    return [
        ("grpc.keepalive_time_ms", int(every_s * 1000)),
        ("grpc.keepalive_timeout_ms", max(int(every_s * 500), 100)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", max(int(every_s * 500), 100)),  # gRPC >= 1.6x reads this one
    ]


def _describe(e: grpc.RpcError) -> str:
    """The stream's end in a log line: its status code and details, the details being the sidecar's
    text (escaped and cut: a newline in them forged a log line, and they ran to gRPC's limit)."""
    code = getattr(e, "code", None)
    details = getattr(e, "details", None)
    c = code() if callable(code) else None
    d = details() if callable(details) else None
    return f"{c.name if c is not None else 'error'}: {quoted(d or '')}".strip()
