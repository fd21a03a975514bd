"""The engine's link to the sidecar: telemetry out, directives in, over one gRPC ``Attach`` stream.

The engine step calls ``offer`` (never blocks: a full queue drops the step and counts it) and
``directive`` (a lock-free read of the latest directive and when it arrived). One background thread
owns the stream: it sends the Hello, every ``flush_s`` batches the queued steps into ``StepReportBatch``
messages (the engine step never wakes it: ``offer`` is one deque append), stores
every Directive it receives, and reconnects with backoff when the sidecar goes away.

Sequences run across streams for this engine process (``Hello.instance_id``). A sidecar that
acknowledges (``Directive.acked_sequence``) lets the link keep sent batches until they are applied
and resend the rest after a reconnect, so a lost stream neither loses nor double-counts a step.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.vllm.record import StepRecord
from controller.wire.convert import directive_from_pb
from policies.directive import Directive

log = logging.getLogger("vllm.speccontrol")


@dataclass(frozen=True, slots=True)
class Received:
    directive: Directive
    at: float  # the link's monotonic clock when it arrived


@dataclass(frozen=True, slots=True)
class LinkStats:
    connected: bool
    attaches: int
    sent_steps: int
    dropped_steps: int
    directives: int


class SidecarLink:
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
    ) -> None:
        self.target = target
        if not hello.instance_id:
            hello = pb.Hello.FromString(hello.SerializeToString())
            hello.instance_id = uuid.uuid4().hex
        self.hello = hello
        self.resend_steps = resend_steps
        self.ack_wait_s = ack_wait_s
        self.credentials = credentials
        #: Sent, unacknowledged batches (oldest first), their steps, and whether the sidecar acks.
        self._unacked: deque[pb.StepReportBatch] = deque()
        self._unacked_steps = 0
        self._acks = False
        self._lock = threading.Lock()
        self.resent_batches = 0
        self.evicted_steps = 0
        self.batch_max = batch_max
        self.flush_s = flush_s
        self.backoff_s = backoff_s
        self.clock = clock
        # Steps waiting for the sender. A deque (append/popleft are atomic), not a queue.Queue: the
        # engine step must not wake the sender thread (a lock release and a GIL hand-off per step
        # cost more than the plugin's whole step); the sender drains it every flush_s instead.
        self._queue: deque[StepRecord] = deque()
        self.queue_size = queue_size
        self._latest: Received | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._call: grpc.Future | None = None  # type: ignore[type-arg]
        self._connected = False
        self._attaches = 0
        self._sent = 0
        self._dropped = 0
        self._dropped_reported = 0
        self._directives = 0
        self._sequence = 0

    # -- engine side (called from the engine step; must stay cheap) -----------------------------

    def offer(self, record: StepRecord) -> bool:
        if len(self._queue) >= self.queue_size:
            self._dropped += 1
            return False
        self._queue.append(record)
        return True

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
        return LinkStats(self._connected, self._attaches, self._sent, self._dropped, self._directives)

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

    # -- background thread -----------------------------------------------------------------------

    def _run(self) -> None:
        delay = self.backoff_s[0]
        warned = False
        while not self._stop.is_set():
            done = threading.Event()
            ready = threading.Event()
            try:
                with (
                    grpc.secure_channel(self.target, self.credentials)
                    if self.credentials is not None
                    else grpc.insecure_channel(self.target)
                ) as channel:
                    stub = pb_grpc.EngineServiceStub(channel)  # type: ignore[no-untyped-call]
                    call = stub.Attach(self._messages(done, ready))
                    self._call = call
                    for msg in call:
                        self._acknowledged(msg)
                        ready.set()
                        self._receive(msg)
                        if not self._connected:
                            self._connected = True
                            self._attaches += 1
                            delay = self.backoff_s[0]
                            if warned:
                                log.warning("speccontrol: re-attached to the sidecar at %s", self.target)
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
                self._connected = False
            if self._stop.wait(delay):
                break
            delay = min(delay * 2, self.backoff_s[1])

    def _receive(self, msg: pb.Directive) -> None:
        try:
            d = directive_from_pb(msg)
        except ValueError as e:
            log.warning("speccontrol: ignoring an invalid directive: %s", e)
            return
        self._latest = Received(d, self.clock())
        self._directives += 1

    def _acknowledged(self, msg: pb.Directive) -> None:
        with self._lock:
            self._acks = msg.HasField("acked_sequence")
            if not self._acks:
                return
            while self._unacked and self._unacked[0].sequence <= msg.acked_sequence:
                self._unacked_steps -= len(self._unacked.popleft().steps)

    def _keep(self, batch: pb.StepReportBatch) -> None:
        with self._lock:
            if not self._acks:
                return
            self._unacked.append(batch)
            self._unacked_steps += len(batch.steps)
            while self._unacked_steps > self.resend_steps and len(self._unacked) > 1:
                n = len(self._unacked.popleft().steps)
                self._unacked_steps -= n
                self.evicted_steps += n

    def unacked_batches(self) -> int:
        with self._lock:
            return len(self._unacked)

    def _messages(self, done: threading.Event, ready: threading.Event) -> Iterator[pb.EngineMessage]:
        yield pb.EngineMessage(hello=self.hello)
        # The stream's first directive says which batches the sidecar already has.
        deadline = time.monotonic() + self.ack_wait_s
        while not ready.wait(0.05):
            if done.is_set() or self._stop.is_set() or time.monotonic() > deadline:
                break
        with self._lock:
            if not self._acks:
                self._unacked.clear()
                self._unacked_steps = 0
            resend = list(self._unacked)
        for batch in resend:
            self.resent_batches += 1
            yield pb.EngineMessage(reports=batch)
        while not done.is_set() and not self._stop.is_set():
            if not self._queue:
                done.wait(self.flush_s)
                continue
            steps: list[StepRecord] = []
            while self._queue and len(steps) < self.batch_max:
                steps.append(self._queue.popleft())
            self._sequence += 1
            dropped = self._dropped - self._dropped_reported
            self._dropped_reported += dropped
            batch = pb.StepReportBatch(
                sequence=self._sequence, steps=[s.to_pb() for s in steps], dropped_steps=dropped
            )
            self._sent += len(steps)
            self._keep(batch)
            yield pb.EngineMessage(reports=batch)


def _describe(e: grpc.RpcError) -> str:
    code = getattr(e, "code", None)
    details = getattr(e, "details", None)
    c = code() if callable(code) else None
    d = details() if callable(details) else None
    return f"{c.name if c is not None else 'error'}: {d or ''}".strip()
