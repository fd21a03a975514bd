"""The fleet link: sidecars of one fleet share the policy, engine state and posteriors over MQTT.

Topics (``<fleet>``, ``<engine>`` and ``<model>`` are percent-encoded into one topic level each, so a
model name like ``meta-llama/Llama-3.1-8B`` stays one level):

- ``speccontrol/v1/<fleet>/policy`` (retained): the fleet's policy, a versioned YAML document, or
  the tombstone ``controllerctl policy clear --fleet`` leaves (``"cleared": true``, no YAML).
- ``speccontrol/v1/<fleet>/engines/<engine>/state``: each engine's state, for fleet views.
- ``speccontrol/v1/<fleet>/posteriors/<model>`` (retained): the latest learned statistics per model, so
  a new replica starts warm.

Payloads are JSON objects ``{"v": 1, "kind": ..., "node": ..., "published_at": ...}`` plus the kind's
fields. Anything malformed, oversized or of another version is logged and counted, never fatal.

The link never blocks the caller: ``publish_*`` put the message in an outbox (the latest per topic
wins) that the link's one background task drains while connected, so a broker that is down or slow
changes nothing for local control. The task reconnects with exponential backoff and jitter; on
return, the broker's retained messages resync the policy and posteriors and the outbox is flushed.

What a peer on the broker sends never costs this node more than bounded memory and one warning
line (at most ``WARNINGS_PER_S`` a second after a burst, the rest counted): received messages wait in
at most ``MAX_QUEUED_BYTES`` (a flood beyond is dropped, counted as ``overflow``), the posteriors kept
for warm starts hold at most ``max_posteriors_bytes`` (kept as the payload's bytes: parsed, 1 MiB of
JSON can take 25 MiB), and a message that cannot be handled is dropped, never the session (it would
come back with every reconnect while retained). Topics from the broker are logged escaped.

A session the broker ends before it was set up or within ``STABLE_SESSION_S`` of that (typically
another client connected with the same client id, i.e. ``node_id``) does not reset the reconnect
backoff, and from the second such session in a row its log line says so: two sidecars sharing a node id
reconnected two or three times a second forever. (One alone is also what a broker killed soon after
the connect does; the connect after it is then refused.)

A fleet policy counts as applied (its version, the gauge, the copy this node republishes) only once
``on_policy`` returned: one it refuses with a ValueError (an invalid document) is refused for good,
tried again only when the broker redelivers it at a reconnect, each refusal counted but one ERROR
line per version; one it refuses otherwise (the sidecar could not write its state) is tried again, with backoff, while it is
the newest the fleet has. A retained policy emptied (an empty retained message) or replaced by one
this node cannot read takes the fleet's numbering with it: publishers number from 1 again, so the
link applies the next policy whatever its version (not ignored as stale below the one that is gone),
unless it is the retained copy of the one in force. So does a broker found without a policy by a
link that has none to put back (its version restored from a snapshot): a broker restarted without
persistence while every sidecar restarted froze the fleet.

A deliberate clear (``publish_fleet_clear``) is a retained tombstone, not an empty topic: an empty
topic also means a broker that lost its retained messages, where each link puts back the policy it
applied, so a link disconnected during an empty-message clear put the cleared policy back. The
tombstone is numbered like a policy, one above the version it clears, and ordered like one: a link
applies it (``on_policy_cleared``; the sidecar's engines go back to its local policy) when it is newer
than what it has, stands behind it as it would behind a policy (a broker restarted empty gets the
tombstone back, never the policy it cleared), and the next policy numbers above it. The numbering is
kept, not lost; only a clear of the highest version (FleetVersionsUsedUp) carries that version
itself and lets the next policy number from 1 (a link holding the highest version takes any policy
that differs, whatever its version: none can be numbered above it). A link of an older version reads the tombstone as an
unreadable policy: it keeps its policy in force and no longer puts it back.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, unquote

from prometheus_client import CollectorRegistry, Counter, Gauge

from controller._mqtt import (
    MAX_QUEUED_BYTES,
    BrokerSettings,
    ConnectionLost,
    MqttConnection,
    Received,
    raise_if_cancelled,
)
from controller.limits import TokenBucket
from controller.policy_store import MAX_SOURCE
from controller.snapshot import MAX_COUNT
from controller.validation import MAX_TIME_S
from controller.wire.names import has_control
from policies.text import escape_text, name_problem

__all__ = [
    "PAYLOAD_VERSION",
    "BrokerSettings",
    "FleetLink",
    "FleetPolicy",
    "FleetVersionsUsedUp",
    "MalformedPayload",
    "RetainedPolicy",
    "Topics",
    "publish_fleet_clear",
    "publish_fleet_policy",
]

log = logging.getLogger(__name__)

PAYLOAD_VERSION: Final = 1
ROOT: Final = "speccontrol/v1"
#: Default limit on an incoming or outgoing payload.
MAX_PAYLOAD_BYTES: Final = 1024 * 1024
#: How long ``publish_fleet_policy`` and the link wait for the broker's retained messages.
SYNC_TIMEOUT_S: Final = 5.0
#: The first and the longest wait before a fleet policy refused for a reason that may pass is retried.
RETRY_REFUSED_MIN_S: Final = 5.0
RETRY_REFUSED_MAX_S: Final = 60.0
#: Default limit on the posteriors kept from other nodes, all models together (payload bytes plus
#: ``_ENTRY_OVERHEAD`` each); the oldest received are forgotten first.
MAX_POSTERIORS_BYTES: Final = 64 * 1024 * 1024
_ENTRY_OVERHEAD: Final = 512
#: A session shorter than this does not reset the reconnect backoff.
STABLE_SESSION_S: Final = 10.0
#: Warnings about what peers sent: a burst of ``WARNINGS_BURST``, then this many a second.
WARNINGS_PER_S: Final = 1.0
WARNINGS_BURST: Final = 20

PolicyCallback = Callable[[str, int], Awaitable[None] | None]
#: Called with the tombstone's version when the fleet's policy is cleared.
ClearCallback = Callable[[int], Awaitable[None] | None]
PosteriorsCallback = Callable[[str, Mapping[str, Any]], Awaitable[None] | None]
StateCallback = Callable[[str, Mapping[str, Any]], Awaitable[None] | None]


class MalformedPayload(ValueError):
    """A payload that cannot be used; ``reason`` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class _Warnings:
    """Warning lines about what peers sent, rate-limited: a flood of bad messages is counted in the
    metrics, not written to the log thousands of times a second. The next line let through says how
    many were left out."""

    def __init__(self) -> None:
        self._bucket = TokenBucket(rate=WARNINGS_PER_S, burst=WARNINGS_BURST, clock=time.monotonic)
        self._left_out = 0

    def warn(self, msg: str, *args: object) -> None:
        if not self._bucket.take():
            self._left_out += 1
            return
        if self._left_out:
            msg, args = msg + " (and %d similar warnings left out)", (*args, self._left_out)
            self._left_out = 0
        log.warning(msg, *args)


def _segment(name: str, what: str) -> str:
    if not name or len(name) > 256:
        raise ValueError(f"{what}: must be 1..256 characters, got {name!r}")
    return quote(name, safe="")


@dataclass(frozen=True, slots=True)
class Topics:
    fleet: str

    def __post_init__(self) -> None:
        _segment(self.fleet, "fleet")

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{_segment(self.fleet, 'fleet')}"

    @property
    def policy(self) -> str:
        return f"{self.prefix}/policy"

    def state(self, engine: str) -> str:
        return f"{self.prefix}/engines/{_segment(engine, 'engine')}/state"

    def posteriors(self, model: str) -> str:
        return f"{self.prefix}/posteriors/{_segment(model, 'model')}"

    @property
    def all_states(self) -> str:
        return f"{self.prefix}/engines/+/state"

    @property
    def all_posteriors(self) -> str:
        return f"{self.prefix}/posteriors/+"

    def probe(self, node: str) -> str:
        return f"{self.prefix}/probe/{_segment(node, 'node')}"

    def parse(self, topic: str) -> tuple[str, str]:
        """(kind, name): ``("policy", "")``, ``("state", engine)``, ``("posteriors", model)``, ``("probe", node)``."""
        head = self.prefix + "/"
        if not topic.startswith(head):
            return "", ""
        rest = topic[len(head) :].split("/")
        if rest == ["policy"]:
            return "policy", ""
        if len(rest) == 3 and rest[0] == "engines" and rest[2] == "state":
            return "state", unquote(rest[1])
        if len(rest) == 2 and rest[0] in ("posteriors", "probe"):
            return rest[0], unquote(rest[1])
        return "", ""


@dataclass(frozen=True, slots=True)
class FleetPolicy:
    """A fleet policy as received, or the tombstone of a clear (``cleared``; ``yaml`` empty)."""

    version: int
    yaml: str
    source: str
    published_at: float
    node: str
    cleared: bool = False

    @property
    def digest(self) -> str:
        return policy_digest(self.yaml)


def policy_digest(yaml_text: str) -> str:
    """SHA-256 (hex) of a fleet policy's YAML: what tells two documents of one version apart."""
    return hashlib.sha256(yaml_text.encode()).hexdigest()


#: The digest a clear is known by (a tombstone's YAML is empty): what a sidecar's snapshot keeps beside
#: the tombstone's version, so that its retained copy is not applied again after a restart. A policy
#: whose YAML is empty shares it, harmlessly: no sidecar applies such a document.
CLEARED_DIGEST: Final = policy_digest("")


def encode(kind: str, node: str, now: float, fields: Mapping[str, Any], *, limit: int) -> bytes:
    doc = {"v": PAYLOAD_VERSION, "kind": kind, "node": node, "published_at": now, **fields}
    raw = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    if len(raw) > limit:
        raise ValueError(f"{kind} payload is {len(raw)} bytes, over the {limit}-byte limit")
    return raw


def decode(kind: str, raw: bytes, *, limit: int) -> dict[str, Any]:
    """The payload's fields after checking the envelope. Raises MalformedPayload."""
    if len(raw) > limit:
        raise MalformedPayload("too_large", f"{len(raw)} bytes, over the {limit}-byte limit")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MalformedPayload("not_json", f"not JSON: {e}") from None
    except RecursionError:  # deep nesting: its exception would end the session, and the retained
        # message would come back at every reconnect
        raise MalformedPayload("not_json", "not JSON this link reads: nested too deeply") from None
    except ValueError as e:  # an integer of more than 4300 digits (``sys.get_int_max_str_digits``):
        # a plain ValueError, which ended the session like deep nesting did
        raise MalformedPayload("not_json", f"not JSON this link reads: {e}") from None
    if not isinstance(doc, dict):
        raise MalformedPayload("schema", f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("v") != PAYLOAD_VERSION:
        raise MalformedPayload("version", f"payload version {doc.get('v')!r}, expected {PAYLOAD_VERSION}")
    if doc.get("kind") != kind:
        raise MalformedPayload("schema", f"kind {doc.get('kind')!r} on a {kind} topic")
    problem = name_problem(_field(doc, "node", str))
    if problem is not None:
        raise MalformedPayload("schema", f"node: {problem}")
    at = _field(doc, "published_at", float)
    if not -MAX_TIME_S <= at <= MAX_TIME_S:  # NaN fails it too; an integer beyond a double's range too
        raise MalformedPayload("schema", f"published_at: not a time in seconds (|t| <= {MAX_TIME_S:g})")
    return doc


def _field(doc: Mapping[str, Any], name: str, typ: type) -> Any:
    v = doc.get(name)
    ok = isinstance(v, int | float) and not isinstance(v, bool) if typ is float else isinstance(v, typ)
    if typ is int and isinstance(v, bool):
        ok = False
    if not ok:
        raise MalformedPayload("schema", f"{name}: expected {typ.__name__}, got {type(v).__name__}")
    return v


def _source(v: Any) -> str:
    """A fleet policy's ``source`` (what the publisher named it): logged when the policy is applied."""
    if not isinstance(v, str) or len(v) > MAX_SOURCE or has_control(v):
        raise MalformedPayload(
            "schema", f"source: a string of at most {MAX_SOURCE} characters, no control characters"
        )
    return v


def policy_from(doc: Mapping[str, Any]) -> FleetPolicy:
    version = _field(doc, "version", int)
    if not 1 <= version <= MAX_COUNT:  # a snapshot keeps the applied version: it must hold it
        raise MalformedPayload("schema", f"version: must be in [1, {MAX_COUNT}], got {version}")
    cleared = doc.get("cleared", False)
    if not isinstance(cleared, bool):
        raise MalformedPayload("schema", f"cleared: expected bool, got {type(cleared).__name__}")
    if cleared:
        if "yaml" in doc:  # one or the other: a document that is both must not be half taken
            raise MalformedPayload("schema", "yaml: a cleared policy (cleared: true) carries none")
        return FleetPolicy(
            version=version,
            yaml="",
            source=_source(doc.get("source", "")),
            published_at=float(doc["published_at"]),
            node=str(doc["node"]),
            cleared=True,
        )
    return FleetPolicy(
        version=version,
        yaml=_field(doc, "yaml", str),
        source=_source(doc.get("source", "")),
        published_at=float(doc["published_at"]),
        node=str(doc["node"]),
    )


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "speccontrol_fleet"
        self.connected = Gauge(f"{p}_connected", "1 while connected to the MQTT broker.", registry=registry)
        self.connections = Counter(
            f"{p}_connections", "Successful connections to the broker.", registry=registry
        )
        self.connection_errors = Counter(
            f"{p}_connection_errors",
            "Connection attempts that failed and connections that were lost.",
            registry=registry,
        )
        self.received = Counter(
            f"{p}_messages_received",
            "Fleet messages received and used, by kind.",
            ["kind"],
            registry=registry,
        )
        self.published = Counter(
            f"{p}_messages_published",
            "Fleet messages handed to the broker, by kind.",
            ["kind"],
            registry=registry,
        )
        self.malformed = Counter(
            f"{p}_malformed_messages",
            "Fleet messages dropped as malformed, by kind and reason.",
            ["kind", "reason"],
            registry=registry,
        )
        self.stale = Counter(
            f"{p}_stale_policies", "Fleet policies ignored as older than the one applied.", registry=registry
        )
        self.rejected = Counter(
            f"{p}_rejected_policies",
            "Fleet policy applications the sidecar refused (invalid, or its state could not be written: "
            "those are retried, and each refused try counts).",
            registry=registry,
        )
        self.callback_errors = Counter(
            f"{p}_callback_errors",
            "Posteriors or state the sidecar failed to use.",
            ["kind"],
            registry=registry,
        )
        self.policy_version = Gauge(
            f"{p}_policy_version", "Version of the last fleet policy received and applied.", registry=registry
        )


class FleetLink:
    """One sidecar's link to its fleet. ``await start()`` / ``await stop()``; nothing happens before."""

    def __init__(
        self,
        *,
        broker: BrokerSettings,
        fleet: str,
        node_id: str | None = None,
        on_policy: PolicyCallback | None = None,
        on_policy_cleared: ClearCallback | None = None,
        on_posteriors: PosteriorsCallback | None = None,
        on_state: StateCallback | None = None,
        policy_version: int = 0,
        policy_digest: str = "",
        registry: CollectorRegistry | None = None,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 30.0,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        max_posteriors_bytes: int = MAX_POSTERIORS_BYTES,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < backoff_min_s <= backoff_max_s:
            raise ValueError(
                f"backoff: need 0 < backoff_min_s <= backoff_max_s, got {backoff_min_s}, {backoff_max_s}"
            )
        if max_posteriors_bytes < 1:
            raise ValueError(f"max_posteriors_bytes: must be >= 1, got {max_posteriors_bytes}")
        if policy_version < 0:
            raise ValueError(f"policy_version: must be >= 0, got {policy_version}")
        self.broker = broker
        self.topics = Topics(fleet)
        self.node_id = node_id or f"speccontrol-{uuid.uuid4().hex[:12]}"
        _segment(self.node_id, "node_id")
        self.on_policy = on_policy
        self.on_policy_cleared = on_policy_cleared
        self.on_posteriors = on_posteriors
        self.on_state = on_state
        self.metrics = FleetMetrics(registry if registry is not None else CollectorRegistry())
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self.max_payload_bytes = max_payload_bytes
        self.max_posteriors_bytes = max_posteriors_bytes
        self.sync_timeout_s = sync_timeout_s
        self.clock = clock
        self.rng = rng or random.Random()
        self._policy: FleetPolicy | None = None
        self._policy_version = policy_version
        # The version in force from the start (restored from a snapshot): the broker's retained copy
        # of it is not applied again, so it would not set the gauge, which then read 0 until the next
        # fleet policy (and the churn alert counted every restart as two changes).
        self.metrics.policy_version.set(policy_version)
        #: The newest version seen, applied or not: what this node's own next policy numbers above.
        self._newest_version = policy_version
        #: A policy refused for a reason that may pass (not a ValueError), retried while it is newest.
        self._refused: FleetPolicy | None = None
        self._retry_s = RETRY_REFUSED_MIN_S
        self._policy_lock: asyncio.Lock | None = None
        #: Set when a newly delivered policy is refused: its retry waits its own (short) delay.
        self._refused_now: asyncio.Event | None = None
        #: (version, digest) of the policy last refused for good and logged: the broker redelivers a
        #: retained policy at every reconnect, and each refusal is counted but said once.
        self._rejected_logged: tuple[int, str] | None = None
        #: Digest of the applied policy when only its version is known (restored from a snapshot).
        self._applied_digest = policy_digest
        #: The fleet's retained policy was found gone or unreadable, its numbering with it (see
        #: ``_numbering_lost``): the next policy is applied whatever its version.
        self._renumbered = False
        #: model -> the payload of the newest posteriors another node shared (checked on receipt),
        #: oldest received first; ``_posteriors_bytes`` is what they cost (see MAX_POSTERIORS_BYTES).
        self._posteriors: dict[str, bytes] = {}
        self._posteriors_bytes = 0
        self._warnings = _Warnings()
        #: topic -> (payload, qos, retain, kind); the latest per topic wins.
        self._outbox: dict[str, tuple[bytes, int, bool, str]] = {}
        #: Retained messages this node stands behind (the policy it applied, the posteriors it shared):
        #: republished after a resync that finds their topic empty (a broker restarted without
        #: persistence), so a replica started later still starts warm.
        self._retained_own: dict[str, tuple[bytes, str]] = {}
        self._seen_topics: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._synced: asyncio.Event | None = None
        self._probe_token = ""
        self._conn: MqttConnection | None = None
        #: When the current session was set up (subscribed, probe sent); None before.
        self._session_up_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    # -- public surface --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def policy_version(self) -> int:
        """The version of the last fleet policy applied (or given at construction)."""
        return self._policy_version

    @property
    def policy(self) -> FleetPolicy | None:
        """The fleet policy applied, or the tombstone of the clear applied (``cleared``)."""
        return self._policy

    def latest_posteriors(self, model: str) -> Mapping[str, Any] | None:
        """The newest posteriors another node shared for ``model`` (e.g. to warm-start a new engine)."""
        raw = self._posteriors.get(model)
        return None if raw is None else dict(json.loads(raw)["state"])  # a copy: checked on receipt

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("the fleet link is already started")
        self._wake, self._synced = asyncio.Event(), asyncio.Event()
        self._policy_lock = asyncio.Lock()
        self._refused_now = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"fleet-link-{self.topics.fleet}")
        self._task.add_done_callback(self._task_done)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            me = asyncio.current_task()
            pending = me.cancelling() if me is not None else 0
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                # The link's own end is expected; a cancel of stop() itself, made while it waited, is
                # the caller's. Counted from before the wait: stop() also runs in the cleanup of a
                # cancelled task (the sidecar's finally), whose cancel is already pending then.
                if me is not None and me.cancelling() > pending:
                    raise
        self.metrics.connected.set(0)

    async def wait_synced(self, timeout: float) -> bool:
        """True once connected and the broker's retained policy and posteriors have been handled."""
        if self._synced is None:
            raise RuntimeError("the fleet link is not started")
        try:
            async with asyncio.timeout(timeout):
                await self._synced.wait()
        except TimeoutError:
            return False
        return True

    def publish_policy(self, yaml_text: str, *, source: str = "") -> int:
        """Queue ``yaml_text`` as the fleet's policy (retained); returns the version it carries.

        The version is one above the newest this node has seen, so it is applied everywhere unless
        another node published concurrently (then the broker's order decides, see ``_on_policy``).
        """
        version = _next_version(
            max(self._policy_version, self._newest_version), self.topics, restart=self._numbering_restarts()
        )
        p = FleetPolicy(version, yaml_text, source, self.clock(), self.node_id)
        self._queue(self.topics.policy, "policy", _policy_fields(p), qos=1, retain=True, at=p.published_at)
        # The caller applied it locally already: the broker's echo must not apply it a second time.
        self._policy, self._policy_version, self._renumbered = p, version, False
        self._newest_version, self._refused = version, None
        self.metrics.policy_version.set(version)
        return version

    def publish_state(self, engine: str, state: Mapping[str, Any]) -> None:
        """Queue an engine's state (not retained; only the latest per engine is kept while offline)."""
        self._queue(self.topics.state(engine), "state", {"engine": engine, "state": dict(state)}, qos=0)

    def publish_posteriors(self, model: str, state: Mapping[str, Any]) -> None:
        """Queue the posteriors for ``model`` (retained: the warm start for the next replica)."""
        self._queue(
            self.topics.posteriors(model),
            "posteriors",
            {"model": model, "state": dict(state)},
            qos=1,
            retain=True,
        )

    # -- outbox ----------------------------------------------------------------------------------

    def _queue(
        self,
        topic: str,
        kind: str,
        fields: Mapping[str, Any],
        *,
        qos: int,
        retain: bool = False,
        at: float | None = None,
    ) -> None:
        now = self.clock() if at is None else at
        payload = encode(kind, self.node_id, now, fields, limit=self.max_payload_bytes)
        self._outbox[topic] = (payload, qos, retain, kind)
        if retain:
            self._retained_own[topic] = (payload, kind)
        if self._wake is not None:
            self._wake.set()

    def _resynced(self) -> None:
        """The broker's retained messages are in: restore those it lost, then report synced."""
        for topic, (payload, kind) in self._retained_own.items():
            if topic not in self._seen_topics and topic not in self._outbox:
                log.info("fleet link: the broker has no %s on %s; republishing ours", kind, topic)
                self._outbox[topic] = (payload, 1, True, kind)
        policy = self.topics.policy
        if self._policy_version and policy not in self._seen_topics and policy not in self._retained_own:
            # A version restored from a snapshot, without the payload to put back: no node may have
            # one, and the next publisher then numbers from 1.
            self._numbering_lost("is not on the broker", withdrawn=False)
        if self._wake is not None:
            self._wake.set()
        if self._synced is not None:
            self._synced.set()

    async def _drain(self, conn: MqttConnection) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                topic = next(iter(self._outbox))
                payload, qos, retain, kind = self._outbox.pop(topic)
                try:
                    await conn.publish(topic, payload, qos=qos, retain=retain)
                except ConnectionLost:
                    # Back in the outbox unless something newer for the topic arrived meanwhile.
                    self._outbox.setdefault(topic, (payload, qos, retain, kind))
                    raise
                self.metrics.published.labels(kind).inc()

    # -- background ------------------------------------------------------------------------------

    async def _run(self) -> None:
        attempt = 0
        #: Sessions in a row that the broker ended soon after the connection was accepted.
        short_sessions = 0
        while True:
            connected_at: float | None = None
            self._session_up_at = None
            why = ""
            try:
                async with MqttConnection(
                    settings=self.broker,
                    client_id=self.node_id,
                    max_queued_bytes=max(MAX_QUEUED_BYTES, 2 * self.max_payload_bytes),
                    on_dropped=self._dropped,
                ) as conn:
                    connected_at = time.monotonic()
                    await self._session(conn)
            except ConnectionLost as e:
                self.metrics.connection_errors.inc()
                why = str(e)
            except Exception:
                self.metrics.connection_errors.inc()
                log.exception("fleet link: unexpected error; reconnecting")
            finally:
                self._conn = None
                self.metrics.connected.set(0)
            raise_if_cancelled()  # a stop() whose cancel the connection's end dropped
            now = time.monotonic()
            # Only a session that worked (subscribed, probe sent) for a while resets the backoff: one
            # ended at once, or stuck in its setup until an operation timed out, must not (see the
            # module's docstring).
            stable = self._session_up_at is not None and now - self._session_up_at >= STABLE_SESSION_S
            if stable:
                attempt = 0
            # (a broker killed or restarted soon after a connect also ends one session early, but the
            # next connect is refused or lasts: only a second short session in a row names the twin)
            short_sessions = short_sessions + 1 if connected_at is not None and not stable else 0
            delay = min(self.backoff_max_s, self.backoff_min_s * 2**attempt) * self.rng.uniform(0.5, 1.0)
            attempt = min(attempt + 1, 30)
            if why:
                hint = ""
                if short_sessions >= 2 and connected_at is not None:
                    hint = (
                        f" {now - connected_at:.1f} s after connecting (is another client connected as"
                        f" {self.node_id!r}? node_id must be unique in the fleet)"
                    )
                log.warning("fleet link: %s%s; reconnecting in %.3g s", why, hint, delay)
            await asyncio.sleep(delay)

    async def _session(self, conn: MqttConnection) -> None:
        assert self._wake is not None and self._synced is not None
        t = self.topics
        self._probe_token = uuid.uuid4().hex
        self._seen_topics.clear()
        await conn.subscribe([t.policy, t.all_posteriors, t.probe(self.node_id)])
        if self.on_state is not None:
            await conn.subscribe([t.all_states], qos=0)
        self._conn = conn
        self.metrics.connections.inc()
        self.metrics.connected.set(1)
        log.info(
            "fleet link: connected to %s as %s (fleet %s)", self.broker.describe(), self.node_id, t.fleet
        )
        # Retained messages arrive before anything published after the subscription, so the probe's
        # echo marks the end of the resync.
        await conn.publish(t.probe(self.node_id), self._probe_token.encode(), qos=1)
        self._session_up_at = time.monotonic()
        self._wake.set()
        tasks = [
            asyncio.create_task(self._read(conn), name="fleet-read"),
            asyncio.create_task(self._drain(conn), name="fleet-drain"),
            asyncio.create_task(self._retry_refused(), name="fleet-retry-refused"),
        ]
        deadline = asyncio.create_task(self._sync_deadline(), name="fleet-sync-deadline")
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raises ConnectionLost
        finally:
            for task in (*tasks, deadline):
                task.cancel()
            await asyncio.gather(*tasks, deadline, return_exceptions=True)

    async def _read(self, conn: MqttConnection) -> None:
        async for msg in conn.messages():
            await self._dispatch(msg)

    async def _retry_refused(self) -> None:
        # While connected (a reconnect redelivers the retained policy, which tries it again anyway).
        assert self._refused_now is not None
        while True:
            self._refused_now.clear()
            try:
                async with asyncio.timeout(self._retry_s):  # (not wait_for: 3.11's can eat a cancel)
                    await self._refused_now.wait()
                continue  # a new policy refused meanwhile: its delay starts now, not the old one's
            except TimeoutError:
                pass
            p = self._refused
            if p is not None:
                self._retry_s = min(RETRY_REFUSED_MAX_S, 2 * self._retry_s)
                log.info("fleet link: trying fleet policy v%d again", p.version)
                await self._on_policy(p)

    async def _sync_deadline(self) -> None:
        # A broker whose ACLs drop the probe must not keep the link "unsynced" forever.
        assert self._synced is not None
        await asyncio.sleep(self.sync_timeout_s)
        if not self._synced.is_set():
            log.warning(
                "fleet link: no probe echo after %.1f s; treating retained state as synced",
                self.sync_timeout_s,
            )
            self._synced.set()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("fleet link task died", exc_info=task.exception())

    # -- incoming --------------------------------------------------------------------------------

    def _dropped(self, topic: str, size: int) -> None:
        """A received message the connection's queue had no room for (MqttConnection's on_dropped)."""
        kind = self.topics.parse(topic)[0] or "other"
        reason = "too_large" if size > self.max_payload_bytes else "overflow"
        self.metrics.malformed.labels(kind, reason).inc()
        self._warnings.warn(
            "fleet link: dropped a %s message of %d bytes on %s: %s",
            kind,
            size,
            escape_text(topic),
            "over the payload limit"
            if reason == "too_large"
            else "messages arrive faster than they are handled",
        )

    async def _dispatch(self, msg: Received) -> None:
        kind, name = self.topics.parse(msg.topic)
        if kind == "probe":
            if msg.payload.decode(errors="replace") == self._probe_token:
                self._resynced()
            return
        if not kind:
            return
        # Any message counts as "the broker has something here", even one we cannot read: it may be
        # from a newer version of this software and must not be overwritten. Only the topics this node
        # may republish matter (a flood of other topics must not grow the set): those it stands behind,
        # and the policy's, which it may stand behind once this very message is applied (else it put
        # back what the broker had just delivered, over any newer policy published meanwhile).
        if msg.topic in self._retained_own or kind == "policy":
            self._seen_topics.add(msg.topic)
        try:
            if kind == "policy" and not msg.payload:
                self._numbering_lost("was emptied (an empty retained message)")
                return
            doc = decode(kind, msg.payload, limit=self.max_payload_bytes)
            if kind == "policy":
                await self._on_policy(policy_from(doc))
            elif kind == "posteriors":
                await self._on_posteriors(name, doc, msg.payload)
            else:
                await self._on_state(name, doc)
        except MalformedPayload as e:
            self.metrics.malformed.labels(kind, e.reason).inc()
            self._warnings.warn(
                "fleet link: dropped a malformed %s message on %s: %s", kind, escape_text(msg.topic), e
            )
            if kind == "policy":
                self._numbering_lost("cannot be read")
        except Exception:
            # A defect here must cost one message, not the session: the message, if retained, would
            # come back at every reconnect.
            self.metrics.malformed.labels(kind, "schema").inc()
            log.exception("fleet link: a %s message on %s not handled; dropped", kind, escape_text(msg.topic))

    async def _on_policy(self, p: FleetPolicy) -> None:
        assert self._policy_lock is not None
        async with self._policy_lock:  # a retry and a delivery must not apply concurrently
            await self._apply_policy(p)

    async def _apply_policy(self, p: FleetPolicy) -> None:
        current = self._policy
        applied = current.digest if current is not None else self._applied_digest
        if p.version == self._policy_version and (not applied or applied == p.digest):
            # The retained copy of what is applied (reconnect) or of what a snapshot restored. A
            # different document under the same number is new: a broker restarted without its
            # retained copy makes the next publisher number from 1 again.
            if self._renumbered:  # it was not the retained copy that was lost after all
                self._renumbered = False
                if current is not None:
                    self._stand_behind(current)
            return
        # The numbering started over (the retained policy lost), or this node holds the highest version
        # a sidecar takes, above which nobody numbers (the next policy is numbered from 1 once it is
        # cleared, also while this node is away): nothing received is stale, whatever its version.
        restarted = self._renumbered or self._policy_version >= MAX_COUNT
        if p.version < self._policy_version and not restarted:
            self.metrics.stale.inc()
            log.info("fleet link: ignored stale %s (applied: v%d)", _what(p), self._policy_version)
            return
        if self._refused is not None and p.version < self._refused.version and not restarted:
            return  # older than the one waiting for a retry, which the fleet has moved on to
        retry = p is self._refused
        if not retry:
            self.metrics.received.labels("policy").inc()
            self._newest_version = p.version if restarted else max(self._newest_version, p.version)
        # Applied, or refused for good, the newest supersedes one waiting for a retry.
        self._refused = None
        try:
            if p.cleared:
                if self.on_policy_cleared is not None:
                    await _maybe_await(self.on_policy_cleared(p.version))
            elif self.on_policy is not None:
                await _maybe_await(self.on_policy(p.yaml, p.version))
        except Exception as e:
            self.metrics.rejected.inc()
            if isinstance(e, ValueError):  # the document itself: no retry can change that
                if self._rejected_logged != (p.version, p.digest):
                    self._rejected_logged = (p.version, p.digest)
                    log.error("fleet link: %s from %s refused: %s", _what(p), p.node, e)
                return
            if not retry:
                self._retry_s = RETRY_REFUSED_MIN_S
                if self._refused_now is not None:
                    self._refused_now.set()
            self._refused = p
            log.error("fleet link: %s from %s refused (retried in %.0f s): %s", _what(p), p.node,
                      self._retry_s, e)  # fmt: skip
            return
        # Equal versions with different documents come from concurrent publishers: taking the later
        # delivery converges on the broker's retained one, which is also what new replicas get.
        # A tombstone is stood behind like a policy: a broker restarted empty gets it back, never the
        # policy it cleared (that is what an empty-message clear could not do).
        self._policy, self._policy_version, self._renumbered = p, p.version, False
        self._rejected_logged = None
        self._stand_behind(p)
        self.metrics.policy_version.set(p.version)
        if p.cleared:
            log.info("fleet link: the fleet policy was cleared (v%d from %s)", p.version, p.node)
        elif self.on_policy is not None:
            log.info("fleet link: applied fleet policy v%d from %s (%s)", p.version, p.node, p.source or "-")

    def _numbering_restarts(self) -> bool:
        """The clear in force is of the highest version a sidecar takes: the next policy this node
        publishes numbers from 1 (what FleetVersionsUsedUp asks the operator for)."""
        applied = self._policy.digest if self._policy is not None else self._applied_digest
        return self._policy_version >= MAX_COUNT and applied == CLEARED_DIGEST

    def _stand_behind(self, p: FleetPolicy) -> None:
        """Republish ``p`` (a policy or a tombstone) after a resync that finds the broker without a
        policy. Kept as received (same node and time) so a republished copy is the same document."""
        self._retained_own[self.topics.policy] = (
            encode("policy", p.node, p.published_at, _policy_fields(p), limit=2 * self.max_payload_bytes),
            "policy",
        )

    def _numbering_lost(self, why: str, *, withdrawn: bool = True) -> None:
        """The fleet's retained policy is gone (emptied with an empty retained message; lost by the
        broker) or cannot be read: its version with it, so publishers number from 1 again
        (``publish_fleet_policy``). The policy in force stays (version, gauge), the next one is
        applied whatever its version (below the one gone, it would be stale for good), and the one
        gone is no longer this node's to republish, unless its retained copy comes back (the
        unreadable one was not retained). One waiting for a retry is no longer the fleet's newest
        once ``withdrawn`` (a message replaced it), only once another arrives."""
        if withdrawn:
            self._refused = None
        self._retained_own.pop(self.topics.policy, None)
        if self._policy_version and not self._renumbered:  # once: a peer's flood is not logged at its pace
            log.info("fleet link: the fleet policy %s; the next is applied whatever its version", why)
        self._renumbered = True

    async def _on_posteriors(self, model: str, doc: Mapping[str, Any], raw: bytes) -> None:
        if _field(doc, "model", str) != model:
            raise MalformedPayload("schema", f"model {doc.get('model')!r} on the topic of {model!r}")
        state = _field(doc, "state", dict)
        if doc["node"] == self.node_id:
            return  # our own retained copy
        self._keep_posteriors(model, raw)
        self.metrics.received.labels("posteriors").inc()
        if self.on_posteriors is not None:
            try:
                await _maybe_await(self.on_posteriors(model, state))
            except Exception:
                self.metrics.callback_errors.labels("posteriors").inc()
                log.exception(
                    "fleet link: posteriors for %s from %s not used", escape_text(model), doc["node"]
                )

    def _keep_posteriors(self, model: str, raw: bytes) -> None:
        """Keep ``raw`` as the newest posteriors for ``model``, within ``max_posteriors_bytes``."""
        old = self._posteriors.pop(model, None)
        if old is not None:
            self._posteriors_bytes -= len(old) + len(model) + _ENTRY_OVERHEAD
        self._posteriors[model] = raw
        self._posteriors_bytes += len(raw) + len(model) + _ENTRY_OVERHEAD
        while self._posteriors_bytes > self.max_posteriors_bytes and len(self._posteriors) > 1:
            gone, payload = next(iter(self._posteriors.items()))  # the oldest received
            del self._posteriors[gone]
            self._posteriors_bytes -= len(payload) + len(gone) + _ENTRY_OVERHEAD
            self._warnings.warn(
                "fleet link: forgot the posteriors shared for %s (the oldest received): those kept are "
                "over max_posteriors_bytes (%d)",
                escape_text(gone),
                self.max_posteriors_bytes,
            )

    async def _on_state(self, engine: str, doc: Mapping[str, Any]) -> None:
        if _field(doc, "engine", str) != engine:
            raise MalformedPayload("schema", f"engine {doc.get('engine')!r} on the topic of {engine!r}")
        state = _field(doc, "state", dict)
        self.metrics.received.labels("state").inc()
        if self.on_state is not None:
            try:
                await _maybe_await(self.on_state(engine, state))
            except Exception:
                self.metrics.callback_errors.labels("state").inc()
                # (decoded from the topic: any text)
                log.exception("fleet link: state of %s not used", escape_text(engine))


class FleetVersionsUsedUp(ValueError):
    """The fleet's retained policy carries the highest version a sidecar takes: nothing can be
    published above it until the fleet's policy is cleared (the fleet's state, not the document)."""


def _next_version(current: int, topics: Topics, *, restart: bool = False) -> int:
    """The version above ``current``; 1 when ``restart`` (``current`` is a clear of the highest
    version); FleetVersionsUsedUp when there is none a sidecar takes (a peer published the highest,
    and what came next was dropped by every sidecar while the publisher reported it)."""
    if current >= MAX_COUNT:
        if restart:
            return 1
        raise FleetVersionsUsedUp(
            f"the fleet's policy version is already {current}, the highest a sidecar takes: clear it "
            f"(controllerctl policy clear --fleet --fleet-name {topics.fleet}) to number from 1 again"
        )
    return current + 1


def _tombstone_version(current: int) -> int:
    """The version of a clear of ``current``: one above it, so that links order it after the policy it
    clears; ``current`` itself at the highest version (its document, not its number, is new: links
    apply a different document under the version they hold), and the next policy numbers from 1."""
    return min(current + 1, MAX_COUNT)


def _what(p: FleetPolicy) -> str:
    return f"clear of the fleet policy v{p.version}" if p.cleared else f"fleet policy v{p.version}"


def _policy_fields(p: FleetPolicy) -> dict[str, Any]:
    if p.cleared:
        return {"version": p.version, "cleared": True, "source": p.source}
    return {"version": p.version, "yaml": p.yaml, "source": p.source}


async def _maybe_await(result: Awaitable[None] | None) -> None:
    if inspect.isawaitable(result):
        await result


@dataclass(frozen=True, slots=True)
class RetainedPolicy:
    """What the broker held on a fleet's policy topic before a publisher replaced it.

    ``state``: ``"policy"``, ``"cleared"`` (a tombstone), ``"none"`` (empty: never set, emptied, or lost
    in a broker restart) or ``"unreadable"`` (numbered as none); ``version``: its version (0 unless
    policy or cleared)."""

    state: str
    version: int = 0


async def _replace_retained_policy(
    *,
    broker: BrokerSettings,
    topics: Topics,
    timeout_s: float,
    max_payload_bytes: int,
    fields: Callable[[RetainedPolicy], dict[str, Any]],
) -> tuple[RetainedPolicy, dict[str, Any]]:
    """Read the fleet's retained policy, then publish ``fields(what was read)`` over it, retained;
    returns what was read and the fields published. ``fields`` raises (ValueError) to publish nothing."""
    node = f"controllerctl-{uuid.uuid4().hex[:12]}"
    token = uuid.uuid4().hex
    found = RetainedPolicy("none")
    async with asyncio.timeout(timeout_s):
        async with MqttConnection(settings=broker, client_id=node) as conn:
            await conn.subscribe([topics.policy, topics.probe(node)])
            await conn.publish(topics.probe(node), token.encode(), qos=1)
            messages = conn.messages()
            async for msg in messages:
                kind, _ = topics.parse(msg.topic)
                if kind == "probe" and msg.payload == token.encode():
                    break
                if kind == "policy" and msg.payload:
                    try:
                        p = policy_from(decode("policy", msg.payload, limit=max_payload_bytes))
                    except MalformedPayload as e:
                        log.warning("the retained fleet policy is malformed (%s); numbering it as none", e)
                        if found.state == "none":
                            found = RetainedPolicy("unreadable")
                        continue
                    if p.version >= found.version:
                        found = RetainedPolicy("cleared" if p.cleared else "policy", p.version)
            await messages.aclose()  # type: ignore[attr-defined]
            published = fields(found)
            payload = encode("policy", node, time.time(), published, limit=max_payload_bytes)
            await conn.publish(topics.policy, payload, qos=1, retain=True)
    return found, published


async def publish_fleet_policy(
    *,
    broker: BrokerSettings,
    fleet: str,
    yaml: str,
    source: str,
    timeout_s: float = 10.0,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> int:
    """Publish ``yaml`` as the fleet's policy (retained) and return its version.

    Reads the retained policy first so the version is one above the fleet's current one (a clear's
    too: the numbering goes on after it; from 1 after a clear of the highest version). The caller
    validates the document (``parse_policy``) before calling. Raises ConnectionLost when the broker
    cannot be reached and TimeoutError when it does not answer within ``timeout_s``; ValueError when
    the payload is too large, FleetVersionsUsedUp (a ValueError) when the retained version is the
    highest there is.
    """
    topics = Topics(fleet)

    def policy_fields(found: RetainedPolicy) -> dict[str, Any]:
        version = _next_version(found.version, topics, restart=found.state == "cleared")
        return {"version": version, "yaml": yaml, "source": source}

    _, fields = await _replace_retained_policy(
        broker=broker,
        topics=topics,
        timeout_s=timeout_s,
        max_payload_bytes=max_payload_bytes,
        fields=policy_fields,
    )
    return int(fields["version"])


async def publish_fleet_clear(
    *,
    broker: BrokerSettings,
    fleet: str,
    timeout_s: float = 10.0,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> tuple[int, RetainedPolicy]:
    """Clear the fleet's policy: publish a tombstone (retained) over it. Returns the tombstone's
    version and what it replaced.

    Every link applies it (its sidecar's engines go back to its local policy) and none puts the
    cleared policy back, also one disconnected meanwhile (it finds the tombstone when it returns).
    The tombstone is numbered one above the retained version (above nothing: 1), or at the highest
    version, that version (then the next policy numbers from 1). Raises ConnectionLost and
    TimeoutError as ``publish_fleet_policy`` does.
    """
    found, fields = await _replace_retained_policy(
        broker=broker,
        topics=Topics(fleet),
        timeout_s=timeout_s,
        max_payload_bytes=max_payload_bytes,
        fields=lambda found: {"version": _tombstone_version(found.version), "cleared": True, "source": ""},
    )
    return int(fields["version"]), found
