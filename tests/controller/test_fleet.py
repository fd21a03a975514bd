"""FleetLink against an in-memory broker (a fake: the real mosquitto runs in tests/integration)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import Any, Self

import pytest
from prometheus_client import CollectorRegistry

from controller import fleet
from controller._mqtt import BrokerSettings, ConnectionLost, Received
from controller.fleet import FleetLink, MalformedPayload, Topics, decode, encode, policy_from

B = BrokerSettings(host="broker.invalid", port=1883)


class FakeBroker:
    """Retained messages, wildcard subscriptions, and a switch to take it down."""

    def __init__(self) -> None:
        self.up = True
        self.retained: dict[str, bytes] = {}
        self.sessions: list[FakeConnection] = []
        self.published: list[tuple[str, bytes, bool]] = []

    def route(self, topic: str, payload: bytes, retain: bool) -> None:
        self.published.append((topic, payload, retain))
        if retain and payload:
            self.retained[topic] = payload
        elif retain:  # an empty retained message clears the topic (MQTT 3.1.1, 3.3.1.3)
            self.retained.pop(topic, None)
        for s in list(self.sessions):
            if any(_match(f, topic) for f in s.filters):
                s.inbox.put_nowait(Received(topic, payload, False))

    def crash(self, *, lose_retained: bool = False) -> None:
        self.up = False
        if lose_retained:
            self.retained.clear()
        for s in self.sessions:
            s.inbox.put_nowait(None)
        self.sessions.clear()


def _match(pattern: str, topic: str) -> bool:
    p, t = pattern.split("/"), topic.split("/")
    return len(p) == len(t) and all(a in ("+", b) for a, b in zip(p, t, strict=True))


class FakeConnection:
    broker: FakeBroker

    def __init__(
        self, *, settings: BrokerSettings, client_id: str, op_timeout_s: float = 10.0, **limits: Any
    ) -> None:
        self.client_id = client_id
        self.filters: list[str] = []
        self.inbox: asyncio.Queue[Received | None] = asyncio.Queue()

    async def __aenter__(self) -> Self:
        if not self.broker.up:
            raise ConnectionLost("connection refused")
        self.broker.sessions.append(self)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self in self.broker.sessions:
            self.broker.sessions.remove(self)

    async def subscribe(self, topics: Sequence[str], *, qos: int = 1) -> None:
        self.filters.extend(topics)
        for t in topics:
            for topic, payload in self.broker.retained.items():
                if _match(t, topic):
                    self.inbox.put_nowait(Received(topic, payload, True))

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if not self.broker.up or self not in self.broker.sessions:
            raise ConnectionLost("gone")
        self.broker.route(topic, payload, retain)

    async def messages(self) -> AsyncGenerator[Received, None]:
        while True:
            m = await self.inbox.get()
            if m is None:
                raise ConnectionLost("connection lost")
            yield m


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> FakeBroker:
    b = FakeBroker()
    FakeConnection.broker = b
    monkeypatch.setattr(fleet, "MqttConnection", FakeConnection)
    return b


def link(**kw: Any) -> tuple[FleetLink, CollectorRegistry]:
    reg = CollectorRegistry()
    kw.setdefault("fleet", "prod")
    kw.setdefault("backoff_min_s", 0.001)
    kw.setdefault("backoff_max_s", 0.01)
    return FleetLink(broker=B, registry=reg, rng=random.Random(1), **kw), reg


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


async def until(cond: Any, what: str) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def policy_payload(version: int, yaml: str = "name: p\n", node: str = "other") -> bytes:
    return encode("policy", node, 1.0, {"version": version, "yaml": yaml, "source": "t"}, limit=1 << 20)


# -- topics and payloads -------------------------------------------------------------------------


def test_topics_keep_a_model_name_in_one_level() -> None:
    t = Topics("prod")
    assert t.policy == "speccontrol/v1/prod/policy"
    assert t.state("e-1") == "speccontrol/v1/prod/engines/e-1/state"
    topic = t.posteriors("meta-llama/Llama-3.1-8B+x#")
    assert topic == "speccontrol/v1/prod/posteriors/meta-llama%2FLlama-3.1-8B%2Bx%23"
    assert t.parse(topic) == ("posteriors", "meta-llama/Llama-3.1-8B+x#")
    assert t.parse(t.state("a/b")) == ("state", "a/b")
    assert t.parse("speccontrol/v1/other/policy") == ("", "")
    assert t.parse("speccontrol/v1/prod/engines/x/other") == ("", "")


def test_empty_names_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"fleet: must be 1\.\.256"):
        Topics("")
    with pytest.raises(ValueError, match="model: must be"):
        Topics("f").posteriors("")


def test_payload_round_trip_and_envelope() -> None:
    raw = encode("state", "n1", 12.5, {"engine": "e", "state": {"a": 1}}, limit=1000)
    doc = json.loads(raw)
    assert doc == {
        "v": 1,
        "kind": "state",
        "node": "n1",
        "published_at": 12.5,
        "engine": "e",
        "state": {"a": 1},
    }
    assert decode("state", raw, limit=1000) == doc
    with pytest.raises(ValueError, match="over the 10-byte limit"):
        encode("state", "n1", 1.0, {}, limit=10)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"x" * ((1 << 20) + 1), "too_large"),
        (b"{not json", "not_json"),
        (b"\xff\xfe", "not_json"),
        (b"[1, 2]", "schema"),
        (b'{"v": 2, "kind": "policy", "node": "n", "published_at": 1}', "version"),
        (b'{"v": 1, "kind": "state", "node": "n", "published_at": 1}', "schema"),
        (b'{"v": 1, "kind": "policy", "node": 3, "published_at": 1}', "schema"),
        (b'{"v": 1, "kind": "policy", "node": "n", "published_at": true}', "schema"),
        (b'{"v": 1, "kind": "policy", "node": "n", "published_at": NaN}', "schema"),
        # a node name is logged and compared: only what a node_id may be
        (b'{"v": 1, "kind": "policy", "node": "n\\nWARNING forged", "published_at": 1}', "schema"),
        (b'{"v": 1, "kind": "policy", "node": "", "published_at": 1}', "schema"),
        (b'{"v": 1, "kind": "policy", "node": "..", "published_at": 1}', "schema"),
        # nested beyond the parser's recursion limit (under the size limit): a RecursionError ended
        # the session, and the retained message came back at every reconnect
        (b"[" * 100_000, "not_json"),
        (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "not_json"),
        # an integer beyond a double's range: math.isfinite raised OverflowError
        (b'{"v": 1, "kind": "policy", "node": "n", "published_at": 1' + b"0" * 400 + b"}", "schema"),
        (b'{"v": 1, "kind": "policy", "node": "n", "published_at": 1e11000}', "schema"),
    ],
)
def test_decode_names_the_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(MalformedPayload) as e:
        decode("policy", raw, limit=1 << 20)
    assert e.value.reason == reason


@pytest.mark.parametrize("version", [0, -1, 2**53, 2**60, 10**400])
def test_a_fleet_policy_version_a_snapshot_cannot_hold_is_malformed(version: int) -> None:
    # The applied version is saved; beyond 2^53 - 1 the next restart refused the snapshot.
    doc = {"v": 1, "kind": "policy", "node": "n", "published_at": 1.0, "version": version, "yaml": "x"}
    with pytest.raises(MalformedPayload, match=r"version: must be in \[1, 9007199254740991\]") as e:
        policy_from(doc)
    assert e.value.reason == "schema"
    assert policy_from({**doc, "version": 2**53 - 1}).version == 2**53 - 1


def test_broker_settings_validate_and_parse_urls() -> None:
    s = BrokerSettings.from_url("mqtts://ops:p%40ss@mq.example:9883", ca_file="/ca.pem")
    assert (s.host, s.port, s.username, s.password, s.tls, s.ca_file) == (
        "mq.example",
        9883,
        "ops",
        "p@ss",
        True,
        "/ca.pem",
    )
    assert s.describe() == "mqtts://ops@mq.example:9883"  # no password in logs
    assert BrokerSettings.from_url("mqtt://h").port == 1883
    assert BrokerSettings.from_url("mqtts://h").port == 8883
    for url, msg in [
        ("http://h", "expected mqtt://"),
        ("mqtt://h/x", "unexpected path"),
        ("mqtt://h:99999", "invalid port"),
    ]:
        with pytest.raises(ValueError, match=msg):
            BrokerSettings.from_url(url)
    with pytest.raises(ValueError, match="need tls: true"):
        BrokerSettings(ca_file="/ca.pem")
    with pytest.raises(ValueError, match="without a username"):
        BrokerSettings(password="x")
    with pytest.raises(ValueError, match="port: must be"):
        BrokerSettings(port=0)


def test_constructor_has_no_side_effects() -> None:
    # No running loop, an unresolvable broker: constructing must neither connect nor schedule anything.
    lk, reg = link(node_id="n1")
    assert not lk.connected and lk.policy_version == 0
    assert sample(reg, "speccontrol_fleet_connections_total") == 0.0
    with pytest.raises(ValueError, match="backoff"):
        FleetLink(broker=B, fleet="f", backoff_min_s=2, backoff_max_s=1)


# -- the link ------------------------------------------------------------------------------------


async def test_policy_applied_once_stale_ignored_and_echo_not_reapplied(broker: FakeBroker) -> None:
    got: list[tuple[str, int]] = []
    lk, reg = link(node_id="n1", on_policy=lambda y, v: got.append((y, v)))
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        t = Topics("prod")
        broker.route(t.policy, policy_payload(3, "name: three\n"), True)
        await until(lambda: got, "policy v3")
        broker.route(t.policy, policy_payload(2, "name: two\n"), True)  # stale
        broker.route(t.policy, policy_payload(3, "name: three\n"), True)  # duplicate
        await until(lambda: all(s.inbox.empty() for s in broker.sessions), "dispatch")
        await asyncio.sleep(0.005)
        assert sample(reg, "speccontrol_fleet_stale_policies_total") == 1.0
        v = lk.publish_policy("name: mine\n", source="admin")
        assert v == 4
        await until(lambda: any(p[0] == t.policy and b"mine" in p[1] for p in broker.published), "echo")
        broker.route(t.policy, policy_payload(4, "name: other-four\n"), True)  # concurrent publisher
        await until(lambda: len(got) == 2, "equal version, other document")
        assert got == [("name: three\n", 3), ("name: other-four\n", 4)]
        assert lk.policy_version == 4
        assert sample(reg, "speccontrol_fleet_stale_policies_total") == 1.0
        assert sample(reg, "speccontrol_fleet_policy_version") == 4.0
        assert sample(reg, "speccontrol_fleet_messages_received_total", kind="policy") == 2.0
    finally:
        await lk.stop()


async def test_malformed_and_refused_payloads_are_counted_not_fatal(broker: FakeBroker) -> None:
    got: list[int] = []

    def on_policy(yaml: str, version: int) -> None:
        if "bad" in yaml:
            raise ValueError("policy.yaml:1: name: bad")
        got.append(version)

    lk, reg = link(node_id="n1", on_policy=on_policy)
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        t = Topics("prod")
        broker.route(t.policy, b"{garbage", True)
        broker.route(t.posteriors("m"), b'{"v": 1, "kind": "posteriors"}', True)
        broker.route(
            t.posteriors("m"), encode("posteriors", "x", 1.0, {"model": "n", "state": {}}, limit=999), True
        )
        broker.route(t.policy, policy_payload(1, "name: bad\n"), True)
        broker.route(t.policy, policy_payload(2), True)
        await until(lambda: got == [2], "the good policy")
        assert (
            sample(reg, "speccontrol_fleet_malformed_messages_total", kind="policy", reason="not_json") == 1.0
        )
        assert (
            sample(reg, "speccontrol_fleet_malformed_messages_total", kind="posteriors", reason="schema")
            == 2.0
        )
        assert sample(reg, "speccontrol_fleet_rejected_policies_total") == 1.0
        assert lk.connected
    finally:
        await lk.stop()


async def test_posteriors_from_others_only(broker: FakeBroker) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def on_post(model: str, state: Any) -> None:
        seen.append((model, dict(state)))

    t = Topics("prod")
    broker.route(
        t.posteriors("org/m"),
        encode("posteriors", "n0", 1.0, {"model": "org/m", "state": {"a": 1}}, limit=999),
        True,
    )
    lk, reg = link(node_id="n1", on_posteriors=on_post)
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        assert seen == [("org/m", {"a": 1})]  # retained: there before the probe echo
        assert lk.latest_posteriors("org/m") == {"a": 1}
        lk.publish_posteriors("org/m", {"a": 2})
        await until(lambda: json.loads(broker.retained[t.posteriors("org/m")])["node"] == "n1", "published")
        await asyncio.sleep(0.01)
        assert seen == [("org/m", {"a": 1})]  # our own copy is not delivered back
        assert sample(reg, "speccontrol_fleet_messages_published_total", kind="posteriors") == 1.0
    finally:
        await lk.stop()


async def test_state_is_delivered_to_subscribers(broker: FakeBroker) -> None:
    states: list[tuple[str, dict[str, Any]]] = []
    a, _ = link(node_id="a")
    b, reg_b = link(node_id="b", on_state=lambda e, s: states.append((e, dict(s))))
    await a.start()
    await b.start()
    try:
        assert await a.wait_synced(2) and await b.wait_synced(2)
        a.publish_state("eng/0", {"goodput": 10.5})
        await until(lambda: states, "state")
        assert states == [("eng/0", {"goodput": 10.5})]
        assert Topics("prod").state("eng/0") not in broker.retained
        assert sample(reg_b, "speccontrol_fleet_messages_received_total", kind="state") == 1.0
    finally:
        await a.stop()
        await b.stop()


async def test_broker_down_then_back_resyncs_and_republishes(broker: FakeBroker) -> None:
    got: list[int] = []
    broker.up = False
    lk, reg = link(node_id="n1", on_policy=lambda y, v: got.append(v))
    await lk.start()
    try:
        # Down from the start: publishing never blocks or raises; the outbox keeps the latest.
        lk.publish_posteriors("m", {"round": 1})
        lk.publish_posteriors("m", {"round": 2})
        lk.publish_state("e", {"s": 1})
        await until(lambda: (sample(reg, "speccontrol_fleet_connection_errors_total") or 0) >= 3, "retries")
        assert not lk.connected and not await lk.wait_synced(0.01)
        broker.up = True
        broker.route(Topics("prod").policy, policy_payload(5), True)  # nobody listening: retained only
        await until(lambda: got == [5], "resync")
        t = Topics("prod")
        await until(lambda: t.posteriors("m") in broker.retained, "outbox flushed")
        assert json.loads(broker.retained[t.posteriors("m")])["state"] == {"round": 2}
        assert sample(reg, "speccontrol_fleet_connections_total") == 1.0
        # The broker restarts without persistence: the link puts back what it stands behind.
        broker.crash(lose_retained=True)
        await until(lambda: not lk.connected, "disconnect seen")
        broker.up = True
        await until(lambda: sample(reg, "speccontrol_fleet_connections_total") == 2.0, "reconnect")
        await until(lambda: t.policy in broker.retained and t.posteriors("m") in broker.retained, "republish")
        assert json.loads(broker.retained[t.policy])["version"] == 5
        assert json.loads(broker.retained[t.policy])["node"] == "other"
        assert json.loads(broker.retained[t.posteriors("m")])["state"] == {"round": 2}
        assert got == [5]  # the republished copy is not applied a second time
        assert sample(reg, "speccontrol_fleet_connected") == 1.0
    finally:
        await lk.stop()
    assert sample(reg, "speccontrol_fleet_connected") == 0.0


async def test_a_joining_link_does_not_put_back_the_retained_policy_it_was_just_given(
    broker: FakeBroker,
) -> None:
    # The retained policy a link applies as it joins was not marked as on the broker (only topics it
    # already stood behind were): at the end of the resync it republished it, over a newer policy
    # published meanwhile, so replicas started later got the older one and the fleet split.
    t = Topics("prod")
    broker.retained[t.policy] = policy_payload(5)
    got: list[int] = []

    def on_policy(yaml: str, version: int) -> None:
        got.append(version)
        if version == 5:  # the operator publishes v6 while this link is still resyncing
            broker.route(t.policy, policy_payload(6, yaml="name: six\n"), retain=True)

    lk, _ = link(node_id="n1", on_policy=on_policy)
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        await until(lambda: got == [5, 6], "both applied")
        assert json.loads(broker.retained[t.policy])["version"] == 6
        assert [topic for topic, _, _ in broker.published].count(t.policy) == 1  # the operator's only
    finally:
        await lk.stop()


async def test_a_policy_refused_for_a_passing_reason_is_not_applied_until_it_is(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sidecar could not write its state: the policy is not applied, so the link must not say it
    # is (version, gauge), nor stand behind it on a broker that lost it, and must try it again.
    monkeypatch.setattr(fleet, "RETRY_REFUSED_MIN_S", 0.05)
    disk_ok = False
    got: list[int] = []

    def on_policy(yaml: str, version: int) -> None:
        if not disk_ok:
            raise RuntimeError("policy not changed: the state could not be written")
        got.append(version)

    lk, reg = link(node_id="n1", policy_version=2, on_policy=on_policy)
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        t = Topics("prod")
        broker.route(t.policy, policy_payload(3, "name: three\n"), True)
        await until(lambda: sample(reg, "speccontrol_fleet_rejected_policies_total") == 1.0, "refusal")
        assert lk.policy_version == 2 and sample(reg, "speccontrol_fleet_policy_version") == 2.0
        # A broker restarted without persistence: this node must not put back a policy it never applied.
        broker.crash(lose_retained=True)
        broker.up = True
        await until(lambda: sample(reg, "speccontrol_fleet_connections_total") == 2.0, "reconnect")
        assert await lk.wait_synced(2)
        await asyncio.sleep(0.01)
        assert t.policy not in broker.retained
        # Its own next policy numbers above the one it refused (the fleet has seen 3).
        disk_ok = True
        await until(lambda: got == [3], "the retry")
        assert lk.policy_version == 3 and sample(reg, "speccontrol_fleet_policy_version") == 3.0
        assert sample(reg, "speccontrol_fleet_messages_received_total", kind="policy") == 1.0
        await asyncio.sleep(0.2)
        assert got == [3]  # applied once, no more retries
    finally:
        await lk.stop()


async def test_a_newly_refused_policy_is_retried_after_its_own_delay_not_an_earlier_one(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # v3 is refused while the delay is long (as after a grown backoff) and stays pending; v4, newer,
    # is refused once with a short delay: its retry must not wait out the sleep v3's retry began.
    monkeypatch.setattr(fleet, "RETRY_REFUSED_MIN_S", 3600.0)
    refusals = {3: 1, 4: 1}
    applied: list[int] = []

    def on_policy(yaml: str, version: int) -> None:
        if refusals[version]:
            refusals[version] -= 1
            raise RuntimeError("policy not changed: the state could not be written")
        applied.append(version)

    lk, reg = link(node_id="n1", on_policy=on_policy)
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        t = Topics("prod")
        broker.route(t.policy, policy_payload(3, "name: three\n"), True)
        await until(lambda: sample(reg, "speccontrol_fleet_rejected_policies_total") == 1.0, "v3 refused")
        monkeypatch.setattr(fleet, "RETRY_REFUSED_MIN_S", 0.01)
        broker.route(t.policy, policy_payload(4, "name: four\n"), True)
        await until(lambda: applied == [4], "v4 retried and applied")
        assert lk.policy_version == 4
    finally:
        await lk.stop()


async def test_an_invalid_policy_is_refused_for_good_and_numbered_past(broker: FakeBroker) -> None:
    tries: list[int] = []

    def on_policy(yaml: str, version: int) -> None:
        tries.append(version)
        raise ValueError("policy.yaml:1: name: bad")

    lk, reg = link(node_id="n1", on_policy=on_policy)
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        broker.route(Topics("prod").policy, policy_payload(4, "name: bad\n"), True)
        await until(lambda: tries == [4], "refusal")
        assert lk.policy_version == 0 and sample(reg, "speccontrol_fleet_policy_version") == 0.0
        assert lk.publish_policy("name: mine\n") == 5  # above what the fleet has seen
        await asyncio.sleep(0.05)
        assert tries == [4]
    finally:
        await lk.stop()


async def test_an_invalid_retained_policy_is_logged_once_not_at_every_reconnect(
    broker: FakeBroker, caplog: pytest.LogCaptureFixture
) -> None:
    # The broker redelivers its retained policy at every reconnect: one the sidecar refuses for good
    # was logged at ERROR each time (a flapping broker wrote the same line at its pace). Each refusal
    # is still counted, and tried (whether a policy fits can change with the engines attached).
    tries: list[int] = []

    def on_policy(yaml: str, version: int) -> None:
        tries.append(version)
        raise ValueError(f"policy.yaml:1: name: bad ({yaml.strip()})")

    def refusals() -> list[str]:
        return [r.getMessage() for r in caplog.records if "fleet policy v" in r.getMessage()]

    async def reconnect(n: int) -> None:
        broker.crash()  # its retained messages kept
        broker.up = True
        await until(lambda: len(tries) == n, f"redelivery {n}")

    caplog.set_level(logging.INFO, logger="controller.fleet")
    broker.retained[Topics("prod").policy] = policy_payload(4, "name: bad\n")
    lk, reg = link(node_id="n1", on_policy=on_policy)
    await lk.start()
    try:
        await until(lambda: tries == [4], "refusal")
        for n in (2, 3, 4):
            await reconnect(n)
        assert tries == [4] * 4 and sample(reg, "speccontrol_fleet_rejected_policies_total") == 4.0
        assert len(refusals()) == 1, refusals()
        broker.route(Topics("prod").policy, policy_payload(5, "name: worse\n"), True)  # a new version
        await until(lambda: len(tries) == 5, "v5")
        await reconnect(6)
        assert tries == [4, 4, 4, 4, 5, 5]
        assert sample(reg, "speccontrol_fleet_rejected_policies_total") == 6.0
        assert len(refusals()) == 2 and "v5" in refusals()[1], refusals()
    finally:
        await lk.stop()


async def test_restored_version_skips_the_retained_copy(broker: FakeBroker) -> None:
    broker.retained[Topics("prod").policy] = policy_payload(7)
    got: list[int] = []
    lk, reg = link(node_id="n1", policy_version=7, on_policy=lambda y, v: got.append(v))
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        assert got == [] and lk.policy_version == 7
        # The gauge says the version in force, though the retained copy was not applied again (it
        # read 0 after every restart, and the churn alert counted 7 -> 0 -> 8 as changes).
        assert sample(reg, "speccontrol_fleet_policy_version") == 7.0
    finally:
        await lk.stop()


async def test_a_different_policy_under_the_restored_version_is_applied(broker: FakeBroker) -> None:
    # A broker restarted without persistence lost its retained copy, so the next publisher numbered
    # its policy 1 again: a sidecar that applied another v1 before its own restart must take it.
    broker.retained[Topics("prod").policy] = policy_payload(1, yaml="name: new\n")
    got: list[tuple[str, int]] = []
    old = fleet.policy_digest("name: old\n")
    lk, _ = link(node_id="n1", policy_version=1, policy_digest=old, on_policy=lambda y, v: got.append((y, v)))
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        assert got == [("name: new\n", 1)]
    finally:
        await lk.stop()
    # The same document under the same version is the retained copy of what is applied: skipped.
    got.clear()
    same = fleet.policy_digest("name: new\n")
    lk, _ = link(
        node_id="n2", policy_version=1, policy_digest=same, on_policy=lambda y, v: got.append((y, v))
    )
    await lk.start()
    try:
        assert await lk.wait_synced(2)
        assert got == []
    finally:
        await lk.stop()


async def test_publish_fleet_policy_versions_above_the_retained_one(broker: FakeBroker) -> None:
    t = Topics("prod")
    v1 = await fleet.publish_fleet_policy(broker=B, fleet="prod", yaml="name: a\n", source="a.yaml")
    assert v1 == 1
    broker.retained[t.policy] = policy_payload(41)
    v2 = await fleet.publish_fleet_policy(broker=B, fleet="prod", yaml="name: b\n", source="b.yaml")
    assert v2 == 42
    doc = json.loads(broker.retained[t.policy])
    assert (doc["version"], doc["yaml"], doc["source"]) == (42, "name: b\n", "b.yaml")
    broker.up = False
    with pytest.raises(ConnectionLost):
        await fleet.publish_fleet_policy(broker=B, fleet="prod", yaml="x", source="c")


@pytest.mark.parametrize("source", ["a\x1b[31m", "x" * 1025, 7, None, ["a"]])
def test_a_fleet_policy_source_is_text_fit_for_a_log_line(source: object) -> None:
    # The source is logged when the policy is applied; it was any value, made text with str().
    doc = {"version": 1, "yaml": "y", "source": source, "published_at": 1.0, "node": "n"}
    with pytest.raises(MalformedPayload, match="source: a string of at most 1024 characters") as e:
        policy_from(doc)
    assert e.value.reason == "schema"
    assert policy_from({**doc, "source": "ops/rollout-7.yaml"}).source == "ops/rollout-7.yaml"


class _EndDropsACancel(FakeConnection):
    """A connection whose end waits a moment and drops a cancel that arrives meanwhile, as Python
    3.11's ``asyncio.wait_for`` does when the future it waits on (aiomqtt's disconnect) completes as
    the task is cancelled."""

    #: Connections that have reached their end.
    ended = 0

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await super().__aexit__(exc_type, exc, tb)
        _EndDropsACancel.ended += 1
        with contextlib.suppress(asyncio.CancelledError):  # (the future was done: its result is
            await asyncio.sleep(0.2)  # returned, the cancel is gone)


async def test_stop_ends_the_link_when_the_connections_end_drops_the_cancel(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The link ran on as "cancelling", reconnecting for good, and stop() never returned (seen with
    # the real mosquitto and two links of one client id, which the broker keeps disconnecting).
    monkeypatch.setattr(fleet, "MqttConnection", _EndDropsACancel)
    monkeypatch.setattr(_EndDropsACancel, "ended", 0)
    lk, _ = link(node_id="n1")
    await lk.start()
    assert await lk.wait_synced(2)
    broker.crash()  # the session ends: the link is in the connection's end for 0.2 s
    await until(lambda: _EndDropsACancel.ended, "the connection's end")
    run = lk._task
    assert run is not None
    stopping = asyncio.create_task(lk.stop())
    try:
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert stopping in done and run.done(), "stop() did not end the link"
    finally:
        broker.up = False
        run.cancel()  # (without the fix: end it for good, for the next test)
        stopping.cancel()


async def test_stop_in_the_cleanup_of_a_cancelled_task_runs_to_its_end(broker: FakeBroker) -> None:
    # The sidecar stops its fleet link in a finally (controller/serve.py): when the task running it
    # is cancelled, the cancel is pending through that cleanup, and stop() must not raise it there
    # (the sidecar's final snapshot comes after it).
    lk, reg = link(node_id="n1")
    await lk.start()
    assert await lk.wait_synced(2)
    run = lk._task
    finished: list[bool] = []

    async def owner() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await lk.stop()
            finished.append(True)

    t = asyncio.create_task(owner())
    await asyncio.sleep(0)
    t.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await t
    assert finished and run is not None and run.done()
    assert sample(reg, "speccontrol_fleet_connected") == 0.0


async def test_a_cancel_of_stop_itself_reaches_its_caller_and_the_link_still_ends(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet, "MqttConnection", _EndDropsACancel)
    monkeypatch.setattr(_EndDropsACancel, "ended", 0)
    lk, _ = link(node_id="n1")
    await lk.start()
    assert await lk.wait_synced(2)
    broker.crash()  # the link is in the connection's end for 0.2 s
    await until(lambda: _EndDropsACancel.ended, "the connection's end")
    run = lk._task
    assert run is not None
    stopping = asyncio.create_task(lk.stop())
    await asyncio.sleep(0)  # stop() has cancelled the link and waits for it
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    broker.up = False
    done, _ = await asyncio.wait({run}, timeout=5)
    assert run in done
