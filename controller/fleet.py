"""The fleet link: sidecars of one fleet share the policy, engine state and posteriors over MQTT.

Topics (``<fleet>``, ``<engine>`` and ``<model>`` are percent-encoded into one topic level each, so a
model name like ``meta-llama/Llama-3.1-8B`` stays one level):

- ``speccontrol/v1/<fleet>/policy`` (retained): the fleet's policy, a versioned YAML document.
- ``speccontrol/v1/<fleet>/engines/<engine>/state``: each engine's state, for fleet views.
- ``speccontrol/v1/<fleet>/posteriors/<model>`` (retained): the latest learned statistics per model, so
  a new replica starts warm.

Payloads are JSON objects ``{"v": 1, "kind": ..., "node": ..., "published_at": ...}`` plus the kind's
fields. Anything malformed, oversized or of another version is logged and counted, never fatal.

The link never blocks the caller: ``publish_*`` put the message in an outbox (the latest per topic
wins) that the link's one background task drains while connected, so a broker that is down or slow
changes nothing for local control. The task reconnects with exponential backoff and jitter; on
return, the broker's retained messages resync the policy and posteriors and the outbox is flushed.

A fleet policy counts as applied (its version, the gauge, the copy this node republishes) only once
``on_policy`` returned: one it refuses with a ValueError (an invalid document) is refused for good; one
it refuses otherwise (the sidecar could not write its state) is tried again, with backoff, while it is
the newest the fleet has.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from controller._mqtt import BrokerSettings, ConnectionLost, MqttConnection, Received
from controller.policy_store import MAX_SOURCE
from controller.snapshot import MAX_COUNT
from controller.validation import MAX_TIME_S
from controller.wire.names import has_control
from policies.text import name_problem

__all__ = [
    "PAYLOAD_VERSION",
    "BrokerSettings",
    "FleetLink",
    "FleetPolicy",
    "MalformedPayload",
    "Topics",
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

PolicyCallback = Callable[[str, int], Awaitable[None] | None]
PosteriorsCallback = Callable[[str, Mapping[str, Any]], Awaitable[None] | None]
StateCallback = Callable[[str, Mapping[str, Any]], Awaitable[None] | None]


class MalformedPayload(ValueError):
    """A payload that cannot be used; ``reason`` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


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
    version: int
    yaml: str
    source: str
    published_at: float
    node: str

    @property
    def digest(self) -> str:
        return policy_digest(self.yaml)


def policy_digest(yaml_text: str) -> str:
    """SHA-256 (hex) of a fleet policy's YAML: what tells two documents of one version apart."""
    return hashlib.sha256(yaml_text.encode()).hexdigest()


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
        on_posteriors: PosteriorsCallback | None = None,
        on_state: StateCallback | None = None,
        policy_version: int = 0,
        policy_digest: str = "",
        registry: CollectorRegistry | None = None,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 30.0,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < backoff_min_s <= backoff_max_s:
            raise ValueError(
                f"backoff: need 0 < backoff_min_s <= backoff_max_s, got {backoff_min_s}, {backoff_max_s}"
            )
        if policy_version < 0:
            raise ValueError(f"policy_version: must be >= 0, got {policy_version}")
        self.broker = broker
        self.topics = Topics(fleet)
        self.node_id = node_id or f"speccontrol-{uuid.uuid4().hex[:12]}"
        _segment(self.node_id, "node_id")
        self.on_policy = on_policy
        self.on_posteriors = on_posteriors
        self.on_state = on_state
        self.metrics = FleetMetrics(registry if registry is not None else CollectorRegistry())
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self.max_payload_bytes = max_payload_bytes
        self.sync_timeout_s = sync_timeout_s
        self.clock = clock
        self.rng = rng or random.Random()
        self._policy: FleetPolicy | None = None
        self._policy_version = policy_version
        #: The newest version seen, applied or not: what this node's own next policy numbers above.
        self._newest_version = policy_version
        #: A policy refused for a reason that may pass (not a ValueError), retried while it is newest.
        self._refused: FleetPolicy | None = None
        self._retry_s = RETRY_REFUSED_MIN_S
        self._policy_lock: asyncio.Lock | None = None
        #: Set when a newly delivered policy is refused: its retry waits its own (short) delay.
        self._refused_now: asyncio.Event | None = None
        #: Digest of the applied policy when only its version is known (restored from a snapshot).
        self._applied_digest = policy_digest
        self._posteriors: dict[str, dict[str, Any]] = {}
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
        return self._policy

    def latest_posteriors(self, model: str) -> Mapping[str, Any] | None:
        """The newest posteriors another node shared for ``model`` (e.g. to warm-start a new engine)."""
        return self._posteriors.get(model)

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
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
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
        version = max(self._policy_version, self._newest_version) + 1
        p = FleetPolicy(version, yaml_text, source, self.clock(), self.node_id)
        self._queue(self.topics.policy, "policy", _policy_fields(p), qos=1, retain=True, at=p.published_at)
        # The caller applied it locally already: the broker's echo must not apply it a second time.
        self._policy, self._policy_version = p, version
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
        while True:
            try:
                async with MqttConnection(settings=self.broker, client_id=self.node_id) as conn:
                    attempt = 0
                    await self._session(conn)
            except ConnectionLost as e:
                self.metrics.connection_errors.inc()
                log.warning("fleet link: %s", e)
            except Exception:
                self.metrics.connection_errors.inc()
                log.exception("fleet link: unexpected error; reconnecting")
            finally:
                self._conn = None
                self.metrics.connected.set(0)
            delay = min(self.backoff_max_s, self.backoff_min_s * 2**attempt) * self.rng.uniform(0.5, 1.0)
            attempt = min(attempt + 1, 30)
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

    async def _dispatch(self, msg: Received) -> None:
        kind, name = self.topics.parse(msg.topic)
        if kind == "probe":
            if msg.payload.decode(errors="replace") == self._probe_token:
                self._resynced()
            return
        if not kind:
            return
        # Any message counts as "the broker has something here", even one we cannot read: it may be
        # from a newer version of this software and must not be overwritten.
        self._seen_topics.add(msg.topic)
        try:
            doc = decode(kind, msg.payload, limit=self.max_payload_bytes)
            if kind == "policy":
                await self._on_policy(policy_from(doc))
            elif kind == "posteriors":
                await self._on_posteriors(name, doc)
            else:
                await self._on_state(name, doc)
        except MalformedPayload as e:
            self.metrics.malformed.labels(kind, e.reason).inc()
            log.warning("fleet link: dropped a malformed %s message on %s: %s", kind, msg.topic, e)

    async def _on_policy(self, p: FleetPolicy) -> None:
        assert self._policy_lock is not None
        async with self._policy_lock:  # a retry and a delivery must not apply concurrently
            await self._apply_policy(p)

    async def _apply_policy(self, p: FleetPolicy) -> None:
        current = self._policy
        if p.version < self._policy_version:
            self.metrics.stale.inc()
            log.info(
                "fleet link: ignored stale fleet policy v%d (applied: v%d)", p.version, self._policy_version
            )
            return
        applied = current.digest if current is not None else self._applied_digest
        if p.version == self._policy_version and (not applied or applied == p.digest):
            # The retained copy of what is applied (reconnect) or of what a snapshot restored. A
            # different document under the same number is new: a broker restarted without its
            # retained copy makes the next publisher number from 1 again.
            return
        if self._refused is not None and p.version < self._refused.version:
            return  # older than the one waiting for a retry, which the fleet has moved on to
        retry = p is self._refused
        if not retry:
            self.metrics.received.labels("policy").inc()
            self._newest_version = max(self._newest_version, p.version)
        # Applied, or refused for good, the newest supersedes one waiting for a retry.
        self._refused = None
        if self.on_policy is not None:
            try:
                await _maybe_await(self.on_policy(p.yaml, p.version))
            except Exception as e:
                self.metrics.rejected.inc()
                if isinstance(e, ValueError):  # the document itself: no retry can change that
                    log.error("fleet link: fleet policy v%d from %s refused: %s", p.version, p.node, e)
                    return
                if not retry:
                    self._retry_s = RETRY_REFUSED_MIN_S
                    if self._refused_now is not None:
                        self._refused_now.set()
                self._refused = p
                log.error("fleet link: fleet policy v%d from %s refused (retried in %.0f s): %s", p.version,
                          p.node, self._retry_s, e)  # fmt: skip
                return
        # Equal versions with different documents come from concurrent publishers: taking the later
        # delivery converges on the broker's retained one, which is also what new replicas get.
        self._policy, self._policy_version = p, p.version
        # Kept as received (same node and time) so a republished copy is the same document.
        self._retained_own[self.topics.policy] = (
            encode("policy", p.node, p.published_at, _policy_fields(p), limit=2 * self.max_payload_bytes),
            "policy",
        )
        self.metrics.policy_version.set(p.version)
        if self.on_policy is not None:
            log.info("fleet link: applied fleet policy v%d from %s (%s)", p.version, p.node, p.source or "-")

    async def _on_posteriors(self, model: str, doc: Mapping[str, Any]) -> None:
        if _field(doc, "model", str) != model:
            raise MalformedPayload("schema", f"model {doc.get('model')!r} on the topic of {model!r}")
        state = _field(doc, "state", dict)
        if doc["node"] == self.node_id:
            return  # our own retained copy
        self._posteriors[model] = state
        self.metrics.received.labels("posteriors").inc()
        if self.on_posteriors is not None:
            try:
                await _maybe_await(self.on_posteriors(model, state))
            except Exception:
                self.metrics.callback_errors.labels("posteriors").inc()
                log.exception("fleet link: posteriors for %s from %s not used", model, doc["node"])

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
                log.exception("fleet link: state of %s not used", engine)


def _policy_fields(p: FleetPolicy) -> dict[str, Any]:
    return {"version": p.version, "yaml": p.yaml, "source": p.source}


async def _maybe_await(result: Awaitable[None] | None) -> None:
    if inspect.isawaitable(result):
        await result


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

    Reads the retained policy first so the version is one above the fleet's current one. The caller
    validates the document (``parse_policy``) before calling. Raises ConnectionLost when the broker
    cannot be reached and TimeoutError when it does not answer within ``timeout_s``; ValueError when
    the payload is too large.
    """
    topics = Topics(fleet)
    node = f"controllerctl-{uuid.uuid4().hex[:12]}"
    token = uuid.uuid4().hex
    current = 0
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
                        current = max(
                            current,
                            policy_from(decode("policy", msg.payload, limit=max_payload_bytes)).version,
                        )
                    except MalformedPayload as e:
                        log.warning(
                            "the retained fleet policy is malformed (%s); publishing version 1 above 0", e
                        )
            await messages.aclose()  # type: ignore[attr-defined]
            version = current + 1
            payload = encode(
                "policy",
                node,
                time.time(),
                {"version": version, "yaml": yaml, "source": source},
                limit=max_payload_bytes,
            )
            await conn.publish(topics.policy, payload, qos=1, retain=True)
    return version
