"""The served sidecar's background tick, driven in-process (no socket is bound, time is a fake clock).

What must hold: the tick lets the event loop run after each engine's decision round, so engines that
decide in the same tick do not hold every stream's reports for the sum of their rounds; a tick in
which no round is due runs straight through; every connected engine is ticked once, an idle one never.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.server import SidecarServer
from controller.sidecar import EngineState
from tests.controller.test_sidecar_unit import Clock, info


async def _tick_events(server: SidecarServer) -> list[str]:
    """What ran, in order, during one ``tick_yielding``: each engine's decision (``decide <id>``, or
    ``round <id>`` when its loop ran a round) and each turn of another task on the loop (``loop``)."""
    events: list[str] = []
    decide = server._decide

    def recording(st: EngineState, now: float) -> None:
        rounds = st.loop.rounds
        decide(st, now)
        events.append(f"{'round' if st.loop.rounds != rounds else 'decide'} {st.info.engine_id}")

    server._decide = recording  # type: ignore[method-assign]

    async def other() -> None:
        while True:
            await asyncio.sleep(0)
            events.append("loop")

    task = asyncio.create_task(other())
    await asyncio.sleep(0)  # the other task is waiting on the loop before the tick starts
    events.clear()
    await server.tick_yielding()
    task.cancel()
    return events


@pytest.fixture
def server(tmp_path: Path) -> SidecarServer:
    clock = Clock()
    sc = SidecarServer(
        config=SidecarConfig(state_dir=str(tmp_path / "state")), registry=CollectorRegistry(), clock=clock
    )
    sc.open()
    return sc


async def test_the_tick_yields_to_the_loop_after_each_decision_round(server: SidecarServer) -> None:
    sessions = [server.attach(info(f"e{i}")) for i in range(6)]
    server.detach(sessions[5])  # not connected: never ticked
    clock = server.clock
    assert isinstance(clock, Clock)
    clock.now += 60.0  # every loop's decision interval has passed
    events = await _tick_events(server)
    decided = [e for e in events if e != "loop"]
    assert decided == [f"round e{i}" for i in range(5)]
    # Between two engines' rounds the other task ran: no stream waits for the whole tick.
    positions = [i for i, e in enumerate(events) if e != "loop"]
    assert all(events[a + 1] == "loop" for a in positions[:-1])
    server.close(snapshot=False)


async def test_a_tick_without_rounds_runs_straight_through(server: SidecarServer) -> None:
    for i in range(4):
        server.attach(info(f"e{i}"))  # each decides on attach: no round is due right after
    events = await _tick_events(server)
    assert events[:4] == [f"decide e{i}" for i in range(4)]
    server.close(snapshot=False)
