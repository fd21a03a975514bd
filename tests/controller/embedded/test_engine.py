"""The embedded engine on its link, without a sidecar: every step it makes is sent or counted."""

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.embedded import engine as engine_mod
from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import Phase, Schedule, build_workload
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from sim.costmodel import DEFAULT_PROFILE, load_profile

PROFILE = load_profile(DEFAULT_PROFILE)


@pytest.mark.parametrize("queue_steps", [1, 8, 100_000])
async def test_steps_never_sent_are_counted_as_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, queue_steps: int
) -> None:
    # No sidecar behind the target: the engine plays its schedule on its safe default. The steps a
    # full queue refused were counted, but those still queued when it ended went uncounted (the demo's
    # dropped_steps said 0 of all of them with a queue larger than the run).
    monkeypatch.setattr(engine_mod, "DRAIN_S", 0.0)
    workload = build_workload(Schedule((Phase(0.5, {"chat": 1.0}, 4),)), profile=PROFILE, seed=3)
    engine = EmbeddedEngine(
        target=f"unix:{tmp_path / 'no-sidecar.sock'}",
        settings=EngineSettings(engine_id="alone"),
        workload=workload,
        link=LinkSettings(time_scale=0.0, send_queue_steps=queue_steps),
        profile=PROFILE,
    )
    await engine.run()
    stats = engine.stats
    assert engine.totals.steps > 8
    assert stats.sent_steps == 0 and stats.queued_steps == 0
    assert stats.dropped_steps == engine.totals.steps


async def test_an_engine_stopped_mid_run_counts_what_it_did_not_send(tmp_path: Path) -> None:
    workload = build_workload(Schedule((Phase(30.0, {"chat": 1.0}, 4),)), profile=PROFILE, seed=3)
    engine = EmbeddedEngine(
        target=f"unix:{tmp_path / 'no-sidecar.sock'}",
        settings=EngineSettings(engine_id="alone"),
        workload=workload,
        link=LinkSettings(time_scale=0.001),
        profile=PROFILE,
    )
    await engine.start()
    while engine.totals.steps < 20:
        await asyncio.sleep(0.01)
    await engine.stop()
    assert not engine.done
    assert engine.stats.sent_steps + engine.stats.dropped_steps == engine.totals.steps


@pytest.mark.parametrize("where", ["run", "stop"])
async def test_a_cancel_the_grpc_call_swallows_still_ends_the_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # gRPC aio can take a cancel inside a call and end the call instead of raising it: the link went
    # back to its backoff and retried for good, and the demo, awaiting it, hung (a clean-clone CI run
    # with its sidecar stopped mid-run). Here every attach swallows the cancel, as gRPC did.
    attaching = asyncio.Event()
    swallow = True

    async def attach_swallowing_the_cancel(self: EmbeddedEngine) -> bool:
        attaching.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not swallow:
                raise
        return False

    monkeypatch.setattr(EmbeddedEngine, "_attach_once", attach_swallowing_the_cancel)
    monkeypatch.setattr(engine_mod, "DRAIN_S", 0.0)
    seconds = 0.5 if where == "run" else 30.0
    workload = build_workload(Schedule((Phase(seconds, {"chat": 1.0}, 4),)), profile=PROFILE, seed=3)
    engine = EmbeddedEngine(
        target=f"unix:{tmp_path / 'no-sidecar.sock'}",
        settings=EngineSettings(engine_id="alone"),
        workload=workload,
        link=LinkSettings(time_scale=0.0 if where == "run" else 0.001),
        profile=PROFILE,
    )

    async def play() -> None:
        if where == "run":
            await engine.run()  # the schedule ends; run() cancels its link and awaits it
        else:
            await engine.start()
            await attaching.wait()
            await engine.stop()

    task = asyncio.create_task(play())
    done, _ = await asyncio.wait({task}, timeout=30)  # (a hang's bound: it ends at once or never)
    if not done:
        swallow = False  # (let it end, then fail)
        task.cancel()
        await asyncio.wait({task})
        pytest.fail(f"the engine's {where}() never ended: its link went on after the cancel")
    task.result()
    assert engine.done == (where == "run")
    assert engine.stats.sent_steps + engine.stats.dropped_steps == engine.totals.steps


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("time_scale", float("nan")),
        ("time_scale", float("inf")),
        ("time_scale", -1.0),
        ("flush_interval_s", float("nan")),
        ("ack_wait_s", float("inf")),
        ("await_directive_s", -1.0),
        ("await_directive_s", float("nan")),
        ("backoff_initial_s", 0.0),
        ("backoff_max_s", float("nan")),
        ("backoff_max_s", 0.01),
    ],
)
def test_link_settings_refuse_what_no_link_can_run_on(field: str, value: float) -> None:
    # NaN passed every check (then ran as 0 or slept NaN), an infinite time_scale slept forever
    # before the second step, a 0 backoff retried a refused connection without a pause.
    with pytest.raises(ValueError, match=rf"link settings: .*\b{field}\b"):
        LinkSettings(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("max_batch_size", [0, -3, 1 << 21])
def test_engine_settings_refuse_a_batch_size_no_engine_has(max_batch_size: int) -> None:
    # 0 or less admitted no request: the engine stepped empty batches, 0 tokens, without a word.
    with pytest.raises(ValueError, match=r"engine settings: max_batch_size must be in 1\.\."):
        EngineSettings(engine_id="e", max_batch_size=max_batch_size)


def test_link_and_engine_settings_defaults_and_edges_are_taken() -> None:
    LinkSettings()
    LinkSettings(
        time_scale=0.0, flush_interval_s=0.0, ack_wait_s=0.0, backoff_initial_s=1e-3, backoff_max_s=1e-3
    )
    EngineSettings(engine_id="e", max_batch_size=1)


async def test_a_sidecar_sending_bad_directives_gets_one_log_line(
    short_tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Each refused directive was logged on its own line: a buggy sidecar sending hundreds a second
    # wrote the demo engine's log as fast. As in the vLLM plugin's link: one line per interval,
    # the next one counting those refused meanwhile.
    good = pb.Directive(
        version=1, policy="good", ttl_s=30.0, method="eagle3", k_table=[pb.KRange(bs_min=1, k=2)]
    )
    bad = pb.Directive(version=2, method="warp\ndrive")

    class Hostile(pb_grpc.EngineServiceServicer):
        async def Attach(self, request_iterator: Any, context: Any) -> AsyncIterator[pb.Directive]:
            await request_iterator.__anext__()
            yield good
            for _ in range(300):
                yield bad
            async for _ in request_iterator:  # (then reads the reports)
                pass

    server = grpc.aio.server()
    pb_grpc.add_EngineServiceServicer_to_server(Hostile(), server)  # type: ignore[no-untyped-call]
    target = f"unix:{short_tmp_path / 's.sock'}"
    server.add_insecure_port(target)
    await server.start()
    workload = build_workload(Schedule((Phase(30.0, {"chat": 1.0}, 4),)), profile=PROFILE, seed=3)
    engine = EmbeddedEngine(target=target, settings=EngineSettings(engine_id="e"), workload=workload,
                            link=LinkSettings(time_scale=0.001), profile=PROFILE)  # fmt: skip
    caplog.set_level(logging.WARNING, logger="controller.embedded.engine")
    await engine.start()
    try:
        for _ in range(1000):
            if engine.stats.bad_directives >= 300:
                break
            await asyncio.sleep(0.01)
    finally:
        await engine.stop()
        await server.stop(0)
    assert engine.stats.bad_directives == 300
    lines = [r.getMessage() for r in caplog.records if "bad directive" in r.getMessage()]
    assert len(lines) == 1, len(lines)
