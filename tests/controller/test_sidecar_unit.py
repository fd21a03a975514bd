"""The sidecar's registry and decisions driven in-process: no socket is bound, time is a fake clock.

Covers attach, ingest (sequences, duplicates, gaps), decisions and refreshes, policy set and rollback
(written through to the snapshot), eviction at ``max_engines``, and the snapshot round trip (clean and
after a crash), plus a property test of the at-most-once accounting over random resend patterns.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.policy_store import NoPreviousPolicy, PolicyNotSaved
from controller.sidecar import EngineSession, FleetPolicyLimited, Sidecar, engine_report_limit
from controller.state import CRASH_VERSION_GAP
from controller.state_dir import StateDirLocked
from controller.streams import StreamEnd
from controller.v1 import controller_pb2 as pb
from controller.validation import TelemetryError, validate_hello
from controller.wire import link
from controller.wire.codec import request_steps
from policies.directive import Directive
from policies.engine import EngineInfo
from policies.presets import preset_text
from policies.spec import PolicyError

T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def info(engine_id: str) -> EngineInfo:
    arms = [pb.Arm(method="eagle3", k=k) for k in (1, 2, 3, 4)] + [pb.Arm(method="off")]
    return validate_hello(
        pb.Hello(
            engine_id=engine_id,
            model="tiny",
            max_k=4,
            arms=arms,
            granularity=pb.GRANULARITY_BATCH_STEP,
            max_batch_size=64,
            protocol_version=1,
        )
    )


def batch(seq: int, n_steps: int, *, t0: float = 1.0, n: int = 4, k: int = 2) -> pb.StepReportBatch:
    steps = [
        pb.StepReport(
            time_s=t0 + 0.02 * i,
            duration_s=0.02,
            batch_size=n,
            queue_length=1,
            scheduled_k=k,
            requests=request_steps(
                request_ids=[f"r{j}" for j in range(n)],
                classes=["default"] * n,
                methods=["eagle3"] * n,
                ks=[k] * n,
                drafted=[k] * n,
                accepted=[(i + j) % (k + 1) for j in range(n)],
            ),
        )
        for i in range(n_steps)
    ]
    return pb.StepReportBatch(sequence=seq, steps=steps)


def make(tmp_path: Path, clock: Clock, *, max_engines: int = 1024) -> Sidecar:
    cfg = SidecarConfig(
        state_dir=str(tmp_path / "state"), max_policy_changes_per_s=1000.0, max_engines=max_engines
    )
    return Sidecar(config=cfg, registry=CollectorRegistry(), clock=clock)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sidecar(tmp_path: Path, clock: Clock) -> Iterator[Sidecar]:
    sc = make(tmp_path, clock)
    sc.open()
    try:
        yield sc
    finally:
        sc.close(snapshot=False)


def drain(q: asyncio.Queue[T]) -> list[T]:
    out: list[T] = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def sample(sc: Sidecar, name: str, **labels: str) -> float:
    return sc.registry.get_sample_value(name, labels) or 0.0


def test_attach_pushes_a_first_directive_without_any_socket(sidecar: Sidecar) -> None:
    s = sidecar.attach(info("e1"), instance_id="a" * 32)
    [d] = drain(s.queue)
    assert isinstance(d, Directive) and d.version == 1 == sidecar.directive_version
    st_ = sidecar.engines()["e1"]
    assert st_.connected and st_.instance_id == "a" * 32 and st_.last_sequence == 0
    sidecar.detach(s)
    assert not sidecar.engines()["e1"].connected


def test_ingest_applies_each_batch_once_and_counts_gaps(sidecar: Sidecar) -> None:
    s = sidecar.attach(info("e1"), instance_id="a" * 32)
    for seq in (1, 2, 2, 1, 5, 6):  # two resends, then 3 and 4 never arrive
        sidecar.ingest(s, batch(seq, 10))
    st_ = sidecar.engines()["e1"]
    assert st_.loop.totals.steps == 40 and st_.loop.totals.request_steps == 160
    assert st_.last_sequence == 6 and s.acked_sequence == 0  # acknowledged once on disk
    assert sidecar.save_snapshot()
    assert s.acked_sequence == 6
    assert sample(sidecar, "speccontrol_duplicate_reports_total", engine="e1") == 2
    assert sample(sidecar, "speccontrol_lost_report_batches_total", engine="e1") == 2


def test_a_second_process_under_an_attached_engine_id_is_refused_until_the_first_leaves(
    sidecar: Sidecar,
) -> None:
    # Two processes under one id reset each other's sequences: the first's resends after its
    # reconnect were applied a second time (80 steps for 60), and one was acked for the other's.
    a = sidecar.attach(info("e1"), instance_id="a" * 32)
    sidecar.ingest(a, batch(1, 10))
    sidecar.ingest(a, batch(2, 10))
    with pytest.raises(TelemetryError, match="attached by another engine process") as e:
        sidecar.attach(info("e1"), instance_id="b" * 32)
    assert e.value.reason == "engine_id_in_use"
    st_ = sidecar.engines()["e1"]
    assert (st_.instance_id, st_.last_sequence, len(st_.link.queues)) == ("a" * 32, 2, 1)
    again = sidecar.attach(info("e1"), instance_id="a" * 32)  # the same process reconnecting: fine
    sidecar.ingest(again, batch(2, 10))  # its resend is a duplicate
    assert st_.loop.totals.steps == 20
    sidecar.detach(a)
    sidecar.detach(again)
    b = sidecar.attach(info("e1"), instance_id="b" * 32)  # the first gone: a new process starts afresh
    sidecar.ingest(b, batch(1, 10))
    assert st_.loop.totals.steps == 30 and st_.instance_id == "b" * 32


@pytest.mark.parametrize(("first", "second"), [("a" * 32, ""), ("", "b" * 32), ("", "")])
def test_an_engine_naming_no_instance_cannot_take_over_an_attached_id_with_another_description(
    sidecar: Sidecar, first: str, second: str
) -> None:
    # A Hello without an instance id (an older engine) used to pass the guard above: the loop the
    # open stream feeds was replaced by one for the newcomer's arms, and that stream's next report
    # was refused against the newcomer's max_k.
    a = sidecar.attach(info("e1"), instance_id=first)
    sidecar.ingest(a, batch(1, 10))
    st_ = sidecar.engines()["e1"]
    loop = st_.loop
    other = validate_hello(
        pb.Hello(engine_id="e1", model="tiny", max_k=1, arms=[pb.Arm(method="off")], protocol_version=1)
    )
    with pytest.raises(TelemetryError, match="attached by another engine process") as e:
        sidecar.attach(other, instance_id=second)
    assert e.value.reason == "engine_id_in_use"
    assert st_.loop is loop and st_.info == info("e1") and len(st_.link.queues) == 1
    sidecar.ingest(a, batch(2, 10))  # the first stream goes on
    assert loop.totals.steps == 20
    same = sidecar.attach(info("e1"), instance_id=second)  # its own description: a reconnect, allowed
    sidecar.detach(same)
    sidecar.detach(a)
    b = sidecar.attach(other, instance_id=second)  # the first gone: the newcomer takes the id
    assert sidecar.engines()["e1"].info == other
    sidecar.detach(b)


def test_a_stream_over_the_engines_bound_changes_nothing_of_the_engine(
    sidecar: Sidecar, clock: Clock
) -> None:
    # The refusal came from the stream table after the engine's description, loop and last-seen time
    # had been replaced for the stream it then refused.
    from controller.streams import MAX_STREAMS_PER_ENGINE

    held = [sidecar.attach(info("e1"), instance_id="a" * 32) for _ in range(MAX_STREAMS_PER_ENGINE)]
    st_ = sidecar.engines()["e1"]
    loop, seen = st_.loop, st_.last_seen
    other = validate_hello(
        pb.Hello(engine_id="e1", model="tiny", max_k=1, arms=[pb.Arm(method="off")], protocol_version=1)
    )
    clock.now += 5
    with pytest.raises(TelemetryError) as e:
        sidecar.attach(other, instance_id="a" * 32, observe_only=True, plugin_mode="K table only: x")
    assert e.value.reason == "too_many_streams"
    assert st_.loop is loop and st_.info == info("e1") and st_.last_seen == seen
    assert not st_.observe_only and st_.plugin_mode == "" and len(st_.link.queues) == MAX_STREAMS_PER_ENGINE
    for s in held:
        sidecar.detach(s)


def test_a_stream_without_instance_counts_its_own_sequences(sidecar: Sidecar) -> None:
    first = sidecar.attach(info("old"))
    sidecar.ingest(first, batch(1, 3))
    sidecar.detach(first)
    again = sidecar.attach(info("old"))
    sidecar.ingest(again, batch(1, 3))  # a new stream starts at 1: not a duplicate
    assert sidecar.engines()["old"].loop.totals.steps == 6
    assert again.acked_sequence == 1


def test_invalid_batch_is_refused_and_counted_without_changing_the_loop(sidecar: Sidecar) -> None:
    s = sidecar.attach(info("e1"))
    bad = batch(1, 2)
    bad.steps[1].duration_s = float("nan")
    with pytest.raises(TelemetryError):
        sidecar.ingest(s, bad)
    st_ = sidecar.engines()["e1"]
    assert st_.loop.totals.steps == 0 and st_.rejected == 1


def test_tick_refreshes_before_the_ttl_and_versions_only_grow(sidecar: Sidecar, clock: Clock) -> None:
    s = sidecar.attach(info("e1"))
    [first] = drain(s.queue)
    assert isinstance(first, Directive)
    clock.now += first.ttl_s / 3 + 0.01
    sidecar.tick()
    [again] = drain(s.queue)
    assert isinstance(again, Directive) and again.version >= first.version
    versions = [first.version]
    for i in range(200):
        sidecar.ingest(s, batch(i + 1, 5, t0=clock.now))
        clock.now += 0.05
        sidecar.tick()
        versions += [d.version for d in drain(s.queue) if isinstance(d, Directive)]
    assert versions == sorted(versions) and sidecar.engines()["e1"].loop.totals.steps == 1000


def test_every_guard_count_of_the_loop_is_exported_after_a_round(sidecar: Sidecar, clock: Clock) -> None:
    s = sidecar.attach(info("e1"))
    t = sidecar.engines()["e1"].loop.totals
    t.drift_alarms, t.held_by_margin, t.exploration_denied, t.bounded_moves = (
        1,
        2,
        3,
        5,
    )  # (trips: the guard's)
    for i in range(40):  # past the decision interval: at least one round
        sidecar.ingest(s, batch(i + 1, 5, t0=clock.now))
        clock.now += 0.05
        sidecar.tick()
    want = {"drift_alarm": 1, "held_by_margin": 2, "exploration_denied": 3, "tpot_trip": 0, "bounded_move": 5}
    got = {
        g: sidecar.registry.get_sample_value(
            "speccontrol_policy_guard_events_total", {"engine": "e1", "guard": g}
        )
        for g in want
    }
    assert got == {g: float(v) for g, v in want.items()}


def test_set_policy_and_rollback_switch_the_loops_and_write_through(sidecar: Sidecar) -> None:
    s = sidecar.attach(info("e1"))
    sidecar.ingest(s, batch(0, 20))
    before = sidecar.engines()["e1"].loop.spec.name
    rec = sidecar.set_policy(preset_text("static-eagle3-3"), source="unit.yaml")
    st_ = sidecar.engines()["e1"]
    assert st_.loop.spec.name == rec.spec.name == "static-eagle3-3"
    assert st_.loop.totals.steps == 20  # counters survive a policy switch
    ds = [d for d in drain(s.queue) if isinstance(d, Directive)]
    assert ds[-1].policy == "static-eagle3-3"
    saved = json.loads(sidecar.snapshots.path.read_text())["state"]["policies"]
    assert "static-eagle3-3" in json.dumps(saved)  # on disk before set_policy returned
    with pytest.raises(PolicyError):
        sidecar.set_policy("algorithm: nonsense\n", source="bad.yaml")
    assert sidecar.engines()["e1"].loop.spec.name == "static-eagle3-3"
    sidecar.rollback_policy()
    assert sidecar.engines()["e1"].loop.spec.name == before
    with pytest.raises(NoPreviousPolicy):
        sidecar.rollback_policy("nobody")


@pytest.mark.parametrize("change", ["set", "set-engine", "rollback"])
def test_a_policy_change_that_cannot_be_written_is_not_made(sidecar: Sidecar, change: str) -> None:
    # Acknowledged means on disk (a kill -9 right after must not lose it): when the write fails (a
    # full disk, a read-only volume; here a directory where the snapshot goes), the call fails and
    # the store, the loops and the directives are as before.
    s = sidecar.attach(info("e1"))
    sidecar.ingest(s, batch(0, 20))
    sidecar.set_policy(preset_text("static-eagle3-3"), source="unit.yaml")
    drain(s.queue)
    path = sidecar.snapshots.path
    good = path.read_bytes()
    store_before = json.dumps(sidecar.policy_store.to_json())
    loop_before = sidecar.engines()["e1"].loop
    path.unlink()
    (path / "blocker").mkdir(parents=True)
    with pytest.raises(PolicyNotSaved, match=r"policy not changed: the state could not be written to .*: "):
        if change == "set":
            sidecar.set_policy(preset_text("ucb1"), source="unit.yaml")
        elif change == "set-engine":
            sidecar.set_policy(preset_text("ucb1"), source="unit.yaml", engine_id="e1")
        else:
            sidecar.rollback_policy()
    assert json.dumps(sidecar.policy_store.to_json()) == store_before
    assert sidecar.engines()["e1"].loop is loop_before
    assert not [d for d in drain(s.queue) if isinstance(d, Directive)]
    (path / "blocker").rmdir()
    path.rmdir()
    path.write_bytes(good)
    rec = sidecar.set_policy(preset_text("ucb1"), source="unit.yaml")  # writable again
    assert rec.revision == 3 and "ucb1" in path.read_text()


def test_a_periodic_write_in_flight_never_undoes_a_policy_change(sidecar: Sidecar) -> None:
    s = sidecar.attach(info("e1"), instance_id="a" * 32)
    sidecar.ingest(s, batch(1, 5))
    periodic = sidecar._collect()  # collected, its write still on the worker thread...
    sidecar.set_policy(preset_text("static-eagle3-3"), source="unit.yaml")  # ... when this writes through
    assert sidecar._write(periodic)  # finishes late: the newer state stays on disk
    saved = json.loads(sidecar.snapshots.path.read_text())["state"]
    assert "static-eagle3-3" in json.dumps(saved["policies"])
    assert saved["engines"]["e1"]["last_sequence"] == 1


def test_a_full_registry_forgets_the_engine_unheard_longest(tmp_path: Path, clock: Clock) -> None:
    sc = make(tmp_path, clock, max_engines=3)
    sc.open()
    try:
        sessions: dict[str, EngineSession] = {}
        for i in range(3):
            clock.now += 1
            sessions[f"e{i}"] = sc.attach(info(f"e{i}"))
        with pytest.raises(TelemetryError, match="3 engines"):
            sc.attach(info("e3"))
        sc.detach(sessions["e1"])
        sc.detach(sessions["e0"])
        sc.attach(info("e3"))
        assert sorted(sc.engines()) == ["e1", "e2", "e3"]  # e0 was heard first
    finally:
        sc.close(snapshot=False)


def test_snapshot_round_trip_restores_engines_sequences_and_policy(tmp_path: Path, clock: Clock) -> None:
    sc = make(tmp_path, clock)
    sc.open()
    sessions = [sc.attach(info(f"e{i}"), instance_id=f"{i}" * 32) for i in range(5)]
    for i, s in enumerate(sessions):
        for seq in range(1, 3 + i):
            sc.ingest(s, batch(seq, 7))
    sc.set_policy(preset_text("static-eagle3-3"), source="unit.yaml")
    sc.tick()
    version = sc.directive_version
    want = {eid: (e.loop.totals, e.instance_id, e.last_sequence) for eid, e in sc.engines().items()}
    with pytest.raises(StateDirLocked):
        make(tmp_path, clock).open()  # one sidecar per state directory
    sc.end_streams()
    assert all(isinstance(drain(s.queue)[-1], StreamEnd) for s in sessions)
    sc.close(snapshot=True)

    clean = make(tmp_path, clock)
    clean.open()
    got = {eid: (e.loop.totals, e.instance_id, e.last_sequence) for eid, e in clean.engines().items()}
    assert got == want and clean.directive_version == version
    assert clean.policy_store.default.spec.name == "static-eagle3-3"
    assert not any(e.connected for e in clean.engines().values())
    s = clean.attach(info("e2"), instance_id="2" * 32)  # the same process: its count goes on
    clean.ingest(s, batch(4, 7))
    assert clean.engines()["e2"].loop.totals.steps == want["e2"][0].steps
    clean.ingest(s, batch(5, 7))
    assert clean.engines()["e2"].loop.totals.steps == want["e2"][0].steps + 7
    clean.save_snapshot()  # periodic (not clean): a crash after it skips versions ahead
    clean._release_lock()  # as a kill -9 would: no final snapshot

    crashed = make(tmp_path, clock)
    crashed.open()
    try:
        assert crashed.directive_version == clean.directive_version + CRASH_VERSION_GAP
    finally:
        crashed.close(snapshot=False)


def test_fleet_policies_spend_the_policy_change_budget(tmp_path: Path, clock: Clock) -> None:
    # A publisher flooding the fleet topic must not rebuild every loop and write the state at its
    # pace: past the budget a fleet policy is refused for now (the fleet link tries it again).
    cfg = SidecarConfig(state_dir=str(tmp_path / "state"), max_policy_changes_per_s=0.01)
    sc = Sidecar(config=cfg, registry=CollectorRegistry(), clock=clock)
    sc.open()
    try:
        applied = 0
        for v in range(1, 31):
            try:
                sc._on_fleet_policy(preset_text("static-eagle3-3" if v % 2 else "static-off"), v)
                applied += 1
            except FleetPolicyLimited:
                break
        assert applied == 10  # the burst
        rev = sc.policy_store.default.revision
        assert (sc.fleet_policy_version, rev) == (10, 11)
        with pytest.raises(FleetPolicyLimited, match=r"limited to 0\.01/s"):
            sc._on_fleet_policy(preset_text("static-eagle3-3"), 11)
        assert (sc.fleet_policy_version, sc.policy_store.default.revision) == (10, rev)  # nothing changed
    finally:
        sc.close(snapshot=False)


@pytest.mark.parametrize("first_stop", ["clean", "kill -9"])
def test_versions_are_never_issued_twice_across_a_kill_right_after_a_start(
    tmp_path: Path, clock: Clock, first_stop: str
) -> None:
    # A restart, directives issued, then a kill -9 before any periodic snapshot, twice over: each
    # start must continue past every version issued before, whatever the file said when it began.
    issued: list[int] = []
    for run in range(4):
        sc = make(tmp_path, clock)
        sc.open()
        for i in range(3):
            s = sc.attach(info(f"e{run}-{i}"), instance_id=f"{run}{i}".ljust(32, "x"))
            issued += [d.version for d in drain(s.queue) if isinstance(d, Directive)]
        if run == 0 and first_stop == "clean":
            sc.close(snapshot=True)
        else:
            sc._release_lock()  # as a kill -9 would: no snapshot since the start
    assert len(issued) == 12 and issued == sorted(set(issued)), issued


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seqs=st.lists(st.integers(1, 60), min_size=1, max_size=120),
    sizes=st.lists(st.integers(1, 16), min_size=60, max_size=60),
)
def test_each_sequence_is_applied_at_most_once(
    tmp_path_factory: pytest.TempPathFactory, seqs: list[int], sizes: list[int]
) -> None:
    sc = make(tmp_path_factory.mktemp("p"), Clock())
    sc.open()
    try:
        s = sc.attach(info("e1"), instance_id="p" * 32)
        applied, high, dups = 0, 0, 0
        for seq in seqs:
            sc.ingest(s, batch(seq, sizes[seq - 1]))
            if seq > high:
                applied, high = applied + sizes[seq - 1], seq
            else:
                dups += 1
        assert sc.engines()["e1"].loop.totals.steps == applied
        assert s.acked_sequence == 0 and sc.save_snapshot() and s.acked_sequence == high
        assert sample(sc, "speccontrol_duplicate_reports_total", engine="e1") == dups
    finally:
        sc.close(snapshot=False)


def test_the_applied_fleet_policy_survives_a_restart_by_version_and_digest(
    tmp_path: Path, clock: Clock
) -> None:
    from controller.fleet import policy_digest

    text = preset_text("static-eagle3-3")
    sc = make(tmp_path, clock)
    sc.open()
    sc._on_fleet_policy(text, 3)
    assert (sc.fleet_policy_version, sc.fleet_policy_digest) == (3, policy_digest(text))
    sc._release_lock()  # as a kill -9 would: only the write-through snapshot holds it

    again = make(tmp_path, clock)
    again.open()
    try:
        assert (again.fleet_policy_version, again.fleet_policy_digest) == (3, policy_digest(text))
    finally:
        again.close(snapshot=False)


def test_a_registry_restored_under_a_lowered_max_engines_shrinks_to_it(tmp_path: Path, clock: Clock) -> None:
    """A snapshot holding more engines than ``max_engines`` now allows: new ids forget as many idle
    engines (unheard longest first) as bring the registry under the limit, and an attached one never."""
    sc = make(tmp_path, clock, max_engines=10)
    sc.open()
    for i in range(10):
        clock.now += 1
        sc.detach(sc.attach(info(f"e{i}")))
    sc.close()
    sc = make(tmp_path, clock, max_engines=3)
    sc.open()
    try:
        assert len(sc.engines()) == 10
        clock.now += 1
        held = sc.attach(info("e9"))  # restored, attached again: it must stay
        clock.now += 1
        sc.attach(info("n0"))
        assert sorted(sc.engines()) == ["e8", "e9", "n0"]  # restored ones are unheard since the start
        for i in range(1, 6):
            clock.now += 1
            sc.detach(sc.attach(info(f"n{i}")))
            assert len(sc.engines()) <= 3 and sc.engines()["e9"].connected
        assert sample(sc, "speccontrol_engines_connected") == 2  # e9 and n0
        sc.detach(held)
    finally:
        sc.close(snapshot=False)


def test_the_engine_forgotten_is_the_one_idle_longest_not_the_one_silent_longest(
    tmp_path: Path, clock: Clock
) -> None:
    """An engine attached for hours without traffic (it reports nothing) and gone a moment ago was
    heard more recently than one gone long ago after a busy stream: the latter goes first."""
    sc = make(tmp_path, clock, max_engines=2)
    sc.open()
    try:
        quiet = sc.attach(info("quiet"))
        clock.now += 1
        busy = sc.attach(info("busy"))
        clock.now += 1
        sc.ingest(busy, batch(1, 4))
        clock.now += 1
        sc.detach(busy)  # idle since here
        clock.now += 3600
        sc.detach(quiet)  # silent for an hour, but attached until now
        clock.now += 1
        sc.attach(info("new"))
        assert sorted(sc.engines()) == ["new", "quiet"]
    finally:
        sc.close(snapshot=False)


@pytest.mark.parametrize("change", ["set", "rollback"])
def test_kill_9_right_after_a_change_to_a_policy_of_the_same_name_restores_what_it_acknowledged(
    tmp_path: Path, clock: Clock, change: str
) -> None:
    # A policy change gives each affected engine a fresh loop. The change's own snapshot held the
    # engines' old loops, so after a kill -9 before the next periodic one, the restart (which loads a
    # saved loop whose policy bears the new one's name) gave the new policy the old one's learned
    # statistics: here UCB1's tables in a Thompson learner, rounds and all.
    ucb = preset_text("ucb1").replace("name: ucb1\n", "name: mine\n", 1)
    thompson = preset_text("thompson").replace("name: thompson\n", "name: mine\n", 1)
    sc = make(tmp_path, clock)
    sc.open()
    sc.set_policy(thompson if change == "rollback" else ucb, source="mine.yaml")
    if change == "rollback":
        sc.set_policy(ucb, source="mine.yaml")
    s = sc.attach(info("e1"), instance_id="1" * 32)
    for seq in range(1, 20):
        sc.ingest(s, batch(seq, 8, t0=float(seq)))
        clock.now += 1.0
        sc.tick()
    assert sc.engines()["e1"].loop.rounds > 0
    if change == "set":
        sc.set_policy(thompson, source="mine.yaml")
    else:
        sc.rollback_policy()
    acked = sc.engines()["e1"].loop
    assert acked.spec.algorithm == "discounted_thompson" and acked.rounds == 1  # its first decision
    sc.close(snapshot=False)  # kill -9: no final snapshot
    again = make(tmp_path, clock)
    again.open()
    try:
        got = again.engines()["e1"].loop
        fresh = again._new_loop(info("e1"))
        assert got.spec.algorithm == "discounted_thompson"
        assert (got.rounds, got.state_dict()["learner"]) == (0, fresh.state_dict()["learner"])
        assert got.totals.steps == 19 * 8  # the counters are kept all the same
    finally:
        again.close(snapshot=False)


def test_a_fleet_clear_takes_the_engines_back_to_the_local_policy(tmp_path: Path, clock: Clock) -> None:
    # controllerctl policy clear --fleet: the engines following the default go back to the policy
    # this sidecar had of its own (set here before the fleet's), as a new revision written through;
    # an engine with an override of its own keeps it.
    from controller.fleet import CLEARED_DIGEST

    sc = make(tmp_path, clock)
    sc.open()
    s1, s2 = sc.attach(info("e1")), sc.attach(info("e2"))
    sc.set_policy(preset_text("static-off"), source="local.yaml")
    sc.set_policy(preset_text("ucb1"), source="mine.yaml", engine_id="e2")
    sc._on_fleet_policy(preset_text("static-eagle3-3"), 3)
    sc._on_fleet_policy(preset_text("thompson"), 4)
    assert sc.policy_store.default.source == "fleet v4"
    revision = sc.policy_store.default.revision
    drain(s1.queue), drain(s2.queue)
    sc._on_fleet_policy_cleared(5)
    default = sc.policy_store.default
    assert (default.spec.name, default.source, default.revision) == ("static-off", "local.yaml", revision + 1)
    assert (sc.fleet_policy_version, sc.fleet_policy_digest) == (5, CLEARED_DIGEST)
    assert [d.policy for d in drain(s1.queue) if isinstance(d, Directive)][-1:] == ["static-off"]
    assert drain(s2.queue) == [] and sc.engines()["e2"].loop.spec.name == "ucb1"
    sc._release_lock()  # as a kill -9 would: the write-through snapshot holds the clear

    again = make(tmp_path, clock)
    again.open()
    try:
        assert (again.fleet_policy_version, again.fleet_policy_digest) == (5, CLEARED_DIGEST)
        assert again.policy_store.default.source == "local.yaml"
        # A local policy set since the clear is the sidecar's own: a later clear leaves it.
        again.set_policy(preset_text("epsilon-greedy"), source="later.yaml")
        revision = again.policy_store.default.revision
        again._on_fleet_policy_cleared(6)
        assert (again.policy_store.default.source, again.policy_store.default.revision) == (
            "later.yaml",
            revision,
        )
        assert again.fleet_policy_version == 6
    finally:
        again.close(snapshot=False)


def test_a_fleet_clear_with_no_local_revision_left_goes_back_to_default_policy(sidecar: Sidecar) -> None:
    # More fleet policies than the history keeps pushed the sidecar's own out: the clear falls back
    # to default_policy from the config (the preset 'default' here).
    from controller.limits import TokenBucket

    sidecar.policy_changes = TokenBucket(rate=1e9, burst=1e9)  # (the budget has its own test)
    for v in range(1, 22):
        sidecar._on_fleet_policy(preset_text("static-eagle3-3" if v % 2 else "static-off"), v)
    assert all(r.source.startswith("fleet v") for r in sidecar.policy_store.history())
    sidecar._on_fleet_policy_cleared(22)
    default = sidecar.policy_store.default
    assert (default.spec.name, default.source) == ("default", "preset:default")


def test_a_fleet_clear_that_cannot_be_made_now_changes_nothing(tmp_path: Path, clock: Clock) -> None:
    # Past the policy-change budget (or with the state unwritable) the clear is refused for now, like
    # a fleet policy: the fleet link tries it again, and the fleet version is the one before.
    cfg = SidecarConfig(state_dir=str(tmp_path / "state"), max_policy_changes_per_s=0.01)
    sc = Sidecar(config=cfg, registry=CollectorRegistry(), clock=clock)
    sc.open()
    try:
        sc._on_fleet_policy(preset_text("static-eagle3-3"), 3)
        for _ in range(20):
            if not sc.policy_changes.take():
                break
        with pytest.raises(FleetPolicyLimited):
            sc._on_fleet_policy_cleared(4)
        assert (sc.fleet_policy_version, sc.policy_store.default.source) == (3, "fleet v3")
    finally:
        sc.close(snapshot=False)


def test_rate_limited_batches_are_logged_by_the_one_refusal_rule(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sidecar kept its own copy of the rule the engine links log refusals by (one line per 10 s,
    # the next counting the rest): one rule, ``RefusalLog``, so changing it changes both.
    monkeypatch.setattr(link, "REFUSED_LOG_S", 0.0)  # every refusal gets its line
    cfg = SidecarConfig(
        state_dir=str(tmp_path / "state"),
        max_engine_steps_per_s=1.0,
        telemetry_burst_s=2.0,
        max_steps_per_batch=2,
    )
    sc = Sidecar(config=cfg, registry=CollectorRegistry(), clock=clock)
    sc.open()
    caplog.set_level(logging.WARNING, logger="controller.sidecar")
    try:
        s = sc.attach(info("e1"), instance_id="a" * 32)
        for seq in range(1, 6):  # a burst of 2 steps, then 3 refused
            sc.ingest(s, batch(seq, 1))
        assert sample(sc, "speccontrol_rejected_telemetry_total", reason="rate_limited") == 3
    finally:
        sc.close(snapshot=False)
    lines = [r.getMessage() for r in caplog.records if "rate_limited" in r.getMessage()]
    assert (
        lines
        == ["rejected telemetry from e1: rate_limited: reports: over 1 steps/s (max_engine_steps_per_s)"] * 3
    ), lines


def test_request_steps_over_the_engines_rate_are_refused_under_their_own_reason(
    tmp_path: Path, clock: Clock
) -> None:
    # The limit counted steps only: an engine within its steps/s could send steps of thousands of
    # requests each (a report batch of 40 steps x 4,096 requests took the loop 58 ms), so one engine
    # kept the sidecar's event loop busy. Request-steps (a step's requests) are limited too.
    cfg = SidecarConfig(
        state_dir=str(tmp_path / "state"),
        max_engine_request_steps_per_s=1.0,  # (the budget refills in real time: slowly)
        telemetry_burst_s=1000.0,
        max_steps_per_batch=2,
        max_requests_per_step=64,
    )
    sc = Sidecar(config=cfg, registry=CollectorRegistry(), clock=clock)
    sc.open()
    try:
        s = sc.attach(info("e1"), instance_id="a" * 32)
        for seq in range(1, 11):  # 128 request-steps a batch: 7 fill the burst of 1,000, 3 refused
            sc.ingest(s, batch(seq, 2, n=64))
        st_ = sc.engines()["e1"]
        assert st_.loop.totals.request_steps == 7 * 128 and st_.rejected == 3 and st_.connected
        assert sample(sc, "speccontrol_rejected_telemetry_total", reason="rate_limited_request_steps") == 3
        assert sample(sc, "speccontrol_rejected_telemetry_total", reason="rate_limited") == 0
        assert s.acked_sequence == 0 and sc.save_snapshot() and s.acked_sequence == 10  # refused for good
    finally:
        sc.close(snapshot=False)


def test_an_engine_at_the_documented_sizes_is_never_rate_limited() -> None:
    # The defaults against what a well-behaved engine sends (benchmarks/sidecar_load.py: 100 steps/s,
    # 32..512 requests a step), in the vLLM plugin's batches (every 0.1 s), then its whole send queue
    # (8,192 steps) at once after an outage, on a fake clock; and the flood the limit is for.
    cfg = SidecarConfig()
    for requests in (32, 512):
        clock = Clock()
        limit = engine_report_limit(cfg, clock=clock)
        for _ in range(600):  # 60 s at 10 steps a batch
            clock.now += 0.1
            assert limit.take(10, 10 * requests) == ""
        clock.now += 120.0  # an outage: the plugin's queue fills (8,192 steps), sent in 256-step batches
        for _ in range(8192 // 256):
            assert limit.take(256, 256 * requests) == ""
        for _ in range(600):
            clock.now += 0.1
            assert limit.take(10, 10 * requests) == ""
    clock = Clock()
    limit = engine_report_limit(cfg, clock=clock)
    taken = 0
    for _ in range(1000):  # 10 s within 5,000 steps/s, at 4,096 requests a step: 16M request-steps/s
        clock.now += 0.01
        over = limit.take(40, 40 * 4096)
        assert over in ("", "request_steps")
        taken += over == ""
    # At most the burst (5 s) and 10 s of the rate: 15M of the 164M sent.
    assert taken * 40 * 4096 <= 5 * 1e6 + 10 * 1e6
