"""The fleet link against a real mosquitto and what a hostile or careless peer, or a broken broker,
does to it (tests/controller/test_fleet_hostile.py has the in-memory cases).

What must hold: a retained message the link cannot read costs that message, never the session; a
flood of messages faster than the link handles them is dropped and counted, not queued without
bound; two links with one node id say so, back off, and leave no traceback in the log; a broker that
accepts the TCP connection and never answers delays neither the start past ``wait_synced``'s timeout
nor the stop, and costs no socket per attempt.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from controller import fleet
from controller._mqtt import BrokerSettings, MqttConnection
from controller.fleet import FleetLink, Topics, encode
from tests.integration import test_fleet_mqtt as base
from tests.integration.test_fleet_mqtt import Mosquitto, Node, until

# The real broker's fixtures.
mosquitto_factory = base.mosquitto_factory
mosquitto = base.mosquitto

pytestmark = [pytest.mark.integration, pytest.mark.mqtt]


def broker_of(m: Mosquitto) -> BrokerSettings:
    return BrokerSettings(host="127.0.0.1", port=m.port)


def payload(kind: str, **fields: object) -> bytes:
    return encode(kind, "peer", 1.0, fields, limit=1 << 24)


async def test_a_retained_number_too_long_to_read_costs_the_message_not_the_session(
    mosquitto: Mosquitto,
) -> None:
    # A 4301-digit integer raised a plain ValueError out of json.loads: the session ended, the
    # retained copy came back at the reconnect, and the link never synced or applied a policy again.
    t = Topics("itest")
    async with MqttConnection(settings=broker_of(mosquitto), client_id="careless") as raw:
        long_version = payload("policy", yaml="name: p\n", version=0).replace(
            b'"version":0', b'"version":' + b"9" * 4301
        )
        await raw.publish(t.policy, long_version, retain=True)
    node = Node("a", broker_of(mosquitto))
    await node.link.start()
    try:
        assert await node.link.wait_synced(10)
        await until(
            lambda: (
                node.value("speccontrol_fleet_malformed_messages_total", kind="policy", reason="not_json")
                == 1
            ),
            "counted",
        )
        version = await fleet.publish_fleet_policy(
            broker=broker_of(mosquitto), fleet="itest", yaml="name: q\n", source="t"
        )
        assert version == 1  # the unreadable one numbers as none
        await until(lambda: node.policies == [("name: q\n", 1)], "the next policy")
        assert node.value("speccontrol_fleet_connections_total") == 1
        assert node.value("speccontrol_fleet_connection_errors_total") == 0
    finally:
        await node.link.stop()


async def test_the_used_up_version_cleared_as_the_error_says_numbers_the_fleet_from_1(
    mosquitto: Mosquitto,
) -> None:
    # An empty retained message (the clear FleetVersionsUsedUp advised before policy clear --fleet,
    # and still a way out): before, the sidecars kept 2**53 - 1 and ignored the version 1 published
    # next as stale, for good.
    t = Topics("itest")
    async with MqttConnection(settings=broker_of(mosquitto), client_id="careless") as raw:
        await raw.publish(t.policy, payload("policy", yaml="name: p\n", version=fleet.MAX_COUNT), retain=True)
    node = Node("a", broker_of(mosquitto))
    await node.link.start()
    try:
        assert await node.link.wait_synced(10)
        await until(lambda: node.policies == [("name: p\n", fleet.MAX_COUNT)], "the used-up version")
        with pytest.raises(fleet.FleetVersionsUsedUp, match="policy clear --fleet"):
            await fleet.publish_fleet_policy(broker=broker_of(mosquitto), fleet="itest", yaml="x", source="t")
        async with MqttConnection(settings=broker_of(mosquitto), client_id="operator") as raw:
            await raw.publish(t.policy, b"", retain=True)  # mosquitto_pub -r -n
        version = await fleet.publish_fleet_policy(
            broker=broker_of(mosquitto), fleet="itest", yaml="name: q\n", source="t"
        )
        assert version == 1
        await until(lambda: node.policies[-1] == ("name: q\n", 1), "version 1 applied")
        assert node.value("speccontrol_fleet_stale_policies_total") == 0
    finally:
        await node.link.stop()


async def test_a_flood_the_link_cannot_keep_up_with_is_dropped_and_counted(
    mosquitto: Mosquitto, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Received messages waited in aiomqtt's unbounded queue: a peer publishing faster than the link
    # parsed grew the sidecar by hundreds of MB in seconds. Here the link is held busy (its callback
    # waits) while 48 MiB arrive; its connection keeps at most 4 MiB of them.
    monkeypatch.setattr(fleet, "MAX_QUEUED_BYTES", 4 << 20)
    busy = asyncio.Event()
    release = asyncio.Event()

    async def on_posteriors(model: str, state: object) -> None:
        busy.set()
        await release.wait()

    reg = CollectorRegistry()
    link = FleetLink(
        broker=broker_of(mosquitto), fleet="itest", node_id="flooded", registry=reg, on_posteriors=on_posteriors,
        on_policy=lambda y, v: None,
    )  # fmt: skip
    t = Topics("itest")
    big = payload("posteriors", model="m", state={"n": list(range(100_000))})  # ~600 KB
    await link.start()
    try:
        assert await link.wait_synced(10)
        async with MqttConnection(settings=broker_of(mosquitto), client_id="flooder") as raw:
            await raw.publish(t.posteriors("m"), big)
            await asyncio.wait_for(busy.wait(), 20)
            for _ in range(80):
                await raw.publish(t.posteriors("m"), big)

            def dropped() -> float:
                v = reg.get_sample_value(
                    "speccontrol_fleet_malformed_messages_total", {"kind": "posteriors", "reason": "overflow"}
                )
                return v or 0.0

            await until(lambda: dropped() > 0, "messages dropped")
            release.set()
            version = await fleet.publish_fleet_policy(
                broker=broker_of(mosquitto), fleet="itest", yaml="name: q\n", source="t"
            )
        await until(lambda: link.policy_version == version, "the policy after the flood")
        assert reg.get_sample_value("speccontrol_fleet_connection_errors_total") == 0
    finally:
        release.set()
        await link.stop()


async def test_two_links_with_one_node_id_say_so_and_back_off(
    mosquitto: Mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    # The broker closes the older connection of a client id when a newer one connects: both links
    # reconnected at once, two or three times a second, for ever, and the log never named the cause.
    links = [
        FleetLink(broker=broker_of(mosquitto), fleet="itest", node_id="twin", registry=CollectorRegistry(),
                  backoff_min_s=0.2, backoff_max_s=2.0)
        for _ in range(2)
    ]  # fmt: skip
    caplog.set_level(logging.WARNING, logger="controller.fleet")

    def hints() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if "another client connected as 'twin'" in r.getMessage()
        ]

    for link in links:
        await link.start()
    try:
        await until(lambda: len(hints()) >= 6, "the twins named", timeout=60)
    finally:
        for link in links:
            await link.stop()
    # A connection the broker ended while it connected, subscribed or published: why it ended was
    # never read and asyncio logged "Future exception was never retrieved" with a traceback.
    del links
    gc.collect()
    await asyncio.sleep(0)
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    delays = [float(m.group(1)) for h in hints() if (m := re.search(r"reconnecting in ([0-9.e-]+) s", h))]
    assert len(delays) >= 4 and max(delays) > 0.2, delays  # backing off, not held at the first step


class Silent:
    """A TCP server that accepts and never answers (a wrong port, a hung broker, a load balancer
    with no backend); it notes when a client closes its end."""

    def __init__(self) -> None:
        self.accepted = 0
        self.closed_by_client = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        while await reader.read(65536):
            pass
        self.closed_by_client += 1
        writer.close()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def test_a_broker_that_never_answers_costs_no_socket_per_attempt() -> None:
    # A connect that timed out waiting for CONNACK left paho's socket open and watched: one leaked
    # socket per reconnect attempt, for as long as the broker stayed silent (every 30 s at the
    # longest backoff: the sidecar ran out of file descriptors within hours, its gRPC server too).
    silent = Silent()
    async with silent as port:
        link = FleetLink(broker=BrokerSettings(host="127.0.0.1", port=port, connect_timeout_s=0.2),
                         fleet="itest", node_id="n1", backoff_min_s=0.01, backoff_max_s=0.02)  # fmt: skip
        await link.start()
        try:
            assert not await link.wait_synced(0.1)
            await until(lambda: silent.accepted >= 5, "five attempts")
            await until(lambda: silent.closed_by_client >= 4, "the timed-out attempts closed")
            assert not link.connected
        finally:
            async with asyncio.timeout(10):  # a hang fails here instead of stalling the suite
                await link.stop()
        await until(lambda: silent.closed_by_client == silent.accepted, "every attempt closed")


async def test_a_stop_while_the_broker_has_not_answered_is_prompt_and_leaves_no_connection() -> None:
    # A stop cancelled the connect and left its socket open: a client that later got its CONNACK
    # lived on with the node's client id (and took the id from the node's next process).
    silent = Silent()
    async with silent as port:
        link = FleetLink(broker=BrokerSettings(host="127.0.0.1", port=port, connect_timeout_s=60),
                         fleet="itest", node_id="n1")  # fmt: skip
        await link.start()
        assert not await link.wait_synced(0.5)  # the start does not wait out the connect timeout
        await until(lambda: silent.accepted == 1, "the attempt")
        async with asyncio.timeout(10):
            await link.stop()
        await until(lambda: silent.closed_by_client == 1, "the attempt closed")


async def test_the_broker_killed_mid_flood_and_back_costs_nothing_learned(
    mosquitto_factory: Callable[[str], Mosquitto],
) -> None:
    # SIGKILL while the link publishes: what was not acknowledged is sent again after the restart,
    # the newest per topic, and the link resyncs.
    m = mosquitto_factory("allow_anonymous true\n")
    a, b = Node("a", broker_of(m)), Node("b", broker_of(m))
    for n in (a, b):
        await n.link.start()
    try:
        assert await a.link.wait_synced(10) and await b.link.wait_synced(10)
        for i in range(200):
            a.link.publish_posteriors(f"org/m{i % 5}", {"round": i})
            if i == 100:
                m.kill()
        m.start()
        await until(
            lambda: all(b.posteriors.get(f"org/m{k}") == {"round": 195 + k} for k in range(5)), "newest"
        )
        assert a.link.latest_posteriors("org/m0") is None  # its own, not a peer's
    finally:
        for n in (a, b):
            await n.link.stop()
