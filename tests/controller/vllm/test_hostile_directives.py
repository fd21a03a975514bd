"""The plugin against a buggy or compromised sidecar: whatever directive arrives, the engine's hooks never
raise (vLLM calls them without a ``try``; the plugin's own wrappers then disable it for the engine's
lifetime), never spend the step scanning a huge directive, and a directive the engine cannot apply is
refused with one log line while the last good one stays in force.

Through the real intake: a real gRPC server posing as the sidecar and the plugin's ``SidecarLink``, or
``LinkCore.received`` (what the link calls), then the real ``EngineHooks`` over fake schedulers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.vllm.control import ClassArms, Controls, engine_info
from controller.vllm.engine_hooks import EngineHooks
from controller.vllm.link import SidecarLink
from controller.vllm.ngram import NgramIndex
from controller.wire.link import LinkCore
from controller.wire.names import has_control
from policies.arms import METHOD_CODES, Arm, Method
from policies.context import DEFAULT_CLASS, BatchBuckets
from policies.directive import Directive, KRange, PlanEntry
from tests.controller.vllm.test_engine_hooks import (
    SETTINGS,
    FakeAsyncScheduler,
    FakeLink,
    FakeSyncScheduler,
    Req,
)
from tests.controller.wire.test_directive_for_engine import BAD, CLASSES, hostile

MAX_K = 4
GOOD = pb.Directive(version=1, policy="good", ttl_s=30.0, method="eagle3", k_table=[pb.KRange(bs_min=1, k=2)])

#: What a hostile sidecar sends after a good directive: every one must be refused (BAD: one per field),
#: plus the ones that used to stall or break the engine's step.
HOSTILE = [msg for msg, _ in BAD] + [
    pb.Directive(version=2, method="eagle3", k_table=[pb.KRange(bs_min=1, k=2**32 - 1)]),  # arm_for raised
    pb.Directive(version=3, method="eagle3", k_table=[pb.KRange(bs_min=2, bs_max=1, k=1)] * 100_000),
    pb.Directive(version=4, method="eagle3", rule=pb.RequestRule(kind="ngram_span\nspeccontrol: forged")),
    pb.Directive(),  # empty: version 0
]


def _hooks(link: Any, *, max_batch_size: int = 8, sync: bool = False) -> EngineHooks:
    info = engine_info(engine_id="e", model="m", method=Method.EAGLE3, max_k=MAX_K, max_batch_size=max_batch_size,
                       composite=True)  # fmt: skip
    controls = Controls(engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, MAX_K), composite=True,
                        placeholders=not sync)  # fmt: skip
    h = EngineHooks(settings=SETTINGS, controls=controls, link=link, scorer=NgramIndex(max_k=MAX_K),
                    method=Method.EAGLE3)  # fmt: skip
    h.async_composite = not sync
    h.sync_drafter_k = sync
    return h


def _run_steps(link: Any, steps: int = 3) -> list[int]:
    """Synchronous then async scheduling, a few steps each over requests of every class; the K tables
    the engine ran."""
    tables = []
    for sync in (True, False):
        h = _hooks(link, sync=sync)
        sched = (FakeSyncScheduler if sync else FakeAsyncScheduler)(
            [Req(f"r{i}", c) for i, c in enumerate(CLASSES)]
        )
        for _ in range(steps):
            if sync:
                sched.step(h)  # type: ignore[attr-defined]
            else:
                sched.update(h, sched.schedule(h))
            tables.append(list(sched.dynamic_sd_lookup))
        recs = h.link.records if isinstance(h.link, FakeLink) else []
        assert all(0 <= int(k) <= MAX_K for r in recs for k in r.k)
    return [k for t in tables for k in t]


class HostileSidecar(pb_grpc.EngineServiceServicer):
    """Answers the Hello with ``GOOD`` and then every directive of ``HOSTILE``, as fast as it can."""

    def Attach(self, request_iterator: Iterator[pb.EngineMessage], context: Any) -> Iterator[pb.Directive]:
        next(request_iterator)
        yield GOOD
        yield from HOSTILE
        for _ in request_iterator:  # (then reads the reports)
            pass


def test_a_hostile_sidecar_is_refused_and_the_last_good_directive_stays(
    caplog: pytest.LogCaptureFixture, short_tmp_path: Path
) -> None:
    sock = short_tmp_path / "s.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_EngineServiceServicer_to_server(HostileSidecar(), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    hello = pb.Hello(engine_id="e", model="m", max_k=MAX_K, protocol_version=1)
    # A clock that stands still: the TTL never lapses, and every refusal falls in one log interval.
    link = SidecarLink(target=f"unix://{sock}", hello=hello, clock=lambda: 100.0)
    caplog.set_level(logging.WARNING, logger="vllm.speccontrol")
    link.start()
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            s = link.stats()
            if s.directives + s.bad_directives >= 1 + len(HOSTILE):
                break
            time.sleep(0.02)
        s = link.stats()
        assert (s.directives, s.bad_directives) == (1, len(HOSTILE))
        d = link.fresh_directive()
        assert d is not None and (d.version, d.policy) == (1, "good")
        # the engine's step under it: no exception, the good directive's K everywhere
        h = _hooks(link, sync=True)
        sched = FakeSyncScheduler([Req(f"r{i}", c) for i, c in enumerate(CLASSES)])
        for _ in range(3):
            sched.step(h)
        assert sched.dynamic_sd_lookup[1:] == [2] * 8
    finally:
        link.close()
        server.stop(0)
    lines = [r.getMessage() for r in caplog.records if "invalid directive" in r.getMessage()]
    assert len(lines) == 1 and not has_control(lines[0]) and len(lines[0]) < 500, lines


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile())
def test_any_directive_the_intake_takes_runs_in_the_hooks(msg: pb.Directive) -> None:
    core: LinkCore[int] = LinkCore(encode=lambda s, p: pb.StepReport(), queue_steps=4, resend_steps=4)
    try:
        d = core.received(pb.Directive.FromString(msg.SerializeToString()))
    except ValueError:
        return
    assert all(0 <= k <= MAX_K for k in _run_steps(FakeLink(d)))


def _wide_plan(classes: int, buckets: BatchBuckets) -> Directive:
    """A sidecar's plan for ``classes`` classes, each on its own arm in every bucket."""
    plan, table = [], []
    for b in range(len(buckets)):
        lo, hi = buckets.range(b)
        table.append(KRange(lo, hi, 3))
        plan.append(PlanEntry("*", lo, hi, Arm(Method.EAGLE3, 2)))
        plan += [PlanEntry(f"c{j}", lo, hi, Arm(Method.NGRAM if j % 2 else Method.EAGLE3, 1 + (j + b) % 3))
                 for j in range(classes)]  # fmt: skip
    return Directive(1, "p", "", 0, 0, tuple(table), Method.EAGLE3, tuple(plan))


def test_class_arms_are_not_rescanned_per_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's kernels need every known class's arm at the step's batch size; ``Directive.arm_for``
    scans the whole plan per class, and the hooks used to call it for every class at every change of
    the batch size (for 256 classes under the sidecar's plan for them, 19 ms of the step each time).
    Counted in scanned plan entries (no timing): once per stretch of batch sizes, each class reading
    only its own entries and "*"'s, with the same answers as ``arm_for``."""
    classes, buckets = 64, BatchBuckets()
    d = _wide_plan(classes, buckets)
    h = _hooks(FakeLink(d), max_batch_size=128)
    for j in range(classes):
        h.rows.set_class(j % 60, f"c{j}")
    names = h.rows.class_names
    sizes = [*range(1, 101), *range(100, 0, -1)]
    want = {
        bs: [[METHOD_CODES[a.method], min(a.k, MAX_K)] for a in (d.arm_for(c, bs) for c in names)]
        for bs in sizes
    }
    scanned = 0
    covers = PlanEntry.covers

    def counted(self: PlanEntry, batch_size: int) -> bool:
        nonlocal scanned
        scanned += 1
        return covers(self, batch_size)

    monkeypatch.setattr(PlanEntry, "covers", counted)
    got = {bs: h.kernels._arms(d, bs).tolist() for bs in sizes}
    monkeypatch.setattr(PlanEntry, "covers", covers)
    assert got == want
    # stretches (6 buckets) x classes x (a class's entries + "*"'s); the old code scanned about
    # 200 x 65 x 195 entries (each class's own and those before them)
    n = len(names)
    assert scanned <= len(buckets) * n * 2 * len(buckets), scanned


def test_the_k_table_is_not_rescanned_per_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scheduler.dynamic_sd_lookup`` for a new directive: one lookup per stretch of batch sizes
    between its ranges' ends, not per batch size (1,025 scans of the table at max_num_seqs 1,024)."""
    table = (*(KRange(1 + 16 * i, 16 * (i + 1), i % 5) for i in range(63)), KRange(1009, 0, 4))
    d = Directive(1, "p", "", 0, 0, table, Method.EAGLE3)
    covers = KRange.covers
    scanned = 0

    def counted(self: KRange, batch_size: int) -> bool:
        nonlocal scanned
        scanned += 1
        return covers(self, batch_size)

    for placeholders in (False, True):
        info = engine_info(engine_id="e", model="m", method=Method.EAGLE3, max_k=MAX_K, max_batch_size=1024,
                           composite=True)  # fmt: skip
        c = Controls(engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, MAX_K), composite=True,
                     placeholders=placeholders)  # fmt: skip
        scanned = 0
        monkeypatch.setattr(KRange, "covers", counted)
        got = c.k_table(d)
        monkeypatch.setattr(KRange, "covers", covers)
        per = d.width_for_batch if placeholders else d.k_for_batch
        assert got == [MAX_K] + [per(bs, MAX_K) for bs in range(1, 1025)]
        assert scanned <= (2 * len(table) + 1) * len(table), scanned  # the old code: about 33,000


def test_class_arms_match_arm_for_with_a_class_named_like_the_wildcard() -> None:
    """``ClassArms`` gives ``arm_for``'s answers where a class's entries and "*"'s interleave, and for a
    class literally named "*"."""
    plan = (
        PlanEntry("*", 5, 0, Arm(Method.NGRAM, 2)),
        PlanEntry("code", 1, 4, Arm(Method.OFF, 0)),
        PlanEntry("code", 1, 0, Arm(Method.EAGLE3, 1)),
        PlanEntry("*", 1, 0, Arm(Method.EAGLE3, 4)),
    )
    d = Directive(1, "p", "", 0, 0, (KRange(1, 0, 3),), Method.EAGLE3, plan)
    arms = ClassArms(d, MAX_K)
    names = [DEFAULT_CLASS, "code", "*", "other"]
    for bs in range(0, 12):
        assert arms.arms(names, bs).tolist() == [
            [METHOD_CODES[a.method], min(a.k, MAX_K)] for a in (d.arm_for(c, bs) for c in names)
        ]


class EndingSidecar(pb_grpc.EngineServiceServicer):
    """Ends every stream at once with a status whose details forge a log line, colour the terminal and
    run to 6,000 characters (below gRPC's 8 KiB metadata limit, so the engine receives them)."""

    DETAILS = "refused\nWARNING vllm.speccontrol: forged line\x1b[31m " + "y" * 6000

    def Attach(self, request_iterator: Iterator[pb.EngineMessage], context: Any) -> Iterator[pb.Directive]:
        next(request_iterator)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.DETAILS)
        yield GOOD  # (never reached: abort raises)


def test_a_sidecars_status_details_are_logged_in_one_short_line(
    caplog: pytest.LogCaptureFixture, short_tmp_path: Any
) -> None:
    """The link's "sidecar unavailable" line quoted the stream's status details as the sidecar sent
    them: a newline forged a second log line, escape sequences reached the terminal, and the line was
    as long as the details."""
    sock = str(short_tmp_path / "s.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_EngineServiceServicer_to_server(EndingSidecar(), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    hello = pb.Hello(engine_id="e", model="m", max_k=MAX_K, protocol_version=1)
    link = SidecarLink(target=f"unix://{sock}", hello=hello, backoff_s=(0.05, 0.05))
    caplog.set_level(logging.WARNING, logger="vllm.speccontrol")
    link.start()
    try:
        end = time.monotonic() + 30
        while link.stats().disconnects < 1 and time.monotonic() < end:
            time.sleep(0.02)
    finally:
        link.close()
        server.stop(0)
    [line] = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert "INVALID_ARGUMENT: refused" in line, line[:200]
    assert not has_control(line) and len(line) < 500, line[:200]
