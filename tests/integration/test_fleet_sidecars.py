"""Sidecars joined by the fleet link through a real mosquitto on loopback, engines on real gRPC.

A fleet policy published with ``controllerctl policy set --fleet`` reaches every sidecar and its
engines; a sidecar started later takes the retained policy and warm-starts a new engine from the
shared posteriors; the broker is killed and restarted while local control carries on; a policy
cleared with ``controllerctl policy clear --fleet`` stays cleared, also for a sidecar whose broker
connection was cut while it was cleared.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from controller.cli import main as controllerctl
from controller.config import SidecarConfig
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.validation import validate_hello
from policies.context import Context
from policies.loop import ControlLoop
from policies.spec import parse_policy
from tests.integration.test_fleet_mqtt import Mosquitto, _binary
from tests.integration.test_sidecar_grpc import STATIC_EAGLE3_2, TestEngine, hello, step

pytestmark = [pytest.mark.integration, pytest.mark.mqtt]

FLEET = "itest"
#: Only a guard against hangs; nothing asserts on how fast anything happens.
WAIT_S = 30.0

LEARNING = """\
apiVersion: speccontrol/v1
kind: Policy
metadata:
  name: fleet-learn
spec:
  algorithm:
    name: epsilon_greedy
    params:
      epsilon: 0.1
      discount: 0.95
  arms: [eagle3:2, eagle3:3]
  decision_interval_s: 0.05
  directive_ttl_s: 10.0
  min_dwell_s: 0.0
  rule:
    kind: none
"""

STATIC_K4 = """\
apiVersion: speccontrol/v1
kind: Policy
metadata:
  name: fleet-k4
spec:
  algorithm:
    name: static
    params:
      arm: "eagle3:4"
  decision_interval_s: 0.05
  directive_ttl_s: 10.0
  min_dwell_s: 0.0
"""


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    m = Mosquitto(_binary("mosquitto"), tmp_path, "allow_anonymous true\n")
    m.start()
    try:
        yield m
    finally:
        m.kill()


async def until(cond: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def learned(sc: Sidecar) -> bool:
    """Whether the posteriors ``sc`` holds from the fleet give a loop goodput estimates at batch 1."""
    shared = sc.fleet.latest_posteriors("tiny") if sc.fleet is not None else None
    if not shared:
        return False
    loop = ControlLoop(spec=parse_policy(LEARNING), engine=validate_hello(hello("probe")))
    loop.load_state_dict(shared)
    return bool(loop.estimates().get(Context.parse("1/*")))


def sample(sc: Sidecar, name: str, **labels: str) -> float:
    return sc.registry.get_sample_value(name, labels) or 0.0


class Fleet:
    """Sidecars of one fleet, each with its own ports, state dir, registry and node id."""

    def __init__(self, tmp_path: Path, broker_url: str) -> None:
        self.tmp_path, self.broker_url = tmp_path, broker_url
        self.sidecars: list[Sidecar] = []
        self.engines: list[TestEngine] = []

    async def sidecar(self, name: str, broker_url: str = "") -> Sidecar:
        config = SidecarConfig(
            engine_listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            metrics_listen="",
            state_dir=str(self.tmp_path / name),
            decision_tick_s=0.02,
            fleet=FLEET,
            mqtt_url=broker_url or self.broker_url,
            node_id=name,
            posteriors_interval_s=0.2,
        )
        sc = Sidecar(config=config, registry=CollectorRegistry())
        await sc.start()
        self.sidecars.append(sc)
        return sc

    def engine(self, sc: Sidecar, engine_id: str) -> TestEngine:
        eng = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello(engine_id)))
        self.engines.append(eng)
        return eng

    async def close(self) -> None:
        for eng in self.engines:
            await eng.close()
        for sc in self.sidecars:
            await sc.stop()


@pytest.fixture
async def fleet(tmp_path: Path, mosquitto: Mosquitto) -> AsyncIterator[Fleet]:
    f = Fleet(tmp_path, f"mqtt://127.0.0.1:{mosquitto.port}")
    try:
        yield f
    finally:
        await f.close()


async def set_fleet_policy(
    tmp_path: Path, text: str, url: str, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    path = tmp_path / "fleet-policy.yaml"
    path.write_text(text)
    argv = ["--timeout", "10", "policy", "set", str(path), "--fleet", "--broker", url, "--fleet-name", FLEET]
    # controllerctl runs its own event loop, as it does from a shell.
    rc = await asyncio.to_thread(controllerctl, argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return rc, out.out


async def test_fleet_policy_warm_start_and_broker_restart(
    fleet: Fleet, mosquitto: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = await fleet.sidecar("sidecar-a"), await fleet.sidecar("sidecar-b")
    assert a.fleet is not None and b.fleet is not None and a.fleet.connected and b.fleet.connected
    ea, eb = fleet.engine(a, "ea"), fleet.engine(b, "eb")
    first_a, first_b = await ea.directive(), await eb.directive()
    assert first_a.policy == first_b.policy == "default"

    # A fleet policy through the CLI reaches both sidecars and the engines attached to them.
    _, out = await set_fleet_policy(tmp_path, LEARNING, fleet.broker_url, capsys)
    assert "fleet-learn" in out and f"to fleet {FLEET} as version 1" in out
    da = await ea.directive(lambda d: d.policy == "fleet-learn")
    db = await eb.directive(lambda d: d.policy == "fleet-learn")
    assert da.version > first_a.version and db.version > first_b.version
    for sc in (a, b):
        assert sc.fleet_policy_version == 1
        assert sc.policy_store.default.spec.name == "fleet-learn"
        assert sc.policy_store.default.source == "fleet v1"
        assert sample(sc, "speccontrol_fleet_policy_version") == 1

    # Engine ea learns; its sidecar shares the posteriors (eb sends nothing, so b has none to share).
    t, deadline = 1.0, time.monotonic() + WAIT_S
    while not a.engines()["ea"].loop.estimates().get(Context.parse("1/*")):
        assert time.monotonic() < deadline, f"no estimates: {a.engines()['ea'].loop.estimates()}"
        for _ in range(5):
            t += 0.05
            ea.report(step(t=t, accepted=[2], k=2), step(t=t + 0.01, accepted=[3], k=3))
        await asyncio.sleep(0.05)
    await until(lambda: learned(b), "posteriors with estimates at b")
    assert sample(b, "speccontrol_fleet_messages_published_total", kind="posteriors") == 0
    assert sample(a, "speccontrol_fleet_messages_published_total", kind="state") >= 1

    # A third sidecar started later: the retained policy, and an engine that starts warm.
    c = await fleet.sidecar("sidecar-c")
    assert c.fleet_policy_version == 1 and c.policy_store.default.spec.name == "fleet-learn"
    ec = fleet.engine(c, "ec")
    dc = await ec.directive()
    assert dc.policy == "fleet-learn"
    warm = c.engines()["ec"].loop
    assert warm.totals.steps == 0  # no report sent: what it knows came from the fleet
    assert warm.estimates().get(Context.parse("1/*")), warm.estimates()

    # The broker dies: nobody crashes and local control goes on without it.
    mosquitto.kill()
    await until(
        lambda: not any(sc.fleet is not None and sc.fleet.connected for sc in (a, b, c)), "disconnect"
    )
    async with grpc.aio.insecure_channel(a.admin_target) as ch:
        admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
        info = await admin.SetPolicy(pb.SetPolicyRequest(yaml=STATIC_EAGLE3_2, source="local.yaml"))
        assert info.name == "static-eagle3-2"
    d = await ea.directive(lambda d: d.policy == "static-eagle3-2")
    assert [(r.bs_min, r.bs_max, r.k) for r in d.k_table] == [(1, 0, 2)]
    eb2 = fleet.engine(b, "eb2")
    assert (await eb2.directive()).policy == "fleet-learn"
    ea.report(step(t=t + 1.0, accepted=[1], k=2))
    await until(lambda: a.engines()["ea"].loop.totals.steps > 0, "reports while the broker is down")
    assert all(sample(sc, "speccontrol_fleet_connection_errors_total") >= 1 for sc in (a, b, c))

    # The broker is back (empty: no persistence): the links reconnect and restore the retained state.
    mosquitto.start()
    await until(
        lambda: all(sample(sc, "speccontrol_fleet_connections_total") == 2 for sc in (a, b, c)), "reconnect"
    )
    late = await fleet.sidecar("sidecar-d")
    await until(lambda: late.fleet_policy_version == 1, "the retained fleet policy after the restart")
    assert late.policy_store.default.spec.name == "fleet-learn"
    await until(lambda: late.fleet is not None and late.fleet.latest_posteriors("tiny"), "posteriors at d")
    # The local policy set during the outage stays until the fleet sets a newer one.
    assert a.policy_store.default.spec.name == "static-eagle3-2"

    _, out = await set_fleet_policy(tmp_path, STATIC_K4, fleet.broker_url, capsys)
    assert "as version 2" in out
    await until(lambda: all(sc.fleet_policy_version == 2 for sc in (a, b, c, late)), "fleet policy v2")
    for eng in (ea, eb, eb2, ec):
        d = await eng.directive(lambda d: d.policy == "fleet-k4")
        assert [(r.bs_min, r.bs_max, r.k) for r in d.k_table] == [(1, 0, 4)]
    for sc in (a, b, c, late):
        assert sc.policy_store.default.source == "fleet v2"
        assert sample(sc, "speccontrol_fleet_rejected_policies_total") == 0

    # A restart keeps the fleet policy version: the retained copy is not applied a second time.
    await a.stop()
    fleet.sidecars.remove(a)
    saved = a.snapshots.load()
    assert saved is not None and saved["fleet_policy_version"] == 2
    again = await fleet.sidecar("sidecar-a")
    assert again.fleet is not None and await again.fleet.wait_synced(WAIT_S)
    assert again.fleet_policy_version == 2 and again.policy_store.default.source == "fleet v2"
    assert again.policy_store.default.revision == a.policy_store.default.revision


async def test_sidecars_restarted_with_a_broker_that_lost_the_policy_take_the_next_one(
    fleet: Fleet, mosquitto: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Restored from its snapshot, a sidecar has the fleet policy's version, not the payload to put
    # back: with the broker restarted empty too, the next publisher numbered from 1 and the sidecar
    # ignored it as stale below its version, for good.
    a = await fleet.sidecar("sidecar-a")
    await set_fleet_policy(tmp_path, LEARNING, fleet.broker_url, capsys)
    _, out = await set_fleet_policy(tmp_path, STATIC_K4, fleet.broker_url, capsys)
    assert "as version 2" in out
    await until(lambda: a.fleet_policy_version == 2, "fleet policy v2")
    await a.stop()
    fleet.sidecars.remove(a)
    mosquitto.kill()
    mosquitto.start()  # without persistence: the retained policy is gone
    again = await fleet.sidecar("sidecar-a")
    assert again.fleet is not None and await again.fleet.wait_synced(WAIT_S)
    assert again.fleet_policy_version == 2 and again.policy_store.default.spec.name == "fleet-k4"
    _, out = await set_fleet_policy(tmp_path, LEARNING, fleet.broker_url, capsys)
    assert "as version 1" in out
    await until(lambda: again.fleet_policy_version == 1, "the next fleet policy, version 1")
    assert again.policy_store.default.spec.name == "fleet-learn"
    assert sample(again, "speccontrol_fleet_stale_policies_total") == 0


async def test_a_sidecar_keeps_serving_through_what_a_hostile_peer_retained(fleet: Fleet) -> None:
    # A peer with publish rights leaves on the broker: a policy and posteriors holding an integer
    # json cannot read (4301 digits), posteriors for "tiny" of arms and shapes no loop has, NaN
    # literals, and posteriors for models by the hundred. The sidecar starts, its engine gets the
    # local policy at once and starts cold, nothing it learns is touched, and the link stays up (the
    # long integer ended every session, and its retained copy brought that back at each reconnect).
    from controller._mqtt import BrokerSettings, MqttConnection
    from controller.fleet import Topics, encode

    t = Topics(FLEET)
    url = fleet.broker_url.removeprefix("mqtt://")
    host, port = url.split(":")

    def doc(kind: str, **fields: object) -> bytes:
        return encode(kind, "mallory", 1.0, fields, limit=1 << 22)

    bad = {
        t.policy: doc("policy", version=1, yaml="x").replace(b'"version":1', b'"version":' + b"9" * 4301),
        t.posteriors("tiny"): doc(
            "posteriors", model="tiny", state={"policy": "default", "contexts": {"1/*": {"arm": 99}}, "x": 0}
        ).replace(b'"x":0', b'"x":NaN'),
        t.posteriors("other"): doc("posteriors", model="other", state={"x": 0}).replace(
            b'"x":0', b'"x":' + b"7" * 5000
        ),
    }
    for i in range(300):
        bad[t.posteriors(f"m{i}")] = doc("posteriors", model=f"m{i}", state={"n": list(range(2000))})
    async with MqttConnection(settings=BrokerSettings(host=host, port=int(port)), client_id="mallory") as raw:
        for topic, payload in bad.items():
            await raw.publish(topic, payload, retain=True)

    sc = await fleet.sidecar("sidecar-victim")
    assert sc.fleet is not None and await sc.fleet.wait_synced(WAIT_S)
    eng = fleet.engine(sc, "tiny-engine")
    d = await eng.directive()
    assert d.policy == "default" and sc.fleet_policy_version == 0
    assert not any(sc.engines()["tiny-engine"].loop.estimates().values())  # cold: nothing of the peer taken
    eng.report(step(t=1.0, accepted=[1], k=2))
    await until(lambda: sc.engines()["tiny-engine"].loop.totals.steps == 1, "its own report learned")
    assert sample(sc, "speccontrol_fleet_connections_total") == 1
    assert sample(sc, "speccontrol_fleet_connection_errors_total") == 0
    assert sample(sc, "speccontrol_fleet_malformed_messages_total", kind="policy", reason="not_json") == 1
    assert sample(sc, "speccontrol_fleet_malformed_messages_total", kind="posteriors", reason="not_json") == 1
    assert sc.fleet._posteriors_bytes <= sc.fleet.max_posteriors_bytes


class Cuttable:
    """A TCP relay to the broker that can be cut (its connections aborted, new ones refused) and
    restored on the same port: a sidecar behind it loses the broker while the others keep it."""

    def __init__(self, broker_port: int) -> None:
        self.broker_port, self.port = broker_port, 0
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.WriteTransport] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.broker_port)
        except OSError:
            writer.transport.abort()
            return
        self._transports |= {writer.transport, up_writer.transport}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for t in self._transports:
            t.abort()
        self._transports.clear()
        await self._server.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            await self.cut()
            self._server = None


async def clear_fleet_policy(url: str, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    argv = ["--timeout", "10", "policy", "clear", "--fleet", "--broker", url, "--fleet-name", FLEET, "--json"]
    rc = await asyncio.to_thread(controllerctl, argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return dict(json.loads(out.out))


async def test_a_sidecar_cut_off_while_the_fleet_policy_is_cleared_does_not_put_it_back(
    fleet: Fleet, mosquitto: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # With an empty retained message as the clear, the sidecar that was cut off found the topic
    # empty when it came back, took it for a broker restarted without persistence and republished the
    # cleared policy to the whole fleet. The tombstone of policy clear --fleet is found instead.
    relay = Cuttable(mosquitto.port)
    await relay.start()
    try:
        a = await fleet.sidecar("sidecar-a")
        b = await fleet.sidecar("sidecar-b", broker_url=f"mqtt://127.0.0.1:{relay.port}")
        b.set_policy(STATIC_EAGLE3_2, source="local.yaml")  # b's own policy, before the fleet's
        ea, eb = fleet.engine(a, "ea"), fleet.engine(b, "eb")
        await ea.directive(lambda d: d.policy == "default")
        await eb.directive(lambda d: d.policy == "static-eagle3-2")
        await set_fleet_policy(tmp_path, LEARNING, fleet.broker_url, capsys)
        await ea.directive(lambda d: d.policy == "fleet-learn")
        await eb.directive(lambda d: d.policy == "fleet-learn")

        await relay.cut()
        await until(lambda: b.fleet is not None and not b.fleet.connected, "b cut off")
        cleared = await clear_fleet_policy(fleet.broker_url, capsys)
        assert cleared == {
            "fleet": FLEET,
            "broker": fleet.broker_url,
            "version": 2,
            "previous": {"state": "policy", "version": 1},
        }
        await ea.directive(lambda d: d.policy == "default")  # a's own: default_policy
        assert (a.fleet_policy_version, a.policy_store.default.source) == (2, "preset:default")
        assert b.fleet_policy_version == 1 and b.policy_store.default.source == "fleet v1"

        await relay.start()  # b's link reconnects by itself
        await until(lambda: sample(b, "speccontrol_fleet_connections_total") == 2, "b reconnected")
        await until(lambda: b.fleet_policy_version == 2, "b took the clear")
        await eb.directive(lambda d: d.policy == "static-eagle3-2")
        assert b.policy_store.default.source == "local.yaml"
        # Nothing was put back: a sidecar started now finds the clear, and b published no policy.
        c = await fleet.sidecar("sidecar-c")
        assert c.fleet_policy_version == 2 and c.policy_store.default.spec.name == "default"
        assert sample(b, "speccontrol_fleet_messages_published_total", kind="policy") == 0
        assert a.fleet_policy_version == 2 and a.policy_store.default.source == "preset:default"

        # The broker restarted without persistence gets the clear back from the sidecars, not a policy.
        mosquitto.kill()
        mosquitto.start()
        await until(
            lambda: (
                all(sample(sc, "speccontrol_fleet_connections_total") >= 2 for sc in (a, c))
                and sample(b, "speccontrol_fleet_connections_total") >= 3
            ),
            "reconnects after the broker restart",
        )
        d = await fleet.sidecar("sidecar-d")
        await until(lambda: d.fleet_policy_version == 2, "the clear put back on the broker")
        assert d.policy_store.default.spec.name == "default"

        # The next fleet policy numbers above the clear and reaches everyone.
        _, out = await set_fleet_policy(tmp_path, STATIC_K4, fleet.broker_url, capsys)
        assert "as version 3" in out
        await until(lambda: all(sc.fleet_policy_version == 3 for sc in (a, b, c, d)), "fleet policy v3")
        for eng in (ea, eb):
            await eng.directive(lambda d: d.policy == "fleet-k4")
        assert all(sample(sc, "speccontrol_fleet_rejected_policies_total") == 0 for sc in (a, b, c, d))
    finally:
        await relay.close()


async def status(sc: Sidecar, capsys: pytest.CaptureFixture[str], *json_flag: str) -> str:
    """``controllerctl status`` against ``sc`` (in a thread: it runs its own event loop)."""
    rc = await asyncio.to_thread(controllerctl, ["--admin", sc.admin_target, "status", *json_flag])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


async def test_status_says_the_fleet_link_state_and_the_fleet_policy_applied(
    fleet: Fleet, mosquitto: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = fleet.broker_url
    a = await fleet.sidecar("sidecar-a")
    out = await status(a, capsys)
    assert f"fleet: {FLEET} on {url} as sidecar-a, connected; no fleet policy applied\n" in out
    doc = json.loads(await status(a, capsys, "--json"))
    assert doc["fleet"] == {
        "fleet": FLEET, "node_id": "sidecar-a", "broker": url, "connected": True,
        "policy_version": 0, "policy_cleared": False,
    }  # fmt: skip

    await set_fleet_policy(tmp_path, STATIC_K4, url, capsys)
    await until(lambda: a.fleet_policy_version == 1, "fleet policy v1")
    assert "as sidecar-a, connected; fleet policy v1\n" in await status(a, capsys)

    # The broker dies: the link retries, and status says so.
    mosquitto.kill()
    await until(lambda: a.fleet is not None and not a.fleet.connected, "disconnect")
    assert "as sidecar-a, not connected (retrying); fleet policy v1\n" in await status(a, capsys)
    assert json.loads(await status(a, capsys, "--json"))["fleet"]["connected"] is False

    mosquitto.start()
    await until(lambda: a.fleet is not None and a.fleet.connected, "reconnect")
    await clear_fleet_policy(url, capsys)
    await until(lambda: a.fleet_policy_version == 2, "the clear")
    assert "as sidecar-a, connected; fleet policy v2 (the clear)\n" in await status(a, capsys)
    fl = json.loads(await status(a, capsys, "--json"))["fleet"]
    assert fl["policy_version"] == 2 and fl["policy_cleared"] is True


async def test_status_of_a_sidecar_without_a_broker_says_so(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    config = SidecarConfig(
        engine_listen="127.0.0.1:0", admin_listen="127.0.0.1:0", metrics_listen="",
        state_dir=str(fleet.tmp_path / "alone"),
    )  # fmt: skip
    sc = Sidecar(config=config, registry=CollectorRegistry())
    await sc.start()
    try:
        assert "fleet: none (mqtt_url is empty)\n" in await status(sc, capsys)
        assert json.loads(await status(sc, capsys, "--json"))["fleet"] is None
    finally:
        await sc.stop()
