"""A deliberate clear of the fleet's policy (``publish_fleet_clear``, what ``controllerctl policy clear
--fleet`` runs) against the in-memory broker of test_fleet.py; the real mosquitto and whole sidecars
are in tests/integration/test_fleet_sidecars.py.

What must hold: the clear is a retained tombstone, numbered one above the version it clears (at the
highest version, that version), which every link applies once (``on_policy_cleared``) and orders like a
policy; no link puts the cleared policy back, neither one disconnected while it was cleared nor one
that finds the broker restarted empty (it puts the tombstone back instead); a restarted link does not
apply the retained tombstone again; the next policy numbers above it (from 1 after a clear of the
highest version) and is applied.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from controller import fleet
from controller.fleet import CLEARED_DIGEST, MalformedPayload, Topics, encode, policy_from
from controller.snapshot import MAX_COUNT
from tests.controller.test_fleet import B, FakeBroker, link, policy_payload, sample, until
from tests.controller.test_fleet import broker as broker  # the fake broker fixture, shared

T = Topics("prod")


class Node:
    """A link and what it applied: ``("policy", version)`` or ``("cleared", version)``."""

    def __init__(self, name: str, **kw: Any) -> None:
        self.applied: list[tuple[str, int]] = []
        self.link, self.registry = link(
            node_id=name,
            on_policy=lambda y, v: self.applied.append(("policy", v)),
            on_policy_cleared=lambda v: self.applied.append(("cleared", v)),
            **kw,
        )


def retained(b: FakeBroker) -> dict[str, Any] | None:
    raw = b.retained.get(T.policy)
    return None if raw is None else dict(json.loads(raw))


async def drained(b: FakeBroker, *nodes: Node) -> None:
    await until(
        lambda: all(s.inbox.empty() for s in b.sessions) and not any(n.link._outbox for n in nodes),
        "messages handled and outboxes flushed",
    )


async def test_a_link_disconnected_during_the_clear_does_not_put_the_policy_back(broker: FakeBroker) -> None:
    # Before the tombstone the only clear was an empty retained message, which a link cannot tell from
    # a broker that lost its retained messages: the link disconnected during the clear put its
    # policy back when it reconnected, and the fleet had the cleared policy again.
    broker.retained[T.policy] = policy_payload(5)
    n = Node("n1")
    await n.link.start()
    await until(lambda: n.applied == [("policy", 5)], "v5 applied")
    await n.link.stop()  # disconnected: its state kept in memory, as through a network cut
    version, found = await fleet.publish_fleet_clear(broker=B, fleet="prod")
    assert (version, found) == (6, fleet.RetainedPolicy("policy", 5))
    await n.link.start()
    try:
        assert await n.link.wait_synced(5)
        await drained(broker, n)
        doc = retained(broker)
        assert doc is not None and doc["cleared"] is True and doc["version"] == 6 and "yaml" not in doc
        assert n.applied == [("policy", 5), ("cleared", 6)]
        assert n.link.policy_version == 6 and n.link.policy is not None and n.link.policy.cleared
        assert [topic for topic, _, _ in broker.published].count(T.policy) == 1  # the clear alone
    finally:
        await n.link.stop()


async def test_a_clear_is_applied_once_and_the_next_policy_numbers_above_it(broker: FakeBroker) -> None:
    broker.retained[T.policy] = policy_payload(5)
    n = Node("n1")
    await n.link.start()
    try:
        assert await n.link.wait_synced(5)
        assert await fleet.publish_fleet_clear(broker=B, fleet="prod") == (
            6,
            fleet.RetainedPolicy("policy", 5),
        )
        await until(lambda: n.applied[-1:] == [("cleared", 6)], "the clear applied")
        assert sample(n.registry, "speccontrol_fleet_policy_version") == 6
        # A second clear is one more tombstone, applied as such; the retained copy is not applied again.
        again = await fleet.publish_fleet_clear(broker=B, fleet="prod")
        assert again == (7, fleet.RetainedPolicy("cleared", 6))
        await until(lambda: n.applied[-1:] == [("cleared", 7)], "the second clear")
        broker.route(T.policy, broker.retained[T.policy], retain=False)  # as a reconnect brings it back
        version = await fleet.publish_fleet_policy(broker=B, fleet="prod", yaml="name: q\n", source="q.yaml")
        assert version == 8
        await until(lambda: n.applied[-1:] == [("policy", 8)], "the next policy applied")
        assert n.applied == [("policy", 5), ("cleared", 6), ("cleared", 7), ("policy", 8)]
        assert sample(n.registry, "speccontrol_fleet_stale_policies_total") == 0
        assert sample(n.registry, "speccontrol_fleet_rejected_policies_total") == 0
    finally:
        await n.link.stop()


async def test_a_clear_older_than_the_policy_applied_is_stale(broker: FakeBroker) -> None:
    broker.retained[T.policy] = policy_payload(8)
    n = Node("n1")
    await n.link.start()
    try:
        await until(lambda: n.applied == [("policy", 8)], "v8 applied")
        broker.route(
            T.policy, encode("policy", "old", 1.0, {"version": 6, "cleared": True}, limit=999), False
        )
        await until(lambda: sample(n.registry, "speccontrol_fleet_stale_policies_total") == 1, "stale")
        assert n.applied == [("policy", 8)] and n.link.policy_version == 8
    finally:
        await n.link.stop()


async def test_a_broker_restarted_empty_after_a_clear_gets_the_tombstone_back(broker: FakeBroker) -> None:
    broker.retained[T.policy] = policy_payload(5)
    n = Node("n1")
    await n.link.start()
    try:
        await until(lambda: n.applied == [("policy", 5)], "v5 applied")
        await fleet.publish_fleet_clear(broker=B, fleet="prod")
        await until(lambda: n.applied[-1:] == [("cleared", 6)], "the clear applied")
        tombstone = broker.retained[T.policy]
        broker.crash(lose_retained=True)  # restarted without persistence
        broker.up = True
        await until(lambda: sample(n.registry, "speccontrol_fleet_connections_total") == 2, "reconnect")
        await until(lambda: T.policy in broker.retained, "republished")
        assert broker.retained[T.policy] == tombstone  # the same document, not the policy it cleared
        assert n.applied == [("policy", 5), ("cleared", 6)]
        assert await fleet.publish_fleet_policy(broker=B, fleet="prod", yaml="name: q\n", source="q") == 7
    finally:
        await n.link.stop()


async def test_a_link_restored_after_a_clear_does_not_apply_it_again(broker: FakeBroker) -> None:
    # A sidecar's snapshot keeps the clear's version and CLEARED_DIGEST: the retained tombstone is
    # what it has, so a local policy set since the clear is not undone at every restart.
    broker.retained[T.policy] = encode("policy", "ctl", 1.0, {"version": 6, "cleared": True}, limit=999)
    n = Node("n1", policy_version=6, policy_digest=CLEARED_DIGEST)
    await n.link.start()
    try:
        assert await n.link.wait_synced(5)
        await drained(broker, n)
        assert n.applied == [] and n.link.policy_version == 6
        assert await fleet.publish_fleet_policy(broker=B, fleet="prod", yaml="name: q\n", source="q") == 7
        await until(lambda: n.applied == [("policy", 7)], "the next policy")
    finally:
        await n.link.stop()


async def test_clearing_the_used_up_version_numbers_the_fleet_from_1(broker: FakeBroker) -> None:
    # FleetVersionsUsedUp points at policy clear --fleet. The tombstone cannot go above 2**53 - 1: it
    # carries that version (a different document under the version a link holds is new to it), and
    # the next policy numbers from 1, which links that applied the clear take as the next.
    broker.retained[T.policy] = policy_payload(MAX_COUNT)
    connected, away, long_away = Node("n1"), Node("n2"), Node("n3")
    for n in (connected, away, long_away):
        await n.link.start()
    for n in (connected, away, long_away):
        await until(lambda n=n: n.applied == [("policy", MAX_COUNT)], "the used-up version")
    await away.link.stop()
    await long_away.link.stop()
    try:
        with pytest.raises(
            fleet.FleetVersionsUsedUp, match=re.escape("policy clear --fleet --fleet-name prod")
        ):
            await fleet.publish_fleet_policy(broker=B, fleet="prod", yaml="x", source="s")
        assert await fleet.publish_fleet_clear(broker=B, fleet="prod") == (
            MAX_COUNT,
            fleet.RetainedPolicy("policy", MAX_COUNT),
        )
        await until(lambda: connected.applied[-1:] == [("cleared", MAX_COUNT)], "the clear applied")
        await away.link.start()
        assert await away.link.wait_synced(5)
        await drained(broker, connected, away)
        assert away.applied == [("policy", MAX_COUNT), ("cleared", MAX_COUNT)]
        doc = retained(broker)
        assert doc is not None and doc["cleared"] is True
        assert await fleet.publish_fleet_policy(broker=B, fleet="prod", yaml="name: q\n", source="q") == 1
        for n in (connected, away):
            await until(lambda n=n: n.applied[-1:] == [("policy", 1)], "version 1 applied")
            assert sample(n.registry, "speccontrol_fleet_stale_policies_total") == 0
        # Away through both the clear and version 1: nothing is numbered above what it holds, so
        # version 1 is not stale to it (it was, for good, before).
        await long_away.link.start()
        await until(lambda: long_away.applied[-1:] == [("policy", 1)], "version 1 applied after all")
        assert sample(long_away.registry, "speccontrol_fleet_stale_policies_total") == 0
        assert connected.link.publish_policy("name: mine\n") == 2  # the numbering goes on from 1
    finally:
        for n in (connected, away, long_away):
            await n.link.stop()


def test_a_tombstone_is_read_as_a_clear_and_nothing_half_one_or_the_other() -> None:
    doc = {"v": 1, "kind": "policy", "node": "ctl", "published_at": 1.0, "version": 3, "cleared": True}
    p = policy_from(doc)
    assert (p.cleared, p.version, p.yaml, p.digest) == (True, 3, "", CLEARED_DIGEST)
    assert not policy_from({**doc, "cleared": False, "yaml": "name: p\n"}).cleared
    for bad, field in (
        ({"cleared": 1}, "cleared: expected bool"),
        ({"yaml": "name: p\n"}, "yaml: a cleared"),
    ):
        with pytest.raises(MalformedPayload, match=field) as e:
            policy_from({**doc, **bad})
        assert e.value.reason == "schema"
    with pytest.raises(MalformedPayload, match="version"):
        policy_from({**doc, "version": 0})
