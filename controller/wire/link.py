"""The engine side of the link protocol, without I/O: queue, batch, sequence, keep, acknowledge, resend.

Both engine links drive one ``LinkCore``: the vLLM plugin's sender thread (``controller.vllm.link``)
and the demo engine's asyncio task (``controller.embedded.engine``). The driver owns the stream and
tells the core what happened; the core decides what to send. One stream's life::

    core.opened()                      # a new Attach stream; the driver sends the Hello
    d = core.received(msg)             # every Directive: its ack, then it decoded (ValueError: bad)
    for batch in core.resume(): ...    # after the stream's first directive (or the ack wait): resend
    batch = core.next_batch(max_steps) # then repeatedly: queued steps as one batch (None: none queued)
    core.closed()                      # the stream ended, however it ended

and at any time, from the engine: ``core.offer(step)`` (never blocks; a full queue drops the step and
counts it, and the next batch reports the count in ``dropped_steps``).

What must hold:

* Sequences start at 1 and increase by one per batch for the life of the core (they run across
  streams: the sidecar keys them by ``Hello.instance_id``); a resent batch keeps its number.
* While the sidecar acknowledges (its directives carry ``acked_sequence``), every batch is kept from
  ``next_batch`` until a directive acknowledges it, and ``resume`` returns the kept ones, oldest first,
  so a lost stream neither loses nor (the sidecar drops sequences it has applied) double-counts a step.
  A sidecar that does not acknowledge gets nothing kept and nothing resent.
* The keep buffer holds at most ``resend_steps`` steps (but always the newest batch); older batches are
  forgotten and counted in ``LinkStats.evicted_steps``. The send queue holds at most ``queue_steps``.
  So every offered step is sent once, resent while unacknowledged, or counted as dropped or evicted.
* No batch is larger than the stream's sidecar takes (``Directive.max_message_bytes`` less room for
  the envelope; gRPC's default 4 MiB until a sidecar says, or where an older one does not), nor holds
  more steps than it takes (``Directive.max_steps_per_batch``): the sidecar refuses a larger message
  before reading it, so it could neither apply nor acknowledge it, and every resend would fail the same
  way. A step that alone exceeds the limit can never be delivered: it is dropped and counted, as is a
  step its encoder raises on (a bug there must cost that step, not the batch it was going in). A kept
  batch that exceeds a new stream's limit (a sidecar restarted with a smaller one) is forgotten and
  counted in ``evicted_steps``.
* Steps go out packed (``RequestColumns.packed``) only while the stream's sidecar says it reads them.
  A batch is kept as its steps (not as the message sent) and encoded again when it is resent, in the
  form the sidecar of the new stream reads: same sequence, same steps.
* Thread safety: ``offer`` may run on the engine's thread concurrently with the rest (a deque append,
  no lock, so the engine step never waits on the link); every other method holds one lock and never
  blocks on I/O.

Both links log a directive they refuse through ``RefusalLog``: one short line, at most one per
``REFUSED_LOG_S``, whatever the sidecar sends. The sidecar logs an engine's rate-limited report
batches by the same rule (one ``RefusalLog`` per engine), so the rule is written once, here.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from controller.v1 import controller_pb2 as pb
from controller.wire.codec import MAX_DROPPED_STEPS, PACKED_PROTOCOL
from controller.wire.convert import directive_for_engine
from controller.wire.names import escape_text
from policies.directive import Directive

log = logging.getLogger(__name__)

T = TypeVar("T")

#: gRPC's default limit on a received message, which a sidecar that does not say its own applies.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Room kept for what wraps the steps: the EngineMessage and StepReportBatch headers (tags, lengths,
#: sequence, dropped count), a few dozen bytes, with a wide margin.
ENVELOPE_BYTES = 1024
#: Per step in a batch beyond its own encoding: the field tag and a length of up to 5 bytes.
STEP_FRAME_BYTES = 6
#: A refused directive is logged in one line, but at most one line per this many seconds (the next one
#: counts those refused meanwhile): a sidecar sending thousands of bad directives a second must not
#: fill the engine's log, nor an engine over its rate limit the sidecar's (``RefusalLog``).
REFUSED_LOG_S = 10.0


@dataclass(frozen=True, slots=True)
class _Kept(Generic[T]):
    """A batch kept for a resend: its number, the drops it reported and its steps (encoded again on
    a resend, in the form the sidecar then reads)."""

    sequence: int
    dropped_steps: int
    steps: list[T]


@dataclass(frozen=True, slots=True)
class LinkStats:
    """A snapshot of one engine link's counters (since the link was made)."""

    #: A stream is open and has delivered a directive.
    connected: bool
    #: Streams opened, streams that delivered a first directive, streams ended.
    connects: int
    attaches: int
    disconnects: int
    #: Steps put in batches (resends not counted again), dropped (by a full queue, or too large for the
    #: sidecar to take alone), forgotten unacknowledged (or too large for a new stream's sidecar).
    sent_steps: int
    dropped_steps: int
    evicted_steps: int
    #: Directives received and applied; received but invalid (ignored).
    directives: int
    bad_directives: int
    #: Batches sent again after a reconnect; the highest sequence the sidecar acknowledged.
    resent_batches: int
    acked_sequence: int
    #: Batches kept for a resend now and their steps; steps queued, not yet in a batch.
    unacked_batches: int
    unacked_steps: int
    queued_steps: int


class LinkCore(Generic[T]):
    """One engine's link protocol state (see the module docstring for the call order).

    ``encode(step, packed)`` turns a queued step into its ``StepReport`` when it goes into a batch (off
    the engine's critical path); ``packed``: the sidecar of the stream's last directive reads packed
    columns (``Directive.protocol_version`` >= ``PACKED_PROTOCOL``), so the step may be sent packed.
    ``queue_steps`` bounds the send queue, ``resend_steps`` the keep buffer.
    """

    def __init__(
        self, *, encode: Callable[[T, bool], pb.StepReport], queue_steps: int, resend_steps: int
    ) -> None:
        if queue_steps < 1 or resend_steps < 1:
            raise ValueError(
                f"link: queue_steps and resend_steps must be >= 1, got {queue_steps}, {resend_steps}"
            )
        self._encode = encode
        self.queue_steps = queue_steps
        self.resend_steps = resend_steps
        self._lock = threading.Lock()
        # A deque, not a queue.Queue: append and popleft are atomic, so ``offer`` takes no lock.
        self._queue: deque[T] = deque()
        self._dropped = 0  # written by ``offer`` only (``discard`` runs once the engine offers no more)
        self._undeliverable = 0  # steps too large for any batch, or not encodable: dropped under the lock
        self._encode_failed = False
        self._dropped_reported = 0
        self._sequence = 0
        self._unacked: deque[_Kept[T]] = deque()
        self._unacked_steps = 0
        self._acks = False
        self._acked = 0
        self._packed = False
        self._max_bytes = DEFAULT_MAX_MESSAGE_BYTES
        self._max_steps = 0  # 0: the sidecar did not say
        self._connected = False
        self._connects = 0
        self._attaches = 0
        self._disconnects = 0
        self._sent = 0
        self._evicted = 0
        self._directives = 0
        self._bad_directives = 0
        self._resent = 0

    # -- engine side -------------------------------------------------------------------------------

    def offer(self, step: T) -> bool:
        """Queue a step for the next batch; False (and counted) when the queue is full."""
        if len(self._queue) >= self.queue_steps:
            self._dropped += 1
            return False
        self._queue.append(step)
        return True

    # -- stream events -----------------------------------------------------------------------------

    def opened(self) -> None:
        """A new stream: the driver sends the Hello next."""
        with self._lock:
            self._connects += 1

    def received(self, msg: pb.Directive) -> Directive:
        """A directive arrived: applies its acknowledgement and returns it decoded. Raises ValueError
        (counted in ``bad_directives``; the acknowledgement still applies) when it is invalid or more
        than an engine takes (``convert.directive_for_engine``)."""
        with self._lock:
            self._acks = msg.HasField("acked_sequence")
            self._packed = msg.protocol_version >= PACKED_PROTOCOL
            self._max_bytes = msg.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
            self._max_steps = msg.max_steps_per_batch
            if self._acks:
                self._acked = msg.acked_sequence
                while self._unacked and self._unacked[0].sequence <= msg.acked_sequence:
                    self._unacked_steps -= len(self._unacked.popleft().steps)
            if not self._connected:
                self._connected = True
                self._attaches += 1
            try:
                d = directive_for_engine(msg)
            except ValueError:
                self._bad_directives += 1
                raise
            self._directives += 1
            return d

    def resume(self) -> list[pb.StepReportBatch]:
        """What to resend on this stream before new batches (call once, after the stream's first
        directive or after waiting for it in vain): the kept batches, oldest first; none (and the
        buffer cleared) when the sidecar does not acknowledge."""
        with self._lock:
            if not self._acks:
                self._unacked.clear()
                self._unacked_steps = 0
            out: list[pb.StepReportBatch] = []
            keep: deque[_Kept[T]] = deque()
            for kept in self._unacked:
                batch = pb.StepReportBatch(
                    sequence=kept.sequence,
                    steps=[self._encode(step, self._packed) for step in kept.steps],
                    dropped_steps=kept.dropped_steps,
                )
                if self._fits(batch):
                    out.append(batch)
                    keep.append(kept)
                else:  # this sidecar would refuse it unread, on every resend: forget it, counted
                    self._unacked_steps -= len(kept.steps)
                    self._evicted += len(kept.steps)
            self._unacked = keep
            self._resent += len(out)
            return out

    def _fits(self, batch: pb.StepReportBatch) -> bool:
        """Whether the stream's sidecar takes ``batch`` (its size and step count)."""
        if self._max_steps and len(batch.steps) > self._max_steps:
            return False
        return batch.ByteSize() + ENVELOPE_BYTES <= self._max_bytes

    def next_batch(self, max_steps: int) -> pb.StepReportBatch | None:
        """Up to ``max_steps`` queued steps as the next batch (kept while the sidecar acknowledges);
        None when nothing is queued."""
        with self._lock:
            if self._max_steps:
                max_steps = min(max_steps, self._max_steps)
            budget = self._max_bytes - ENVELOPE_BYTES
            records: list[T] = []
            steps: list[pb.StepReport] = []
            size = 0
            while self._queue and len(records) < max_steps:
                record = self._queue.popleft()
                try:
                    step = self._encode(record, self._packed)
                except Exception as e:  # never deliverable: the steps taken before it stay in this batch
                    self._undeliverable += 1
                    if not self._encode_failed:  # (a bug: said once, then counted in dropped_steps)
                        self._encode_failed = True
                        log.warning("speccontrol link: a step could not be encoded, dropped: %r", e)
                    continue
                need = step.ByteSize() + STEP_FRAME_BYTES
                if need > budget:  # never deliverable: dropped, reported with the next batch
                    self._undeliverable += 1
                    continue
                if size + need > budget:  # the next batch's first step
                    self._queue.appendleft(record)
                    break
                records.append(record)
                steps.append(step)
                size += need
            if not records:
                return None
            n = len(records)
            self._sequence += 1
            # At most what the sidecar takes in one batch (it refuses more, and the batch would be
            # resent first on every stream, forever); the rest goes with the batches after it.
            dropped = min(self._dropped + self._undeliverable - self._dropped_reported, MAX_DROPPED_STEPS)
            self._dropped_reported += dropped
            batch = pb.StepReportBatch(sequence=self._sequence, steps=steps, dropped_steps=dropped)
            self._sent += n
            if self._acks:
                self._unacked.append(_Kept(self._sequence, dropped, records))
                self._unacked_steps += n
                while self._unacked_steps > self.resend_steps and len(self._unacked) > 1:
                    old = len(self._unacked.popleft().steps)
                    self._unacked_steps -= old
                    self._evicted += old
            return batch

    def discard(self) -> int:
        """The link is closing for good: the steps never put in a batch are counted as dropped (every
        offered step is sent, resent or counted); how many. For when the engine offers no more."""
        n = len(self._queue)
        self._queue.clear()
        self._dropped += n
        return n

    def closed(self) -> None:
        """The stream ended (cancelled, failed or closed by the sidecar)."""
        with self._lock:
            self._connected = False
            self._disconnects += 1

    # -- state -------------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Steps waiting for a batch."""
        return len(self._queue)

    @property
    def outstanding(self) -> bool:
        """Steps not yet sent, or (with a sidecar that acknowledges) sent but not acknowledged."""
        return bool(self._queue) or bool(self._unacked)

    def stats(self) -> LinkStats:
        with self._lock:
            return LinkStats(
                connected=self._connected,
                connects=self._connects,
                attaches=self._attaches,
                disconnects=self._disconnects,
                sent_steps=self._sent,
                dropped_steps=self._dropped + self._undeliverable,
                evicted_steps=self._evicted,
                directives=self._directives,
                bad_directives=self._bad_directives,
                resent_batches=self._resent,
                acked_sequence=self._acked,
                unacked_batches=len(self._unacked),
                unacked_steps=self._unacked_steps,
                queued_steps=len(self._queue),
            )


class RefusalLog:
    """What is logged of a run of refusals (an engine's of the directives ``LinkCore.received`` raised
    on; the sidecar's of an engine's rate-limited batches): the refusal escaped and cut (an engine
    quotes the sidecar's text), one line at most per ``REFUSED_LOG_S`` on ``clock``, the next line
    counting those refused meanwhile. Each refusal is still the caller's to count."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._logged: float | None = None  # (clock) when a line was last given
        self._quiet = 0  # refused since, not logged

    def line(self, e: ValueError) -> str | None:
        """The text to log for the refusal ``e`` now; None: not now (it is counted for the next)."""
        now = self.clock()
        if self._logged is not None and now - self._logged < REFUSED_LOG_S:
            self._quiet += 1
            return None
        more = f" ({self._quiet} more refused since the last such line)" if self._quiet else ""
        self._logged, self._quiet = now, 0
        return f"{quoted(str(e))}{more}"


def quoted(text: str, limit: int = 300) -> str:
    """A sidecar's text as an engine logs it: control characters escaped, cut to ``limit``."""
    out = escape_text(text)
    return out if len(out) <= limit else f"{out[: limit - 3]}..."
