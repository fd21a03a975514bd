"""The I/O-free link protocol core: any interleaving of offers, sends, deliveries, acknowledgements,
disconnects and reconnects neither loses nor duplicates a step, and the buffers stay bounded.

The sidecar here is a model of the real one's rule (apply a batch whose sequence is above the last
applied, acknowledge the last applied); the stream is a FIFO whose undelivered tail a disconnect loses.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb
from controller.wire.codec import PACKED_PROTOCOL
from controller.wire.link import DEFAULT_MAX_MESSAGE_BYTES, LinkCore


def _step(i: int, packed: bool = False) -> pb.StepReport:
    return pb.StepReport(directive_version=i)  # the step's id rides in a field the test owns


def _directive(acked: int | None, version: int = 1) -> pb.Directive:
    d = pb.Directive(version=version, policy="p", ttl_s=30.0, method="eagle3")
    if acked is not None:
        d.acked_sequence = acked
    return d


@dataclass
class World:
    """A core, a stream and a model sidecar."""

    core: LinkCore[int]
    acks: bool
    offered: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    applied: list[int] = field(default_factory=list)
    reported_dropped: int = 0
    last_applied: int = 0
    transit: list[pb.StepReportBatch] = field(default_factory=list)
    open: bool = False
    resumed: bool = False
    first_sends: list[int] = field(default_factory=list)  # sequences of new (not resent) batches

    def offer(self) -> None:
        i = len(self.offered) + 1
        self.offered.append(i)
        if self.core.offer(i):
            self.accepted.append(i)

    def connect(self) -> None:
        if not self.open:
            self.core.opened()
            self.open, self.resumed = True, False

    def directive(self) -> None:
        if not self.open:
            return
        d = self.core.received(_directive(self.last_applied if self.acks else None))
        assert d.version == 1
        if not self.resumed:
            self.resumed = True
            self.transit.extend(self.core.resume())

    def send(self, n: int) -> None:
        if self.open and self.resumed:
            b = self.core.next_batch(n)
            if b is not None:
                assert 1 <= len(b.steps) <= n
                self.first_sends.append(b.sequence)
                self.transit.append(b)

    def deliver(self) -> None:
        if not self.transit:
            return
        b = self.transit.pop(0)
        if b.sequence > self.last_applied:  # the sidecar's rule: drop what it has applied
            self.applied.extend(s.directive_version for s in b.steps)
            self.reported_dropped += b.dropped_steps
            self.last_applied = b.sequence

    def disconnect(self) -> None:
        if self.open:
            self.transit.clear()  # what was not delivered is lost with the stream
            self.core.closed()
            self.open = False

    def settle(self) -> None:
        """Reconnect and run until everything is sent and acknowledged (or nothing is left to do)."""
        self.disconnect()
        self.connect()
        self.directive()
        for _ in range(10_000):
            self.send(1 << 30)
            while self.transit:
                self.deliver()
            self.directive()
            if not self.core.outstanding:
                break
        assert not self.core.outstanding or not self.acks

    def check_bounds(self) -> None:
        s = self.core.stats()
        assert s.queued_steps <= self.core.queue_steps
        assert s.unacked_steps <= self.core.resend_steps or s.unacked_batches == 1
        assert s.unacked_batches <= s.unacked_steps
        if not self.acks:
            assert s.unacked_batches == 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["offer", "offer", "offer", "send", "deliver", "directive", "disconnect", "connect"]),
        st.integers(1, 8),
    ),
    max_size=300,
)


@settings(max_examples=200, deadline=None)
@given(
    OPS,
    st.booleans(),
    st.integers(1, 40),
    st.integers(1, 40),
)
def test_no_step_lost_or_duplicated(ops: list[tuple[str, int]], acks: bool, queue: int, keep: int) -> None:
    w = World(core=LinkCore(encode=_step, queue_steps=queue, resend_steps=keep), acks=acks)
    for op, n in ops:
        if op == "offer":
            for _ in range(n):
                w.offer()
        elif op == "send":
            w.send(n)
        else:
            getattr(w, op)()
        w.check_bounds()
    w.settle()
    s = w.core.stats()
    # Never twice, and only steps that were accepted, in the order they were offered.
    assert len(set(w.applied)) == len(w.applied)
    assert set(w.applied) <= set(w.accepted)
    assert w.applied == sorted(w.applied)
    # Every offered step is accepted or counted as dropped; sequences count new batches one by one.
    assert len(w.accepted) + s.dropped_steps == len(w.offered)
    assert w.first_sends == list(range(1, len(w.first_sends) + 1))
    assert s.sent_steps == len(w.accepted)
    missing = len(w.accepted) - len(w.applied)
    if acks:
        # What the sidecar never got was forgotten for want of room, and counted so.
        assert missing <= s.evicted_steps
        if s.evicted_steps == 0:
            assert missing == 0 and w.reported_dropped == s.dropped_steps
        assert s.acked_sequence == w.last_applied
    else:
        assert s.evicted_steps == 0 and s.resent_batches == 0


def test_resend_after_a_lost_stream_keeps_the_sequences() -> None:
    core: LinkCore[int] = LinkCore(encode=_step, queue_steps=100, resend_steps=100)
    core.opened()
    core.received(_directive(0))
    assert core.resume() == []
    for i in range(1, 7):
        core.offer(i)
    a, b = core.next_batch(3), core.next_batch(3)
    assert a is not None and b is not None and (a.sequence, b.sequence) == (1, 2)
    core.received(_directive(1))  # the sidecar applied the first batch only
    core.closed()
    core.opened()
    core.received(_directive(1))
    again = core.resume()
    assert [x.sequence for x in again] == [2] and [s.directive_version for s in again[0].steps] == [4, 5, 6]
    core.offer(7)
    c = core.next_batch(10)
    assert c is not None and c.sequence == 3
    s = core.stats()
    assert (s.connects, s.attaches, s.disconnects, s.resent_batches, s.acked_sequence) == (2, 2, 1, 1, 1)
    assert s.connected
    core.received(_directive(3))
    assert not core.outstanding and core.stats().unacked_batches == 0


def test_a_full_queue_drops_and_the_next_batch_reports_the_count() -> None:
    core: LinkCore[int] = LinkCore(encode=_step, queue_steps=4, resend_steps=100)
    assert [core.offer(i) for i in range(6)] == [True] * 4 + [False] * 2
    b = core.next_batch(256)
    assert b is not None and len(b.steps) == 4 and b.dropped_steps == 2
    core.offer(9)
    b2 = core.next_batch(256)
    assert b2 is not None and b2.dropped_steps == 0
    assert core.next_batch(256) is None
    assert core.stats().dropped_steps == 2


def test_more_drops_than_one_batch_may_report_go_in_several_batches() -> None:
    # The sidecar refuses a batch reporting more than MAX_DROPPED_STEPS (unconsumed: it would be
    # resent first on every stream, and nothing after it ever applied).
    from controller.validation import check_batch_header
    from controller.wire.codec import MAX_DROPPED_STEPS

    core: LinkCore[int] = LinkCore(encode=_step, queue_steps=100, resend_steps=100)
    core._dropped = 2 * MAX_DROPPED_STEPS + 5  # a long outage's drops (2^31 offers take too long here)
    reported = []
    for i in range(1, 4):
        core.offer(i)
        b = core.next_batch(256)
        assert b is not None
        check_batch_header(b)  # the sidecar takes it
        reported.append(b.dropped_steps)
    assert reported == [MAX_DROPPED_STEPS, MAX_DROPPED_STEPS, 5]


def test_eviction_keeps_the_newest_batch_and_counts_the_rest() -> None:
    core: LinkCore[int] = LinkCore(encode=_step, queue_steps=10_000, resend_steps=5)
    core.opened()
    core.received(_directive(0))
    for i in range(300):
        core.offer(i)
    while core.next_batch(4) is not None:
        pass
    s = core.stats()
    assert s.unacked_steps <= 5 and s.evicted_steps == 300 - s.unacked_steps
    core.offer(1)
    big = LinkCore(encode=_step, queue_steps=100, resend_steps=2)
    big.opened()
    big.received(_directive(0))
    for i in range(10):
        big.offer(i)
    assert big.next_batch(10) is not None
    assert big.stats().unacked_batches == 1 and big.stats().unacked_steps == 10  # bigger than the bound


def test_a_sidecar_that_does_not_acknowledge_gets_no_resend() -> None:
    core: LinkCore[int] = LinkCore(encode=_step, queue_steps=100, resend_steps=100)
    core.opened()
    core.received(_directive(0))
    core.offer(1)
    assert core.next_batch(5) is not None and core.stats().unacked_batches == 1
    core.closed()
    core.opened()
    core.received(_directive(None))  # an older sidecar: no acked_sequence
    assert core.resume() == [] and not core.outstanding


def test_an_invalid_directive_raises_counts_and_still_acknowledges() -> None:
    core: LinkCore[int] = LinkCore(encode=_step, queue_steps=100, resend_steps=100)
    core.opened()
    core.received(_directive(0))
    core.offer(1)
    assert core.next_batch(5) is not None
    bad = _directive(1)
    bad.method = "warp-drive"
    with pytest.raises(ValueError):
        core.received(bad)
    s = core.stats()
    assert (s.bad_directives, s.directives, s.unacked_batches, s.acked_sequence) == (1, 1, 0, 1)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="queue_steps and resend_steps"):
        LinkCore(encode=_step, queue_steps=0, resend_steps=1)


def test_offers_from_another_thread_are_all_accounted_for() -> None:
    """The engine thread offers while the sender batches: every step is sent once or counted dropped."""
    core: LinkCore[int] = LinkCore(encode=_step, queue_steps=512, resend_steps=1 << 20)
    core.opened()
    core.received(_directive(0))
    total = 20_000
    seen: list[int] = []

    def engine() -> None:
        for i in range(total):
            core.offer(i)

    t = threading.Thread(target=engine)
    t.start()
    while t.is_alive() or core.queued:
        b = core.next_batch(64)
        if b is not None:
            seen.extend(s.directive_version for s in b.steps)
    t.join()
    s = core.stats()
    assert len(seen) == len(set(seen)) == s.sent_steps
    assert s.sent_steps + s.dropped_steps == total
    assert seen == sorted(seen)


def test_steps_go_packed_only_while_the_sidecar_reads_packed_columns() -> None:
    forms: list[bool] = []

    def encode(i: int, packed: bool) -> pb.StepReport:
        forms.append(packed)
        return _step(i)

    core: LinkCore[int] = LinkCore(encode=encode, queue_steps=100, resend_steps=100)
    core.opened()
    core.offer(1)
    core.next_batch(10)  # before any directive: the sidecar's protocol is unknown
    core.received(_directive(acked=None))  # an older sidecar: no protocol_version
    core.offer(2)
    core.next_batch(10)
    newer = _directive(acked=None)
    newer.protocol_version = PACKED_PROTOCOL
    core.received(newer)
    core.offer(3)
    core.next_batch(10)
    core.received(_directive(acked=None))  # a reconnect to an older sidecar
    core.offer(4)
    core.next_batch(10)
    assert forms == [False, False, True, False]


def test_a_kept_batch_is_resent_in_the_form_the_new_sidecar_reads() -> None:
    forms: list[tuple[int, bool]] = []

    def encode(i: int, packed: bool) -> pb.StepReport:
        forms.append((i, packed))
        return _step(i)

    core: LinkCore[int] = LinkCore(encode=encode, queue_steps=100, resend_steps=100)
    core.opened()
    newer = _directive(acked=0)
    newer.protocol_version = PACKED_PROTOCOL
    core.received(newer)
    for i in (1, 2, 3):
        core.offer(i)
    sent = core.next_batch(2)
    assert sent is not None and forms == [(1, True), (2, True)]
    core.closed()
    core.opened()  # the sidecar came back older: it acknowledges, but reads no packed columns
    core.received(_directive(acked=0))
    again = core.resume()
    assert forms[2:] == [(1, False), (2, False)]  # the kept steps, encoded again
    assert [b.sequence for b in again] == [sent.sequence]
    assert [s.directive_version for s in again[0].steps] == [1, 2]
    assert core.resume() == again  # a second resume resends the same batch


# -- batches the sidecar takes: bytes and steps ----------------------------------------------------


def _sized(step: tuple[int, int], packed: bool) -> pb.StepReport:
    """Step ``i`` of about ``size`` bytes (a request id of that length)."""
    i, size = step
    return pb.StepReport(directive_version=i, columns=pb.RequestColumns(request_id=["x" * size]))


def _limits(max_bytes: int, max_steps: int) -> pb.Directive:
    d = _directive(acked=0)
    d.max_message_bytes, d.max_steps_per_batch = max_bytes, max_steps
    return d


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=60),
    max_bytes=st.sampled_from([0, 128 * 1024, 200_000, 1 << 20, 4 << 20]),
    max_steps=st.integers(0, 40),
    batch_max=st.integers(1, 300),
)
def test_every_batch_fits_what_the_sidecar_says_it_takes(
    sizes: list[int], max_bytes: int, max_steps: int, batch_max: int
) -> None:
    """Each batch is within the advertised bytes (gRPC's 4 MiB when the sidecar says 0) and steps; every
    step goes out once, in order, unless it alone exceeds the limit: then it is dropped and counted."""
    core: LinkCore[tuple[int, int]] = LinkCore(encode=_sized, queue_steps=1000, resend_steps=100_000)
    core.opened()
    core.received(_limits(max_bytes, max_steps))
    for i, size in enumerate(sizes):
        assert core.offer((i, size))
    limit = max_bytes or DEFAULT_MAX_MESSAGE_BYTES
    sent: list[int] = []
    reported = 0
    while (batch := core.next_batch(batch_max)) is not None:
        message = pb.EngineMessage(reports=batch)
        assert message.ByteSize() <= limit
        assert 1 <= len(batch.steps) <= min(batch_max, max_steps or batch_max)
        sent.extend(s.directive_version for s in batch.steps)
        reported += batch.dropped_steps

    def alone(i: int) -> int:  # the message of step i alone, with the largest envelope
        one = pb.StepReportBatch(
            sequence=(1 << 53) - 1, steps=[_sized((i, sizes[i]), False)], dropped_steps=1 << 30
        )
        return pb.EngineMessage(reports=one).ByteSize()

    assert sent == sorted(set(sent))  # in order, each once
    for i in range(len(sizes)):
        if alone(i) <= limit - 1024:  # well within the limit: delivered
            assert i in sent
        if alone(i) > limit:  # beyond it: dropped
            assert i not in sent
    assert core.stats().dropped_steps == len(sizes) - len(sent)
    # Drops made while forming the last batch are reported by the next one.
    assert reported <= core.stats().dropped_steps
    assert core.stats().sent_steps == len(sent)


def test_before_any_directive_batches_stay_within_grpcs_default_limit() -> None:
    core: LinkCore[tuple[int, int]] = LinkCore(encode=_sized, queue_steps=100, resend_steps=100)
    core.opened()
    for i in range(10):
        core.offer((i, 1_000_000))  # 1 MB each: four fit in 4 MiB, five do not
    batch = core.next_batch(256)
    assert batch is not None and len(batch.steps) == 4
    assert pb.EngineMessage(reports=batch).ByteSize() <= DEFAULT_MAX_MESSAGE_BYTES


def test_a_kept_batch_a_new_sidecar_would_refuse_is_forgotten_and_counted() -> None:
    core: LinkCore[tuple[int, int]] = LinkCore(encode=_sized, queue_steps=100, resend_steps=100)
    core.opened()
    core.received(_limits(1 << 20, 0))
    for i in range(6):
        core.offer((i, 150_000))
    first = core.next_batch(3)  # 3 x 150 kB: within 1 MiB
    second = core.next_batch(1)
    assert first is not None and second is not None and len(first.steps) == 3
    core.closed()
    core.opened()  # the sidecar came back with 128 KiB: the first batch no longer fits, the second's does not either
    core.received(_limits(128 * 1024, 0))
    assert core.resume() == []
    stats = core.stats()
    assert stats.evicted_steps == 4 and stats.unacked_batches == 0 and stats.unacked_steps == 0
    core.closed()
    core.opened()  # and a roomier one later: nothing is left to resend
    core.received(_limits(4 << 20, 0))
    assert core.resume() == []


def test_a_step_its_encoder_raises_on_is_dropped_and_counted_not_the_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An encoder that raises on one step (a bug; lone surrogates in a request id once did) cost that
    step only: the steps beside it go out and it is counted in ``dropped_steps``, one log line."""

    def encode(i: int, packed: bool) -> pb.StepReport:
        if i % 3 == 0:
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        return _step(i, packed)

    core: LinkCore[int] = LinkCore(encode=encode, queue_steps=64, resend_steps=64)
    for i in range(1, 10):
        core.offer(i)
    b = core.next_batch(256)
    assert b is not None
    assert [s.directive_version for s in b.steps] == [1, 2, 4, 5, 7, 8] and b.dropped_steps == 3
    assert core.next_batch(256) is None
    core.offer(10)
    b2 = core.next_batch(256)
    assert b2 is not None and b2.dropped_steps == 0
    assert core.stats().dropped_steps == 3 and core.stats().sent_steps == 7
    assert len([r for r in caplog.records if "could not be encoded" in r.getMessage()]) == 1
