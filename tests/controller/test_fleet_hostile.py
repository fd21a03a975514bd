"""FleetLink against what a hostile or careless peer on the broker sends (the in-memory broker of
test_fleet.py; the real mosquitto runs in tests/integration/test_fleet_faults.py).

What must hold: no message ends the link's session (a retained one would end every session after
it, at every reconnect); what the link keeps of its peers' messages is bounded in memory; every bad
message is counted, and logged as at most a bounded number of lines with its topic escaped; a
session the broker ends at once (another client with the same node id) backs off instead of
reconnecting several times a second; a policy version past the highest a sidecar takes is refused
before it is published.
"""

from __future__ import annotations

import gc
import json
import logging
import re
import tracemalloc
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import fleet
from controller._mqtt import ConnectionLost, Received
from controller.fleet import MalformedPayload, decode, encode
from controller.snapshot import MAX_COUNT
from tests.controller.test_fleet import (
    FakeBroker,
    FakeConnection,
    link,
    policy_payload,
    sample,
    until,
)
from tests.controller.test_fleet import broker as broker  # the fake broker fixture, shared

LIMIT = 1 << 20
DIGITS = 4301  # one more than Python reads as an int by default (sys.get_int_max_str_digits)


def envelope(kind: str, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "kind": kind, "node": "peer", "published_at": 1.0, **fields}


def with_long_int(doc: dict[str, Any], path: tuple[str, ...], digits: int) -> bytes:
    """``doc`` as JSON with an integer of ``digits`` digits at ``path``."""
    marker = "LONG-INT-HERE"
    d = doc
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = marker
    return json.dumps(doc).replace(f'"{marker}"', "7" * digits).encode()


@pytest.mark.parametrize(
    ("kind", "doc", "path"),
    [
        ("policy", envelope("policy", yaml="name: p\n", source="s"), ("version",)),
        ("policy", envelope("policy", version=2, yaml="name: p\n"), ("published_at",)),
        ("posteriors", envelope("posteriors", model="m"), ("state", "learner", "n")),
        ("state", envelope("state", engine="e"), ("state", "goodput")),
    ],
)
@given(digits=st.integers(DIGITS, 50_000))
@settings(max_examples=10, deadline=None)
def test_an_integer_too_long_to_read_is_malformed(
    kind: str, doc: dict[str, Any], path: tuple[str, ...], digits: int
) -> None:
    raw = with_long_int(json.loads(json.dumps(doc)), path, digits)
    with pytest.raises(MalformedPayload) as e:
        decode(kind, raw, limit=LIMIT)
    assert e.value.reason == "not_json"
    assert "digits" in str(e.value)


async def test_a_retained_integer_too_long_to_read_does_not_end_the_session(broker: FakeBroker) -> None:
    # It ended every session at once, and the retained copy came back at every reconnect: the link
    # never synced and never applied a policy again.
    t = fleet.Topics("prod")
    broker.retained[t.policy] = with_long_int(envelope("policy", yaml="name: p\n"), ("version",), DIGITS)
    broker.retained[t.posteriors("m")] = with_long_int(
        envelope("posteriors", model="m"), ("state", "x"), DIGITS
    )
    applied: list[int] = []
    lk, reg = link(node_id="n1", on_policy=lambda y, v: applied.append(v))
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        broker.route(t.policy, policy_payload(3), retain=True)
        await until(lambda: applied == [3], "the next valid policy")
        assert sample(reg, "speccontrol_fleet_connections_total") == 1
        assert sample(reg, "speccontrol_fleet_connection_errors_total") == 0
        assert (
            sample(reg, "speccontrol_fleet_malformed_messages_total", kind="policy", reason="not_json") == 1
        )
        assert (
            sample(reg, "speccontrol_fleet_malformed_messages_total", kind="posteriors", reason="not_json")
            == 1
        )
    finally:
        await lk.stop()


async def test_a_message_the_link_fails_to_handle_costs_the_message_not_the_session(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever defect a payload finds next, a retained copy must not take the link down for good.
    real = fleet.policy_from

    def policy_from(doc: Any) -> Any:
        if doc.get("yaml") == "boom":
            raise RuntimeError("a defect")
        return real(doc)

    monkeypatch.setattr(fleet, "policy_from", policy_from)
    t = fleet.Topics("prod")
    broker.retained[t.policy] = policy_payload(2, yaml="boom")
    applied: list[int] = []
    lk, reg = link(node_id="n1", on_policy=lambda y, v: applied.append(v))
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        broker.route(t.policy, policy_payload(3), retain=True)
        await until(lambda: applied == [3], "the next valid policy")
        assert sample(reg, "speccontrol_fleet_connection_errors_total") == 0
        assert sample(reg, "speccontrol_fleet_malformed_messages_total", kind="policy", reason="schema") == 1
    finally:
        await lk.stop()


def posteriors_payload(model: str, state: Any, node: str = "peer") -> bytes:
    return encode("posteriors", node, 1.0, {"model": model, "state": state}, limit=LIMIT)


async def test_posteriors_kept_from_peers_are_bounded_in_bytes(broker: FakeBroker) -> None:
    # Every model's newest posteriors were kept, parsed, for ever: a peer sharing (retained) posteriors
    # for model after model grew every sidecar of the fleet without bound.
    lk, _ = link(node_id="n1", max_posteriors_bytes=200_000)
    t = fleet.Topics("prod")
    state = {"learner": {"n": list(range(5000))}}
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        for i in range(100):
            broker.route(t.posteriors(f"m{i}"), posteriors_payload(f"m{i}", state), retain=True)
        await until(lambda: lk.latest_posteriors("m99") is not None, "the newest posteriors")
        assert lk.latest_posteriors("m99") == state
        assert lk.latest_posteriors("m0") is None  # the oldest received, forgotten
        kept = [i for i in range(100) if lk.latest_posteriors(f"m{i}") is not None]
        assert 1 < len(kept) < 20
        assert kept == list(range(100 - len(kept), 100))
    finally:
        await lk.stop()


async def test_posteriors_kept_cost_their_payload_not_their_parsed_objects(broker: FakeBroker) -> None:
    # 1 MiB of '{},' parsed takes ~25 MiB: forty such retained messages took a gigabyte in every sidecar.
    lk, _ = link(node_id="n1")
    t = fleet.Topics("prod")
    state = {"x": [{}] * 60_000}
    payloads = [posteriors_payload(f"m{i}", state) for i in range(8)]
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i, p in enumerate(payloads):
                broker.route(t.posteriors(f"m{i}"), p, retain=True)
            await until(lambda: lk.latest_posteriors("m7") is not None, "the posteriors")
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        total = sum(len(p) for p in payloads)
        assert grown < 3 * total, f"{grown} bytes kept for {total} bytes of payload"
        shared = lk.latest_posteriors("m3")
        assert shared == state
        shared["x"].append("changed")  # type: ignore[index]  # a copy: the next engine gets it intact
        assert lk.latest_posteriors("m3") == state
    finally:
        await lk.stop()


async def test_a_flood_of_bad_messages_is_counted_in_full_and_logged_in_few_lines(
    broker: FakeBroker, caplog: pytest.LogCaptureFixture
) -> None:
    # One warning per message: a peer sending thousands a second wrote thousands of lines a second,
    # and every distinct topic stayed in a set for the rest of the session.
    lk, reg = link(node_id="n1")
    t = fleet.Topics("prod")
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="controller.fleet"):
            for i in range(2000):
                broker.route(t.posteriors(f"m{i}"), b'{"v": 1}', retain=False)
            await until(
                lambda: (
                    sample(
                        reg, "speccontrol_fleet_malformed_messages_total", kind="posteriors", reason="schema"
                    )
                    == 2000
                ),
                "every message counted",
            )
        lines = [r for r in caplog.records if "malformed" in r.getMessage()]
        assert 1 <= len(lines) <= fleet.WARNINGS_BURST + 5
        assert len(lk._seen_topics) == 0  # none of them is a topic this node republishes
    finally:
        await lk.stop()


@pytest.mark.parametrize("evil", ["x\nWARNING forged line", "x\u202eevil", "x\x1b[2J", "x\x00"])
async def test_a_topic_from_the_broker_is_logged_escaped(
    broker: FakeBroker, caplog: pytest.LogCaptureFixture, evil: str
) -> None:
    # mosquitto refuses control characters in topics, other brokers need not (and passes U+202E).
    lk, reg = link(node_id="n1")
    t = fleet.Topics("prod")
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        with caplog.at_level(logging.WARNING, logger="controller.fleet"):
            broker.route(f"{t.prefix}/posteriors/{evil}", b"not json", retain=False)
            await until(
                lambda: (
                    sample(
                        reg,
                        "speccontrol_fleet_malformed_messages_total",
                        kind="posteriors",
                        reason="not_json",
                    )
                    == 1
                ),
                "the message counted",
            )
        (line,) = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert not re.search("[\x00-\x1f\x7f\u202e]", line), line
        assert "posteriors/x" in line
    finally:
        await lk.stop()


async def test_an_engine_named_by_a_state_topic_is_logged_escaped(
    broker: FakeBroker, caplog: pytest.LogCaptureFixture
) -> None:
    # The topic's percent-encoded level is plain ASCII (mosquitto takes it); decoded, it held a line
    # break that went raw into the line saying the engine's state was not used.
    evil = "e\nWARNING forged line"
    t = fleet.Topics("prod")

    def on_state(engine: str, state: Any) -> None:
        raise RuntimeError("the callback failed")

    lk, reg = link(node_id="n1", on_state=on_state)
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        with caplog.at_level(logging.WARNING, logger="controller.fleet"):
            broker.route(t.state(evil), json.dumps(envelope("state", engine=evil, state={})).encode(), False)
            await until(
                lambda: sample(reg, "speccontrol_fleet_callback_errors_total", kind="state") == 1, "the error"
            )
        (line,) = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
        assert "\n" not in line and "e\\nWARNING" in line, line
    finally:
        await lk.stop()


class KickedConnection(FakeConnection):
    """A broker that accepts the connection and closes it at once: what a second client with the same
    client id does to the first, over and over."""

    async def messages(self) -> AsyncGenerator[Received, None]:
        raise ConnectionLost("connection lost: Disconnected during message iteration")
        yield  # pragma: no cover - makes this an async generator


async def test_a_session_ended_at_once_backs_off_and_says_why(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The backoff was reset by every connection, so two sidecars with one node id took turns
    # kicking each other off two or three times a second, for ever, with nothing naming the cause.
    monkeypatch.setattr(fleet, "MqttConnection", KickedConnection)
    lk, reg = link(node_id="n1", backoff_min_s=0.001, backoff_max_s=0.016)
    with caplog.at_level(logging.WARNING, logger="controller.fleet"):
        await lk.start()
        try:
            await until(lambda: (sample(reg, "speccontrol_fleet_connections_total") or 0) >= 8, "8 sessions")
        finally:
            await lk.stop()
    lines = [r.getMessage() for r in caplog.records if "reconnecting in" in r.getMessage()]
    assert len(lines) >= 7
    # (the first short session alone could be a broker killed just then: see the test below)
    assert "another client" not in lines[0]
    assert all("another client connected as 'n1'" in line for line in lines[1:])
    delays = [float(re.search(r"reconnecting in ([0-9.e-]+) s", line).group(1)) for line in lines]  # type: ignore[union-attr]
    # 0.001 s doubling to 0.016 s, times a jitter in [0.5, 1]: the 5th retry on waits at least 0.008 s.
    assert all(d >= 0.008 for d in delays[5:]), delays


async def test_a_broker_killed_soon_after_the_connect_is_not_blamed_on_a_twin(
    broker: FakeBroker, caplog: pytest.LogCaptureFixture
) -> None:
    # The broker killed 2 s after the link connected: its warning asked whether another client used
    # the same node id, which sent the operator looking for a twin that did not exist.
    lk, reg = link(node_id="n1")
    with caplog.at_level(logging.WARNING, logger="controller.fleet"):
        await lk.start()
        try:
            await until(lambda: lk.connected, "connected")
            broker.crash()
            await until(
                lambda: (sample(reg, "speccontrol_fleet_connection_errors_total") or 0) >= 4, "4 errors"
            )
            broker.up = True
            await until(lambda: lk.connected, "reconnected")
        finally:
            await lk.stop()
    lines = [r.getMessage() for r in caplog.records if "reconnecting in" in r.getMessage()]
    assert len(lines) >= 4 and lines[0].startswith("fleet link: connection lost"), lines
    assert not any("another client" in line for line in lines), lines


async def test_a_session_that_lasted_resets_the_backoff(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fleet, "STABLE_SESSION_S", 0.0)  # every session counts as one that lasted
    monkeypatch.setattr(fleet, "MqttConnection", KickedConnection)
    lk, reg = link(node_id="n1", backoff_min_s=0.001, backoff_max_s=1.0)
    with caplog.at_level(logging.WARNING, logger="controller.fleet"):
        await lk.start()
        try:
            await until(lambda: (sample(reg, "speccontrol_fleet_connections_total") or 0) >= 6, "6 sessions")
        finally:
            await lk.stop()
    delays = [
        float(m.group(1))
        for r in caplog.records
        if (m := re.search(r"reconnecting in ([0-9.e-]+) s", r.getMessage())) is not None
    ]
    assert len(delays) >= 5 and max(delays) <= 0.001, delays


@pytest.mark.parametrize("current", [MAX_COUNT - 1, MAX_COUNT])
async def test_no_policy_is_published_past_the_highest_version_a_sidecar_takes(
    broker: FakeBroker, current: int
) -> None:
    # A retained version of 2**53 - 1 (a careless or hostile peer) made the next publisher report
    # version 2**53 as published, which every sidecar then dropped as malformed.
    t = fleet.Topics("prod")
    broker.retained[t.policy] = policy_payload(current)
    if current < MAX_COUNT:
        version = await fleet.publish_fleet_policy(
            broker=fleet.BrokerSettings(), fleet="prod", yaml="a", source="s"
        )
        assert version == MAX_COUNT
        return
    with pytest.raises(ValueError, match=re.escape(f"already {MAX_COUNT}, the highest a sidecar takes")):
        await fleet.publish_fleet_policy(broker=fleet.BrokerSettings(), fleet="prod", yaml="a", source="s")
    assert broker.retained[t.policy] == policy_payload(current)  # nothing published

    lk, _ = link(node_id="n1", on_policy=lambda y, v: None)
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        await until(lambda: lk.policy_version == MAX_COUNT, "the retained policy applied")
        with pytest.raises(ValueError, match="the highest a sidecar takes"):
            lk.publish_policy("name: q\n")
        assert lk.policy_version == MAX_COUNT
    finally:
        await lk.stop()


async def test_clearing_the_used_up_version_lets_the_fleet_number_from_1_again(broker: FakeBroker) -> None:
    # FleetVersionsUsedUp tells the operator to clear the retained policy to number from 1 again; the
    # sidecars, still at 2**53 - 1, then ignored version 1 as stale: the fleet could never change its
    # policy again (and the snapshot kept the version through restarts).
    t = fleet.Topics("prod")
    broker.retained[t.policy] = policy_payload(MAX_COUNT)
    applied: list[tuple[int, str]] = []
    lk, reg = link(node_id="n1", on_policy=lambda y, v: applied.append((v, y)))
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        await until(lambda: applied == [(MAX_COUNT, "name: p\n")], "the retained policy applied")
        broker.route(t.policy, b"", retain=True)  # mosquitto_pub -r -n -t <policy topic>
        version = await fleet.publish_fleet_policy(
            broker=fleet.BrokerSettings(), fleet="prod", yaml="name: q\n", source="s"
        )
        assert version == 1
        await until(lambda: applied[-1] == (1, "name: q\n"), "version 1 applied")
        assert lk.policy_version == 1
        assert sample(reg, "speccontrol_fleet_stale_policies_total") == 0
        # The clear is the operator's, not a malformed message.
        assert (
            sample(reg, "speccontrol_fleet_malformed_messages_total", kind="policy", reason="not_json")
            is None
        )
    finally:
        await lk.stop()


@pytest.mark.parametrize("restarted", [False, True])
@pytest.mark.parametrize(
    "garbage",
    [
        b"not json",
        json.dumps(envelope("policy", yaml="name: p\n")).encode(),  # no version
        json.dumps({**envelope("policy", version=9, yaml="name: p\n"), "v": 2}).encode(),  # newer software
    ],
)
async def test_a_policy_published_over_an_unreadable_retained_one_is_applied(
    broker: FakeBroker, garbage: bytes, restarted: bool
) -> None:
    # A careless peer overwrote the retained policy: the publisher can no longer read the fleet's
    # version, numbers from 0 and reports version 1 as published, which every sidecar holding a fleet
    # policy (here version 7) ignored as stale, for good (the snapshot keeps the version).
    t = fleet.Topics("prod")
    applied: list[int] = []
    if restarted:  # a sidecar restored at version 7 finds the garbage when it joins
        broker.retained[t.policy] = garbage
        digest = fleet.policy_digest("name: p\n")
        lk, reg = link(
            node_id="n1", on_policy=lambda y, v: applied.append(v), policy_version=7, policy_digest=digest
        )
        await lk.start()
    else:
        broker.retained[t.policy] = policy_payload(7)
        lk, reg = link(node_id="n1", on_policy=lambda y, v: applied.append(v))
        await lk.start()
        await until(lambda: applied == [7], "the retained policy applied")
        broker.route(t.policy, garbage, retain=True)
    try:
        assert await lk.wait_synced(5)
        version = await fleet.publish_fleet_policy(
            broker=fleet.BrokerSettings(), fleet="prod", yaml="name: q\n", source="s"
        )
        assert version == 1
        await until(lambda: applied[-1:] == [1], "version 1 applied")
        assert lk.policy_version == 1
        assert sample(reg, "speccontrol_fleet_policy_version") == 1
        assert sample(reg, "speccontrol_fleet_stale_policies_total") == 0
    finally:
        await lk.stop()


async def test_the_policy_in_force_coming_back_after_an_unreadable_one_is_not_applied_again(
    broker: FakeBroker,
) -> None:
    # Garbage published on the policy topic without retain leaves the broker's copy of the policy in
    # force: when that copy comes back (a reconnect), it is what the node has, not a new policy (that
    # would undo a local policy set made since), and the node stands behind it again.
    t = fleet.Topics("prod")
    broker.retained[t.policy] = policy_payload(7)
    applied: list[int] = []
    lk, reg = link(node_id="n1", on_policy=lambda y, v: applied.append(v))
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        await until(lambda: applied == [7], "the retained policy applied")
        broker.route(t.policy, b"not json", retain=False)
        broker.route(t.policy, policy_payload(7), retain=False)  # as a reconnect brings it back
        broker.route(t.policy, policy_payload(3, yaml="name: old\n"), retain=False)
        broker.route(t.policy, policy_payload(8, yaml="name: new\n"), retain=False)
        await until(lambda: applied[-1:] == [8], "the next policy applied")
        assert applied == [7, 8] and lk.policy_version == 8
        assert sample(reg, "speccontrol_fleet_stale_policies_total") == 1  # v3: the numbering is back
    finally:
        await lk.stop()


async def test_a_restarted_link_that_finds_no_policy_on_the_broker_takes_the_next_whatever_its_version(
    broker: FakeBroker,
) -> None:
    # The broker lost its retained policy (restarted without persistence, or cleared) while the
    # sidecars restarted: restored from their snapshots they hold v7 but not the payload, so none
    # puts it back, the next publisher numbers from 1, and every one of them ignored it as stale,
    # for good.
    applied: list[int] = []
    lk, reg = link(
        node_id="n1",
        on_policy=lambda y, v: applied.append(v),
        policy_version=7,
        policy_digest=fleet.policy_digest("name: p\n"),
    )
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        version = await fleet.publish_fleet_policy(
            broker=fleet.BrokerSettings(), fleet="prod", yaml="name: q\n", source="s"
        )
        assert version == 1
        await until(lambda: applied == [1], "version 1 applied")
        assert sample(reg, "speccontrol_fleet_stale_policies_total") == 0
    finally:
        await lk.stop()


async def test_a_restarted_link_that_finds_no_policy_takes_its_own_back_from_a_peer_as_the_same(
    broker: FakeBroker,
) -> None:
    # Another sidecar that kept the payload puts the policy back: the same one, not a new one, and
    # the numbering holds again from it.
    t = fleet.Topics("prod")
    applied: list[int] = []
    lk, reg = link(
        node_id="n1",
        on_policy=lambda y, v: applied.append(v),
        policy_version=7,
        policy_digest=fleet.policy_digest("name: p\n"),
    )
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        broker.route(t.policy, policy_payload(7), retain=True)
        broker.route(t.policy, policy_payload(3, yaml="name: old\n"), retain=False)
        await until(lambda: sample(reg, "speccontrol_fleet_stale_policies_total") == 1, "v3 stale")
        assert applied == [] and lk.policy_version == 7
    finally:
        await lk.stop()


async def test_a_flood_of_unreadable_policies_is_one_line_about_the_numbering(
    broker: FakeBroker, caplog: pytest.LogCaptureFixture
) -> None:
    # Each unreadable policy message takes the numbering away; only the first says so, as the
    # malformed warnings are rate-limited (a peer's flood must not write the log at its pace).
    t = fleet.Topics("prod")
    broker.retained[t.policy] = policy_payload(7)
    applied: list[int] = []
    lk, reg = link(node_id="n1", on_policy=lambda y, v: applied.append(v))
    await lk.start()
    try:
        assert await lk.wait_synced(5)
        await until(lambda: applied == [7], "the retained policy applied")
        with caplog.at_level(logging.INFO, logger="controller.fleet"):
            for _ in range(200):
                broker.route(t.policy, b"not json", retain=False)
            await until(
                lambda: (
                    sample(
                        reg, "speccontrol_fleet_malformed_messages_total", kind="policy", reason="not_json"
                    )
                    == 200
                ),
                "all counted",
            )
        assert len([r for r in caplog.records if "whatever its version" in r.getMessage()]) == 1
    finally:
        await lk.stop()


class StuckInSetup(FakeConnection):
    """A broker that accepts the connection and lets the subscription fail (as aiomqtt's does, after
    its operation timeout, when the connection was taken over meanwhile)."""

    async def subscribe(self, topics: Sequence[str], *, qos: int = 1) -> None:
        raise ConnectionLost("subscribe failed: Operation timed out")


async def test_a_session_never_set_up_does_not_reset_the_backoff_however_long_it_took(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # However long its setup took (aiomqtt waits 10 s for a SUBACK that a connection taken over
    # never gets), a session that never worked is no reason to retry at the shortest backoff.
    monkeypatch.setattr(fleet, "STABLE_SESSION_S", 0.0)
    monkeypatch.setattr(fleet, "MqttConnection", StuckInSetup)
    lk, reg = link(node_id="n1", backoff_min_s=0.001, backoff_max_s=0.016)
    with caplog.at_level(logging.WARNING, logger="controller.fleet"):
        await lk.start()
        try:
            await until(
                lambda: (sample(reg, "speccontrol_fleet_connection_errors_total") or 0) >= 8, "8 tries"
            )
        finally:
            await lk.stop()
    lines = [r.getMessage() for r in caplog.records if "reconnecting in" in r.getMessage()]
    assert len(lines) >= 7 and "another client" not in lines[0]
    assert all("another client connected as 'n1'" in line for line in lines[1:])
    delays = [float(re.search(r"reconnecting in ([0-9.e-]+) s", line).group(1)) for line in lines]  # type: ignore[union-attr]
    assert all(d >= 0.008 for d in delays[5:]), delays
