"""A bounded soak of a real ``controllerctl serve`` process (issue 15).

For ``SPECCONTROL_SOAK_S`` seconds (default 60; ``pytest --soak-seconds N`` sets it too), at once:
steady engines streaming reports, short-lived engines churning through more ids than ``max_engines``,
garbage streams (invalid reports, forged names, raw bytes on the socket) and a ``policy set`` storm.
Every cycle the storm pauses, a fleet policy is published over MQTT (a real mosquitto) and applied,
one last local policy is set and acknowledged, and the sidecar is killed with SIGKILL at once, then
restarted. In one cycle the broker is killed while the storm blows and started again after it: local
control goes on meanwhile, and the next fleet policy gets through once the link is back.

At the end the accounting is exact: for every steady engine, the sidecar's step count equals the
steps the engine made (the sidecar acknowledges only what its snapshot holds, so the engines resend
whatever a kill -9 took).
The active policy is the last one set (the last fleet policy), /metrics holds only engines the
sidecar holds, and no traceback was logged. There are no timing thresholds: only counts and identities are asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from controller._mqtt import BrokerSettings, ConnectionLost
from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import demo_workload
from controller.fleet import publish_fleet_policy
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from tests.integration.test_fleet_mqtt import Mosquitto, mosquitto_factory  # noqa: F401 - a fixture
from tests.integration.test_sidecar_grpc import STATIC_EAGLE3_2, WAIT_S, hello, step, until
from tests.reliability.serve_process import Serve

pytestmark = pytest.mark.integration

STEADY = 3
MAX_ENGINES = 8
FLEET = "soak"
POLICIES = {
    "storm-a": STATIC_EAGLE3_2.replace("name: static-eagle3-2", "name: storm-a"),
    "storm-b": STATIC_EAGLE3_2.replace("name: static-eagle3-2", "name: storm-b"),
}


def soak_seconds(config: pytest.Config) -> float:
    opt = config.getoption("--soak-seconds", default=None)
    return float(opt if opt is not None else os.environ.get("SPECCONTROL_SOAK_S", "60"))


def _garbage_messages(rng: random.Random, n: int) -> pb.EngineMessage:
    """One invalid report batch (each must end its stream with INVALID_ARGUMENT)."""
    s = step(t=1.0, accepted=[1, 1])
    kind = rng.randrange(6)
    batch = pb.StepReportBatch(sequence=1, steps=[s])
    if kind == 0:
        s.duration_s = rng.choice([1e154, 5e-324, float("nan"), float("inf"), -1.0])
    elif kind == 1:
        batch.sequence = (1 << 64) - 1
    elif kind == 2:
        batch.dropped_steps = (1 << 64) - 1
    elif kind == 3:
        s.requests[0].accepted = 9  # beyond drafted
    elif kind == 4:
        s.requests[0].traffic_class = "x\ny"
    else:
        s.queue_length = (1 << 32) - 1
    return pb.EngineMessage(reports=batch)


async def _garbage(target: str, rng: random.Random, n: int, sock: str) -> int:
    """A few hostile streams; returns how many the sidecar refused."""
    refused = 0
    for _ in range(3):
        h = hello(f"garbage-{n % 3}")
        first = pb.EngineMessage(hello=h)
        msgs = [first, _garbage_messages(rng, n)]
        if rng.random() < 0.3:
            h.engine_id = rng.choice(["g\nforged line", "g\x00nul", "x" * 200])
            msgs = [first]
        async with grpc.aio.insecure_channel(target) as ch:
            call = pb_grpc.EngineServiceStub(ch).Attach(iter(msgs))  # type: ignore[no-untyped-call]
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                refused += e.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Raw bytes that are not HTTP/2 at all.
    with contextlib.suppress(OSError):
        _, w = await asyncio.open_unix_connection(sock)
        w.write(rng.randbytes(rng.randrange(1, 4096)))
        await w.drain()
        w.close()
    return refused


class Storm:
    """``SetPolicy`` as fast as the rate limit lets through; remembers the last one acknowledged."""

    def __init__(self) -> None:
        self.admin = ""
        self.last: tuple[str, int] | None = None
        self.acknowledged = 0
        self.limited = 0
        self.running = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.n = 0

    async def set_once(self) -> tuple[str, int]:
        name = "storm-a" if self.n % 2 else "storm-b"
        self.n += 1
        async with grpc.aio.insecure_channel(self.admin) as ch:
            admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            info = await admin.SetPolicy(pb.SetPolicyRequest(yaml=POLICIES[name], source=f"{name}.yaml"))
        self.last = (info.name, info.revision)
        self.acknowledged += 1
        return self.last

    async def set_when_allowed(self) -> tuple[str, int]:
        """One change that gets through: the storm may have emptied the rate limiter's bucket."""
        for _ in range(200):  # 10 s at most; the bucket refills at 20 changes/s
            try:
                return await self.set_once()
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                self.limited += 1
                await asyncio.sleep(0.05)
        raise AssertionError("policy set refused for 10 s after the storm stopped")

    async def run(self) -> None:
        while True:
            await self.running.wait()
            self.idle.clear()
            try:
                await self.set_once()
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                self.limited += 1
            finally:
                self.idle.set()
            await asyncio.sleep(0.02)


async def _fleet_policy(broker: BrokerSettings, admin_target: str, n: int) -> str:
    """Publish fleet policy ``fleet-<n>`` over MQTT until the sidecar runs it; returns its name.

    Published again while it is not applied: after a broker restart (no persistence) the broker holds
    no retained policy, and a sidecar restarted since it applied one has no copy to restore, so the
    publish numbers itself version 1 again, which that sidecar takes for its own retained copy
    (docs/reliability.md, Soak); the next publish reads it as retained and numbers itself 2."""
    name = f"fleet-{n}"
    yaml = STATIC_EAGLE3_2.replace("name: static-eagle3-2", f"name: {name}")
    async with grpc.aio.insecure_channel(admin_target) as ch:
        admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
        for _ in range(30):  # bounded: the sidecar's link backs off up to 30 s after an outage
            with contextlib.suppress(ConnectionLost, OSError, TimeoutError):
                await publish_fleet_policy(
                    broker=broker, fleet=FLEET, yaml=yaml, source=f"{name}.yaml", timeout_s=2.0
                )
            for _ in range(30):
                if (await admin.GetPolicy(pb.GetPolicyRequest())).name == name:
                    return name
                await asyncio.sleep(0.1)
    raise AssertionError(f"fleet policy {name} not applied by the sidecar")


@pytest.fixture
def sock_dir(short_tmp_path: Path) -> Path:
    return short_tmp_path  # (tests/conftest.py: a socket path holds 107 bytes)


async def test_soak(
    tmp_path: Path,
    sock_dir: Path,
    pytestconfig: pytest.Config,
    mosquitto_factory: Callable[[str], Mosquitto],  # noqa: F811 - the fixture
) -> None:
    seconds = soak_seconds(pytestconfig)
    broker_proc = mosquitto_factory("allow_anonymous true\n")
    broker = BrokerSettings(host="127.0.0.1", port=broker_proc.port)
    cycles = max(2, int(seconds // 20))
    outage = cycles // 2  # the cycle during which the broker is down
    cycle_s = seconds / cycles
    state = tmp_path / "state"
    cfg = tmp_path / "sidecar.yaml"
    sock = sock_dir / "engine.sock"
    cfg.write_text(
        f"engine_listen: unix://{sock}\n"
        "admin_listen: 127.0.0.1:0\n"
        "metrics_listen: 127.0.0.1:0\n"
        f"state_dir: {state}\n"
        "decision_tick_s: 0.05\n"
        "snapshot_interval_s: 1.0\n"
        "ack_interval_s: 0.05\n"
        f"max_engines: {MAX_ENGINES}\n"
        "max_policy_changes_per_s: 20\n"
        f"mqtt_url: mqtt://127.0.0.1:{broker_proc.port}\n"
        f"fleet: {FLEET}\n"
    )
    log = tmp_path / "serve.log"
    served = await asyncio.to_thread(Serve, cfg, state, log=log)
    rng = random.Random(0)
    link = LinkSettings(time_scale=1.0, flush_interval_s=0.02, backoff_initial_s=0.02, backoff_max_s=0.2)
    # The steady engines outlast every kill and restart, however slow the machine: the cycles take
    # ``seconds`` of churn plus the restarts, the broker outage and the fleet policies, and an engine
    # that finishes while the sidecar is down ends its link with its workload, so it never comes back
    # (its last reports stay unacknowledged).
    steady_s = seconds * 1.5
    steady = [
        EmbeddedEngine(
            target=served.engine,
            settings=EngineSettings(engine_id=f"steady-{i}"),
            workload=demo_workload(seed=i, duration_s=steady_s),
            link=link,
        )
        for i in range(STEADY)
    ]
    storm = Storm()
    storm.admin = served.admin
    storm_task = asyncio.create_task(storm.run())
    churned = refused = kills = 0
    fleet_applied: list[str] = []
    try:
        for e in steady:
            await e.start()
        for cycle in range(cycles):
            if cycle == outage:
                broker_proc.kill()  # SIGKILL, no persistence: its retained messages are gone too
            storm.running.set()
            end = time.monotonic() + cycle_s
            # Churn and garbage while the storm blows, and only while the steady engines run: once
            # they finish they are idle, and churn would (rightly) evict them to make room.
            while time.monotonic() < end and not any(e.done for e in steady):
                churn = EmbeddedEngine(
                    target=served.engine,
                    settings=EngineSettings(engine_id=f"churn-{churned}"),
                    workload=demo_workload(seed=1000 + churned, duration_s=0.5),
                    link=link,
                )
                churned += 1
                await churn.start()
                refused += await _garbage(served.engine, rng, churned, str(sock))
                await churn.wait()
            storm.running.clear()
            await storm.idle.wait()
            if cycle == outage:
                broker_proc.start()  # the same port
            # Fleet policy changes over MQTT go on (after the outage: once the link is back).
            fleet_applied.append(await _fleet_policy(broker, served.admin, len(fleet_applied) + 1))
            if cycle == cycles - 1:
                break
            # One last acknowledged change, then SIGKILL at once: nothing may be lost.
            last = await storm.set_when_allowed()
            served.kill9()
            kills += 1
            connects = [e.stats.connects for e in steady]
            served = await asyncio.to_thread(Serve, cfg, state, log=log)
            storm.admin = served.admin
            async with grpc.aio.insecure_channel(served.admin) as ch:
                admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
                got = await admin.GetPolicy(pb.GetPolicyRequest())
                assert (got.name, got.revision) == last
            # Steady engines back before any churn can take their place (restored engines are idle).
            await until(lambda c=connects: all(e.stats.connects > n for e, n in zip(steady, c, strict=True)))  # type: ignore[misc]
        for e in steady:
            await asyncio.wait_for(e.wait(), steady_s + WAIT_S * 4)
        async with grpc.aio.insecure_channel(served.admin) as ch:
            admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            engines: dict[str, pb.EngineStatus] = {}
            offset = 0
            while True:
                page = await admin.ListEngines(pb.ListEnginesRequest(offset=offset))
                engines.update({x.engine_id: x for x in page.engines})
                offset = page.next_offset
                if not offset:
                    break
            policy = await admin.GetPolicy(pb.GetPolicyRequest())
        with urllib.request.urlopen(served.metrics, timeout=WAIT_S) as r:
            metrics = r.read().decode()
        rc = served.stop()
    finally:
        storm_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await storm_task
        for e in steady:
            await e.stop()
        served.stop()

    # Exact accounting per steady engine.
    for e in steady:
        eid = e.settings.engine_id
        assert e.stats.dropped_steps == 0 and e.stats.evicted_steps == 0, eid
        assert not e.outstanding, eid
        assert engines[eid].steps == e.totals.steps == e.stats.sent_steps, (eid, engines[eid].steps, e.stats)
    # The active policy is the last one set: the last fleet policy (each cycle applied one).
    assert (
        len(fleet_applied) == cycles
        and policy.name == fleet_applied[-1]
        and policy.source.startswith("fleet v")
    )
    # /metrics holds only engines the sidecar holds, never more than max_engines of them.
    labelled = {
        line.split('engine="')[1].split('"')[0] for line in metrics.splitlines() if 'engine="' in line
    }
    assert labelled <= set(engines) and len(engines) <= MAX_ENGINES
    assert "_created" not in metrics
    out = log.read_text(errors="replace")
    assert "Traceback" not in out and "forged line" not in out.replace("\\nforged line", "")
    assert rc == 0 and kills == cycles - 1 and refused > 0 and churned > MAX_ENGINES
    print(
        f"\nsoak {seconds:.0f} s: {kills} kill -9, {churned} churned engines, {refused} garbage streams refused, "
        f"{storm.acknowledged} policy sets ({storm.limited} rate-limited), {len(fleet_applied)} fleet policies "
        f"(broker down in cycle {outage}); steady steps "
        f"{[e.totals.steps for e in steady]}, batches resent {[e.stats.resent_batches for e in steady]}"
    )
