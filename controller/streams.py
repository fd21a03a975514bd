"""Engine streams: the queues the sidecar writes directives to, and the report sequences it acknowledges.

What must hold: a report batch is applied at most once per engine instance (a batch at or below the
last sequence is a resend); an engine process (``Hello.instance_id``) keeps its count across its
streams and across a sidecar restart, an engine without one counts per stream; an engine process is
acknowledged only the batches whose effect is on disk (``durable_sequence``, the sequence the last
written snapshot holds), so after a kill -9 it still keeps, and resends, every batch the restarted
sidecar has not got; a stream queue holds only the newest items (a slow stream never blocks the
sidecar), and its end always gets through (it is never the item dropped); an engine holds at most
``MAX_STREAMS_PER_ENGINE`` open streams (``max_engines`` bounds the engines, this their streams).
This module knows nothing of gRPC or of the control loops.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from controller.validation import TelemetryError
from policies.directive import Directive

#: Items a stream queue holds; when full the oldest goes (only the newest directive matters).
STREAM_QUEUE = 16
#: Open streams one engine id may hold. An engine process attaches on one stream; a second, third is
#: its reconnect while the old stream is not yet seen dead (closed within the keepalive, 45 s), and a
#: few processes of an older engine (no instance id) may share an id. Without a bound, one client could
#: open streams under one id without end: each holds a queue, a reader and a handler, and every
#: directive is written to all of them.
MAX_STREAMS_PER_ENGINE = 16


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """Ends an Attach stream: the engine closed it (``error`` None) or sent something invalid."""

    error: TelemetryError | None = None


StreamItem = Directive | StreamEnd


def put_latest(q: asyncio.Queue[Any], item: Any) -> None:
    """Enqueue without waiting; when full, the oldest item goes (only the newest directive matters).

    A ``StreamEnd`` never goes: when it is the oldest, what was queued after it and ``item`` are
    dropped instead (the stream is ending, they would never be read). Without this, a writer held
    by flow control (an engine that stops reading) while directives keep coming would lose the end
    its reader queued, and the stream would stay open for good with nothing reading its reports.
    """
    while True:
        try:
            q.put_nowait(item)
            return
        except asyncio.QueueFull:
            with contextlib.suppress(asyncio.QueueEmpty):
                old = q.get_nowait()
                if isinstance(old, StreamEnd):
                    while not q.empty():
                        q.get_nowait()
                    q.put_nowait(old)
                    return


@dataclass(eq=False, slots=True)
class Sequences:
    """The report sequence count of one tracker (an engine instance, or one stream)."""

    #: The highest report sequence applied (or refused for good).
    last_sequence: int = 0

    def admit(self, seq: int) -> int | None:
        """Count ``seq`` in: None when it is a resend (at or below the last one), else how many
        sequences were skipped before it. Sequence 0 means "unnumbered" and is always admitted."""
        if not seq:
            return 0
        last = self.last_sequence
        if seq <= last:
            return None
        self.last_sequence = seq
        return seq - last - 1 if last else 0


@dataclass(eq=False, slots=True)
class EngineStreams(Sequences):
    """One engine's open streams, and the sequences of the engine instance that sends on them."""

    queues: list[asyncio.Queue[StreamItem]] = field(default_factory=list)
    #: The engine process whose reports ``last_sequence`` counts (Hello.instance_id; "" for none).
    instance_id: str = ""
    #: The highest sequence whose effect a written snapshot holds (what may be acknowledged).
    durable_sequence: int = 0
    #: ``durable_sequence`` as of the last directive pushed to the streams (what the engine knows).
    acked_pushed: int = 0

    @property
    def connected(self) -> bool:
        return bool(self.queues)

    def check_room(self) -> None:
        """Raises TelemetryError (``too_many_streams``) when the engine holds ``MAX_STREAMS_PER_ENGINE``
        open streams: what ``open`` refuses, asked before anything of the engine is changed for it."""
        if len(self.queues) >= MAX_STREAMS_PER_ENGINE:
            raise TelemetryError(
                "too_many_streams",
                f"hello: this engine id already has {len(self.queues)} open streams (at most "
                f"{MAX_STREAMS_PER_ENGINE}); an engine attaches on one",
            )

    def open(self, instance_id: str) -> asyncio.Queue[StreamItem]:
        """A queue for a new stream. A new engine process starts its sequences again (the same
        process re-attaching, also after a sidecar restart, keeps its count). Raises TelemetryError
        (``too_many_streams``, nothing changed) when the engine holds ``MAX_STREAMS_PER_ENGINE``."""
        self.check_room()
        if instance_id and instance_id != self.instance_id:
            self.instance_id, self.last_sequence, self.durable_sequence, self.acked_pushed = (
                instance_id,
                0,
                0,
                0,
            )
        q: asyncio.Queue[StreamItem] = asyncio.Queue(maxsize=STREAM_QUEUE)
        self.queues.append(q)
        return q

    def close(self, q: asyncio.Queue[StreamItem]) -> None:
        with contextlib.suppress(ValueError):
            self.queues.remove(q)

    def push(self, item: StreamItem) -> None:
        """Send ``item`` on every open stream; a directive also acknowledges what is durable so far."""
        if isinstance(item, Directive):
            self.acked_pushed = self.durable_sequence
        for q in self.queues:
            put_latest(q, item)

    @property
    def ack_pending(self) -> bool:
        """Batches became durable since the engine was last told."""
        return self.durable_sequence > self.acked_pushed

    @property
    def unsaved(self) -> bool:
        """Batches of an engine instance were applied that no written snapshot holds yet."""
        return bool(self.instance_id) and self.last_sequence > self.durable_sequence

    def saved(self, instance_id: str, sequence: int) -> None:
        """A snapshot holding ``instance_id``'s batches up to ``sequence`` was written."""
        if instance_id and instance_id == self.instance_id and sequence > self.durable_sequence:
            self.durable_sequence = sequence


E = TypeVar("E")


@dataclass(eq=False, slots=True)
class Session(Generic[E]):
    """One Attach stream of ``engine`` (whose ``streams`` hold ``queue``).

    With an ``instance_id``, sequences count per engine instance across streams (``streams`` holds
    them); without one (older engines), per stream (the session holds them).
    """

    engine: E
    streams: EngineStreams
    queue: asyncio.Queue[StreamItem]
    instance_id: str = ""
    own: Sequences = field(default_factory=Sequences)

    @property
    def sequences(self) -> Sequences:
        s = self.streams
        return s if self.instance_id and s.instance_id == self.instance_id else self.own

    @property
    def acked_sequence(self) -> int:
        """What to acknowledge on this stream: the highest sequence applied (or refused for good) that
        a written snapshot holds; per stream (no instance, nothing to resend after a restart), the
        highest applied."""
        s = self.sequences
        return s.durable_sequence if isinstance(s, EngineStreams) else s.last_sequence
