"""The sidecar: engines attach over gRPC, their telemetry feeds one ControlLoop each, directives go back.

``Sidecar`` owns the state (policies, engines, the directive version counter), the two gRPC servers
(engine and admin), the metrics endpoint and one supervised background task that runs the decision
tick and the periodic snapshot. The gRPC services are thin adapters over its methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

import controller
from controller.admin_service import AdminService
from controller.auth import MUTATING_METHODS, READ_METHODS, TokenInterceptor, server_credentials
from controller.config import MAX_UNIX_PATH, ConfigError, SidecarConfig, is_local_address, parse_address
from controller.engine_service import EngineService
from controller.fleet import FleetLink
from controller.limits import TokenBucket
from controller.metrics import MetricsServer, SidecarMetrics
from controller.policy_store import PolicyRecord, PolicyStore
from controller.snapshot import (
    MAX_COUNT,
    SnapshotError,
    SnapshotStore,
    float_field,
    int_field,
    mapping_field,
    str_field,
)
from controller.state_dir import StateDirLock, remove_stale_socket
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.validation import (
    MAX_INSTANCE_ID,
    MAX_SEQUENCE,
    Limits,
    TelemetryError,
    check_batch_header,
    escape_text,
    parse_policy_checked,
    validate_batch,
    validate_hello,
)
from controller.wire.convert import arm_to_pb, directive_to_pb
from policies.arms import Arm
from policies.directive import Directive
from policies.engine import EngineInfo
from policies.loop import ControlLoop, Totals
from policies.observation import StepObservation
from policies.presets import resolve_policy_text
from policies.spec import PolicyError, PolicySpec, parse_policy

log = logging.getLogger(__name__)

#: A clean shutdown saves the exact version counter; after a crash the last periodic snapshot may be
#: behind what was sent, so the counter skips ahead by this much to stay strictly increasing.
CRASH_VERSION_GAP = 1_000_000
STREAM_QUEUE = 16
#: Distinct traffic classes one engine's loop learns about; later ones are pooled into "default".
MAX_CLASSES_PER_ENGINE = 256
#: Contexts listed per engine in status (each is one class x batch bucket it learned about).
MAX_STATUS_CONTEXTS = 256
WATCH_QUEUE = 256
#: Bursts of policy changes allowed before ``max_policy_changes_per_s`` applies.
POLICY_CHANGE_BURST = 10.0
#: How long start() waits for the broker's retained policy and posteriors, so engines that attach
#: right after start get the fleet's policy and a warm start. A broker that is down costs this once.
FLEET_SYNC_S = 2.0


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """Ends an Attach stream: the engine closed it (``error`` None) or sent something invalid."""

    error: TelemetryError | None = None


StreamItem = Directive | StreamEnd


@dataclass(eq=False, slots=True)
class EngineState:
    info: EngineInfo
    loop: ControlLoop
    streams: list[asyncio.Queue[StreamItem]] = field(default_factory=list)
    #: The sidecar-stamped directive last sent (None until the engine first attaches).
    directive: Directive | None = None
    loop_version: int = -1
    sent_at: float = 0.0
    rejected: int = 0
    #: The engine process whose reports ``last_sequence`` counts (Hello.instance_id; "" for none).
    instance_id: str = ""
    #: The highest report sequence applied (or refused for good) for ``instance_id``.
    last_sequence: int = 0
    #: ``last_sequence`` as of the last directive pushed to the streams (what the engine knows).
    acked_pushed: int = 0
    last_seen: float = 0.0
    bucket: TokenBucket | None = None
    #: The engine said it cannot apply directives (an observe-only adapter): status shows them as
    #: recommendations.
    observe_only: bool = False
    #: Traffic classes learned per context (at most MAX_CLASSES_PER_ENGINE, "default" among them),
    #: and the steps whose other classes were pooled into "default".
    classes: set[str] = field(default_factory=lambda: {"default"})
    classes_pooled: int = 0
    #: Hello.plugin_mode of the last attach ("" when the engine is not the vLLM plugin).
    plugin_mode: str = ""

    @property
    def connected(self) -> bool:
        return bool(self.streams)


@dataclass(eq=False, slots=True)
class Session:
    """One Attach stream.

    With an ``instance_id``, sequences count per engine instance across streams (``engine`` holds
    them); without one (older engines), per stream (the session holds them).
    """

    engine: EngineState
    queue: asyncio.Queue[StreamItem]
    instance_id: str = ""
    last_sequence: int = 0

    @property
    def _tracker(self) -> EngineState | Session:
        e = self.engine
        return e if self.instance_id and e.instance_id == self.instance_id else self

    @property
    def acked_sequence(self) -> int:
        """What to acknowledge on this stream: the highest sequence applied or refused for good."""
        return self._tracker.last_sequence


def info_to_json(e: EngineInfo) -> dict[str, Any]:
    return {
        "engine_id": e.engine_id,
        "model": e.model,
        "max_k": e.max_k,
        "arms": [str(a) for a in e.arms],
        "granularity": int(e.granularity),
        "max_batch_size": e.max_batch_size,
        "counterfactual_methods": [m.value for m in e.counterfactual_methods],
        "p_eagle_partial_k_safe": e.p_eagle_partial_k_safe,
    }


def info_from_json(d: Mapping[str, Any]) -> EngineInfo:
    """An engine description from a snapshot, checked as its Hello was. Raises TelemetryError or
    SnapshotError."""
    try:
        hello = pb.Hello(
            engine_id=d["engine_id"],
            model=d["model"],
            max_k=d["max_k"],
            arms=[arm_to_pb(Arm.parse(a)) for a in d["arms"]],
            granularity=d["granularity"],
            max_batch_size=d["max_batch_size"],
            counterfactual_methods=d["counterfactual_methods"],
            p_eagle_partial_k_safe=d["p_eagle_partial_k_safe"],
            protocol_version=1,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SnapshotError(f"info: {type(e).__name__}: {e}") from None
    return validate_hello(hello)


def totals_from_json(d: Mapping[str, Any], *, path: str) -> Totals:
    """A loop's lifetime counters from a snapshot, each in range. Raises SnapshotError."""
    values: dict[str, Any] = {}
    for f in fields(Totals):
        if f.type in (float, "float"):
            values[f.name] = float_field(d, f.name, path=path, hi=float(MAX_COUNT), default=0.0)
        else:
            values[f.name] = int_field(d, f.name, path=path, default=0)
    return Totals(**values)


def _oneline(text: str, limit: int = 300) -> str:
    """Text for one log line: control characters escaped, length bounded."""
    return escape_text(text)[:limit]


def _put_latest(q: asyncio.Queue[Any], item: Any) -> None:
    """Enqueue without waiting; when full, the oldest item goes (only the newest directive matters)."""
    while True:
        try:
            q.put_nowait(item)
            return
        except asyncio.QueueFull:
            with contextlib.suppress(asyncio.QueueEmpty):
                q.get_nowait()


def _client_target(listen: str, port: int) -> str:
    addr = parse_address(listen, field="listen")
    if isinstance(addr, str):
        return f"unix://{addr}"
    host = addr[0] if addr[0] not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Sidecar:
    def __init__(
        self,
        *,
        config: SidecarConfig,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = SidecarMetrics(registry=self.registry, clock=clock)
        self.limits = Limits(config.max_steps_per_batch, config.max_requests_per_step)
        self.policy_changes = TokenBucket(
            rate=config.max_policy_changes_per_s, burst=POLICY_CHANGE_BURST, clock=time.monotonic
        )
        self.snapshots = SnapshotStore(path=config.snapshot_path, clock=clock)
        self._store: PolicyStore | None = None
        self._engines: dict[str, EngineState] = {}
        self._version = 0
        self._watchers: list[tuple[str, asyncio.Queue[pb.Decision]]] = []
        self._engine_server: grpc.aio.Server | None = None
        self._admin_server: grpc.aio.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._engine_target = ""
        self._admin_target = ""
        self._metrics_url = ""
        self._started_at = 0.0
        self._last_snapshot_attempt = 0.0
        self._last_posteriors = 0.0
        #: The fleet link (None when ``mqtt_url`` is empty) and the version of the fleet policy applied.
        self.fleet: FleetLink | None = None
        self._fleet_version = 0
        #: model -> (engine, learned state) of the posteriors last shared.
        self._shared: dict[str, tuple[str, dict[str, Any]]] = {}
        self._lock: StateDirLock | None = None
        #: Called with (engine id, steps) for every applied batch (``serve --record-steps``).
        self.step_sink: Callable[[str, Sequence[StepObservation]], None] | None = None

    # -- public surface --------------------------------------------------------------------------

    @property
    def engine_target(self) -> str:
        return self._engine_target

    @property
    def admin_target(self) -> str:
        return self._admin_target

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics``, or ``""`` when metrics are disabled."""
        return self._metrics_url

    @property
    def policy_store(self) -> PolicyStore:
        if self._store is None:
            raise RuntimeError("the sidecar is not started")
        return self._store

    def engines(self) -> dict[str, EngineState]:
        return dict(self._engines)

    @property
    def directive_version(self) -> int:
        return self._version

    async def start(self) -> None:
        """Restore the snapshot, join the fleet, bind the servers and start the background task.

        The fleet link is started before the servers so that the first engines find the fleet's
        policy and posteriors in place; a broker that cannot be reached delays the start by
        ``FLEET_SYNC_S`` at most and never prevents it (the link keeps retrying in the background).
        """
        self._started_at = self.clock()
        broker = self.config.broker_settings()  # reads the password file: fails before anything starts
        self._lock = StateDirLock.acquire(Path(self.config.state_dir))
        try:
            self._restore()
        except BaseException:
            self._release_lock()
            raise
        if broker is not None:
            self.fleet = FleetLink(
                broker=broker,
                fleet=self.config.fleet,
                node_id=self.config.fleet_node_id,
                registry=self.registry,
                policy_version=self._fleet_version,
                on_policy=self._on_fleet_policy,
                clock=self.clock,
            )
            await self.fleet.start()
            if not await self.fleet.wait_synced(FLEET_SYNC_S):
                log.warning(
                    "fleet link: not synced with %s after %.0f s; serving with the local policy",
                    broker.describe(),
                    FLEET_SYNC_S,
                )
        opts = [
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            ("grpc.max_send_message_length", self.config.max_message_bytes),
            # Streams per connection; engines use one each, a flood of them is refused by gRPC.
            ("grpc.max_concurrent_streams", 256),
            # grpc sets SO_REUSEPORT by default: a second sidecar on a taken port would share it
            # silently (and steal half the connections) instead of failing to start.
            ("grpc.so_reuseport", 0),
        ]
        engine_name = pb.DESCRIPTOR.services_by_name["EngineService"].full_name
        admin_name = pb.DESCRIPTOR.services_by_name["AdminService"].full_name
        token = self.config.admin_token()  # like the broker password: a bad file fails the start
        interceptors: list[grpc.aio.ServerInterceptor[Any, Any]] = []
        if token:
            local = is_local_address(self.config.admin_listen, field="admin_listen")
            guarded = MUTATING_METHODS if local else MUTATING_METHODS | READ_METHODS
            interceptors.append(TokenInterceptor(token=token, guarded=guarded, on_reject=self._auth_rejected))
        elif not is_local_address(self.config.admin_listen, field="admin_listen"):
            log.info("admin API on %s: clients authenticate with mTLS", self.config.admin_listen)
        self._engine_server = grpc.aio.server(options=opts)
        pb_grpc.add_EngineServiceServicer_to_server(EngineService(self), self._engine_server)  # type: ignore[no-untyped-call]
        self._admin_server = grpc.aio.server(options=opts, interceptors=interceptors)
        pb_grpc.add_AdminServiceServicer_to_server(AdminService(self), self._admin_server)  # type: ignore[no-untyped-call]
        for server, name in ((self._engine_server, engine_name), (self._admin_server, admin_name)):
            hs = health.aio.HealthServicer()  # type: ignore[attr-defined]
            await hs.set("", health_pb2.HealthCheckResponse.SERVING)
            await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(hs, server)
            reflection.enable_server_reflection((name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            self._engine_target = self._bind(self._engine_server, "engine")
            self._admin_target = self._bind(self._admin_server, "admin")
            await self._engine_server.start()
            await self._admin_server.start()
            if self.config.metrics_listen:
                addr = parse_address(self.config.metrics_listen, field="metrics_listen")
                assert not isinstance(addr, str)  # SidecarConfig rejects unix addresses for metrics
                self._metrics_server = MetricsServer(registry=self.registry, host=addr[0], port=addr[1])
                self._metrics_url = self._metrics_server.start()
        except BaseException:
            await self._close_servers()
            await self._stop_fleet()
            self._release_lock()
            raise
        self._task = asyncio.create_task(self._run(), name="sidecar-tick")
        self._task.add_done_callback(self._task_done)

    async def stop(self, *, snapshot: bool = True) -> None:
        await self._stop_fleet()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for st in self._engines.values():
            for q in st.streams:
                _put_latest(q, StreamEnd())
        await self._close_servers()
        if snapshot and self._store is not None:
            self.save_snapshot(clean=True)
        self._release_lock()

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    async def _stop_fleet(self) -> None:
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            await fleet.stop()

    # -- engines (called by EngineService) -------------------------------------------------------

    def attach(
        self, info: EngineInfo, *, instance_id: str = "", observe_only: bool = False, plugin_mode: str = ""
    ) -> Session:
        """A new stream for ``info``. Raises TelemetryError when the sidecar holds too many engines."""
        st = self._engines.get(info.engine_id)
        now = self.clock()
        if st is None:
            self._make_room()
            st = self._engines[info.engine_id] = EngineState(info, self._warm_loop(info))
        elif st.info != info:
            log.info("engine %s reattached with a different description: new control loop", info.engine_id)
            old = st.loop.totals
            st.info, st.loop, st.loop_version = info, self._new_loop(info), -1
            st.loop.totals = old
        if instance_id and instance_id != st.instance_id:
            # A new engine process: its sequences start again. (A restored snapshot names the
            # instance it last heard, so the same process re-attaching after a restart keeps its count.)
            st.instance_id, st.last_sequence, st.acked_pushed = instance_id, 0, 0
        if st.bucket is None:
            rate = self.config.max_engine_steps_per_s
            burst = max(rate * self.config.telemetry_burst_s, float(self.config.max_steps_per_batch))
            st.bucket = TokenBucket(rate=rate, burst=burst, clock=time.monotonic)
        st.last_seen = now
        st.observe_only = observe_only
        st.plugin_mode = plugin_mode
        q: asyncio.Queue[StreamItem] = asyncio.Queue(maxsize=STREAM_QUEUE)
        st.streams.append(q)
        self.metrics.set_connected(info.engine_id, True)
        before = st.directive
        self._decide(st, now)
        if st.directive is not None and st.directive is before:
            _put_latest(q, st.directive)  # nothing new for the others: this stream still needs one
        log.info(
            "engine %s attached (%s, max_k %d%s%s)",
            info.engine_id,
            info.model,
            info.max_k,
            f", instance {instance_id}, acked {st.last_sequence}" if instance_id else "",
            f", plugin mode: {plugin_mode}" if plugin_mode else "",
        )
        return Session(st, q, instance_id=instance_id)

    def _make_room(self) -> None:
        """At ``max_engines``, forget the engine unheard longest; refuse when all are connected."""
        if len(self._engines) < self.config.max_engines:
            return
        idle = [st for st in self._engines.values() if not st.connected]
        if not idle:
            raise TelemetryError(
                "too_many_engines", f"hello: the sidecar already serves {self.config.max_engines} engines"
            )
        gone = min(idle, key=lambda st: st.last_seen)
        del self._engines[gone.info.engine_id]
        self.metrics.forget_engine(gone.info.engine_id)
        log.warning(
            "engine %s forgotten to make room (max_engines %d)", gone.info.engine_id, len(self._engines) + 1
        )

    def _warm_loop(self, info: EngineInfo) -> ControlLoop:
        """A new engine's loop, loaded with the statistics the fleet shared for its model if they fit.

        Only the learned tables are taken: the counters describe the other engine's traffic.
        """
        loop = self._new_loop(info)
        shared = self.fleet.latest_posteriors(info.model) if self.fleet is not None else None
        if not shared or shared.get("policy") != loop.spec.name:
            return loop
        try:
            loop.load_state_dict(shared)
        except (ValueError, KeyError, TypeError) as e:
            # Another arm set or state version; a partial load must not be left behind.
            log.info("engine %s: fleet posteriors for %s not used: %s", info.engine_id, info.model, e)
            return self._new_loop(info)
        loop.totals = Totals()
        log.info("engine %s: warm start from the fleet's posteriors for %s", info.engine_id, info.model)
        return loop

    def detach(self, session: Session) -> None:
        st = session.engine
        with contextlib.suppress(ValueError):
            st.streams.remove(session.queue)
        self.metrics.set_connected(st.info.engine_id, st.connected)
        log.info("engine %s detached", st.info.engine_id)

    def ingest(self, session: Session, batch: pb.StepReportBatch) -> None:
        """Validate a report batch, then feed it to the engine's loop. Raises TelemetryError.

        A batch is applied at most once per engine instance: one at or below the last sequence is a
        resend (counted, dropped). A refused batch is consumed too, so a resend cannot loop on it.
        """
        st = session.engine
        eid = st.info.engine_id
        try:
            check_batch_header(batch)  # an absurd sequence must not become the one to beat
        except TelemetryError as e:
            self.reject(st, e)
            raise
        seq = batch.sequence
        tracker = session._tracker
        if seq and seq <= tracker.last_sequence:
            self.metrics.duplicates.labels(eid).inc()
            return
        if seq:
            if tracker.last_sequence and seq > tracker.last_sequence + 1:
                self.metrics.lost_batches.labels(eid).inc(seq - tracker.last_sequence - 1)
            tracker.last_sequence = seq
        st.last_seen = self.clock()
        if st.bucket is not None and not st.bucket.take(len(batch.steps)):
            # Refused without ending the stream: a reconnect would only bring the same flood back.
            self.reject(
                st,
                TelemetryError(
                    "rate_limited", f"reports: over {self.config.max_engine_steps_per_s:g} steps/s"
                ),
            )
            return
        try:
            observations = validate_batch(batch, st.info, self.limits)
        except TelemetryError as e:
            self.reject(st, e)
            raise
        if batch.dropped_steps:
            self.metrics.engine_dropped.labels(eid).inc(batch.dropped_steps)
        observations = self._bound_classes(st, observations)
        st.loop.observe_many(observations)
        self.metrics.observe_steps(eid, observations)
        if self.step_sink is not None:
            self.step_sink(eid, observations)

    def _bound_classes(self, st: EngineState, observations: list[StepObservation]) -> list[StepObservation]:
        """The steps with every traffic class beyond the engine's first ``MAX_CLASSES_PER_ENGINE``
        pooled into ``default``: each class is a context (memory, status, snapshot, metric labels),
        and an engine naming a new one on every step must not grow them without bound."""
        known = st.classes
        out: list[StepObservation] | None = None
        for i, o in enumerate(observations):
            names = set(o.traffic_class)
            if names <= known:
                continue
            new = sorted(names - known)
            room = MAX_CLASSES_PER_ENGINE - len(known)
            known.update(new[: max(room, 0)])
            if len(new) <= room:
                continue
            if not st.classes_pooled:
                log.warning(
                    "engine %s: more than %d traffic classes; further ones are pooled into 'default'",
                    st.info.engine_id,
                    MAX_CLASSES_PER_ENGINE,
                )
            st.classes_pooled += 1
            pooled = tuple(c if c in known else "default" for c in o.traffic_class)
            out = out if out is not None else list(observations)
            out[i] = replace(o, traffic_class=pooled)
        return out if out is not None else observations

    def reject(self, st: EngineState | None, e: TelemetryError) -> None:
        self.metrics.rejected.labels(e.reason).inc()
        if st is not None:
            st.rejected += 1
        log.warning("rejected telemetry%s: %s: %s", f" from {st.info.engine_id}" if st else "", e.reason, e)

    def _auth_rejected(self, method: str, why: str) -> None:
        self.admin_rejected(why)
        log.warning("admin %s refused: %s", method, why.replace("_", " "))

    def admin_rejected(self, reason: str) -> None:
        self.metrics.rejected_admin.labels(reason).inc()

    def take_policy_change(self) -> bool:
        """False when policy changes come faster than ``max_policy_changes_per_s`` (counted)."""
        if self.policy_changes.take():
            return True
        self.admin_rejected("rate_limited")
        return False

    # -- policies (called by AdminService) -------------------------------------------------------

    def set_policy(self, yaml_text: str, *, source: str, engine_id: str = "") -> PolicyRecord:
        """Parse, check every affected engine can run it, then switch. Raises PolicyError."""
        spec = parse_policy_checked(yaml_text, source=source or "<policy>")
        overrides = self.policy_store.overrides()
        if engine_id and engine_id not in overrides and len(overrides) >= self.config.max_engines:
            raise PolicyError(
                f"at most {self.config.max_engines} engines (max_engines) may have a policy of their own",
                source=source or "<policy>",
            )
        affected = self._affected(engine_id)
        loops = {eid: self._loop_for(self._engines[eid].info, spec) for eid in affected}
        rec = self.policy_store.set_spec(spec, source=source or "<policy>", engine_id=engine_id)
        self._swap(loops)
        log.info("policy %s (revision %d) set for %s", spec.name, rec.revision, engine_id or "all engines")
        self._write_through()
        return rec

    def _write_through(self) -> None:
        """Snapshot now (a policy change must survive a kill -9 right after it is acknowledged)."""
        if not self.save_snapshot():
            log.error("policy change not yet on disk: the snapshot write failed (retried every interval)")

    def _on_fleet_policy(self, yaml_text: str, version: int) -> None:
        """A newer fleet policy arrived: switch like a local SetPolicy. A PolicyError refuses it."""
        self._fleet_version, before = version, self._fleet_version
        try:
            self.set_policy(yaml_text, source=f"fleet v{version}")  # writes the new version through
        except BaseException:
            self._fleet_version = before
            raise

    @property
    def fleet_policy_version(self) -> int:
        """The version of the last fleet policy applied here (0: none)."""
        return self._fleet_version

    def rollback_policy(self, engine_id: str = "") -> PolicyRecord:
        """Raises NoPreviousPolicy."""
        affected = self._affected(engine_id)
        rec = self.policy_store.rollback(engine_id)
        self._swap({eid: self._new_loop(self._engines[eid].info) for eid in affected})
        log.info(
            "policy rolled back to %s (revision %d) for %s", rec.spec.name, rec.revision, engine_id or "all"
        )
        self._write_through()
        return rec

    def _affected(self, engine_id: str) -> list[str]:
        if engine_id:
            return [engine_id] if engine_id in self._engines else []
        overridden = self.policy_store.overrides()
        return [e for e in self._engines if e not in overridden]

    def _loop_for(self, info: EngineInfo, spec: PolicySpec) -> ControlLoop:
        try:
            return ControlLoop(spec=spec, engine=info)
        except ValueError as e:
            raise PolicyError(f"engine {info.engine_id!r}: {e}", source=spec.name) from None

    def _new_loop(self, info: EngineInfo) -> ControlLoop:
        return ControlLoop(spec=self.policy_store.effective(info.engine_id).spec, engine=info)

    def _swap(self, loops: Mapping[str, ControlLoop]) -> None:
        now = self.clock()
        for eid, loop in loops.items():
            st = self._engines[eid]
            loop.totals = st.loop.totals
            st.loop, st.loop_version = loop, -1
            if st.connected:
                self._decide(st, now)

    def _reset_loop(self, st: EngineState, why: str) -> None:
        """Give an engine a fresh control loop (what it learned is lost, its counters are kept): a
        loop whose state broke must not break status, snapshots or the engine's decisions for good."""
        log.error("engine %s: %s; its control loop starts afresh", st.info.engine_id, why)
        totals = st.loop.totals
        st.loop, st.loop_version = self._new_loop(st.info), -1
        st.loop.totals = totals
        self.metrics.loop_resets.inc()

    # -- decisions -------------------------------------------------------------------------------

    def tick(self) -> None:
        """One decision tick: run every connected engine's loop and push what changed."""
        now = self.clock()
        for st in list(self._engines.values()):
            if st.connected:
                try:
                    self._decide(st, now)
                except Exception:
                    log.exception("engine %s: decision failed; keeping its last directive", st.info.engine_id)
                    self._reset_loop(st, "its decision failed")

    def _decide(self, st: EngineState, now: float) -> None:
        loop = st.loop
        rounds = loop.rounds
        started = time.perf_counter()
        d = loop.decide(now)
        eid = st.info.engine_id
        if loop.rounds != rounds:
            self.metrics.decision_seconds.observe(time.perf_counter() - started)
            t = loop.totals
            self.metrics.set_guards(
                eid,
                {
                    "drift_alarm": t.drift_alarms,
                    "held_by_margin": t.held_by_margin,
                    "exploration_denied": t.exploration_denied,
                    "tpot_trip": t.tpot_trips,
                },
            )
            self.metrics.decisions.labels(eid).inc()
            switches = sum(1 for c in loop.last_changes if c.before is not None)
            if switches:
                self.metrics.switches.labels(eid).inc(switches)
        if st.directive is None or loop.version != st.loop_version:
            self._version += 1
            st.loop_version = loop.version
            st.directive = replace(d, version=self._version)
            st.sent_at = now
            arms = {ctx.key: a for ctx, a in loop.current_arms().items()}
            self.metrics.set_directive(eid, version=self._version, issued_at=d.issued_at_s, arms=arms)
            st.acked_pushed = st.last_sequence
            for q in st.streams:
                _put_latest(q, st.directive)
            self._notify(st)
            self._publish_state(st, arms)
        elif now - st.sent_at >= st.directive.ttl_s / 3 or (
            st.last_sequence > st.acked_pushed and now - st.sent_at >= self.config.ack_interval_s
        ):
            # A refresh keeps the TTL from lapsing and tells the engine which batches it may forget.
            st.sent_at = now
            st.acked_pushed = st.last_sequence
            for q in st.streams:
                _put_latest(q, st.directive)

    def _publish_state(self, st: EngineState, arms: Mapping[str, Arm]) -> None:
        if self.fleet is None or st.directive is None:
            return
        eid = st.info.engine_id
        try:
            self.fleet.publish_state(
                eid,
                {
                    "model": st.info.model,
                    "policy": st.loop.spec.name,
                    "directive_version": st.directive.version,
                    "arms": {ctx: str(a) for ctx, a in arms.items()},
                    "goodput": self.metrics.recent_goodput(eid),
                    "acceptance": st.loop.totals.acceptance_rate,
                },
            )
        except ValueError as e:  # over the payload limit: the fleet view misses one update
            log.warning("engine %s: state not shared with the fleet: %s", eid, e)

    def publish_posteriors(self) -> int:
        """Share, per model, the statistics of the connected engine with the most steps; returns how many.

        A model whose best engine learned nothing since the last share is skipped.
        """
        if self.fleet is None:
            return 0
        best: dict[str, EngineState] = {}
        for st in self._engines.values():
            if st.connected and st.loop.totals.steps > 0:
                cur = best.get(st.info.model)
                if cur is None or st.loop.totals.steps > cur.loop.totals.steps:
                    best[st.info.model] = st
        shared = 0
        for model, st in sorted(best.items()):
            state = st.loop.state_dict()
            # What was learned, without what moves on every round (round counter, RNG).
            mark = (st.info.engine_id, {k: state.get(k) for k in ("totals", "contexts", "learner")})
            if self._shared.get(model) == mark:
                continue
            try:
                self.fleet.publish_posteriors(model, state)
            except ValueError as e:
                log.warning("posteriors for %s not shared with the fleet: %s", model, e)
                continue
            self._shared[model] = mark
            shared += 1
        return shared

    def watch(self, engine_id: str = "") -> asyncio.Queue[pb.Decision]:
        q: asyncio.Queue[pb.Decision] = asyncio.Queue(maxsize=WATCH_QUEUE)
        self._watchers.append((engine_id, q))
        return q

    @property
    def watcher_count(self) -> int:
        return len(self._watchers)

    def unwatch(self, q: asyncio.Queue[pb.Decision]) -> None:
        self._watchers = [(e, w) for e, w in self._watchers if w is not q]

    def _notify(self, st: EngineState) -> None:
        if not self._watchers or st.directive is None:
            return
        msg = pb.Decision(
            engine_id=st.info.engine_id, directive=directive_to_pb(st.directive), arms=self._arm_choices(st)
        )
        for eid, q in self._watchers:
            if not eid or eid == st.info.engine_id:
                _put_latest(q, msg)

    # -- status ----------------------------------------------------------------------------------

    def _arm_choices(self, st: EngineState) -> list[pb.ArmChoice]:
        est = st.loop.estimates()
        return [
            pb.ArmChoice(context=ctx.key, arm=arm_to_pb(a), goodput_tok_s=est.get(ctx, {}).get(a, 0.0))
            for ctx, a in st.loop.current_arms().items()
        ]

    def engine_status(self, st: EngineState) -> pb.EngineStatus:
        try:
            arms = self._arm_choices(st)
        except Exception:
            log.exception("engine %s: estimates failed", st.info.engine_id)
            self._reset_loop(st, "its estimates failed")
            arms = self._arm_choices(st)
        t = st.loop.totals
        d = st.directive
        return pb.EngineStatus(
            engine_id=st.info.engine_id,
            model=st.info.model,
            connected=st.connected,
            directive_version=d.version if d else 0,
            directive_age_s=max(0.0, self.clock() - d.issued_at_s) if d else 0.0,
            steps=t.steps,
            rejected=st.rejected,
            acceptance_rate=t.acceptance_rate,
            goodput_tok_s=self.metrics.recent_goodput(st.info.engine_id),
            arms=arms[:MAX_STATUS_CONTEXTS],
            policy=st.loop.spec.name,
            granularity=int(st.info.granularity),  # type: ignore[arg-type]
            available_arms=[arm_to_pb(a) for a in st.info.arms],
            max_k=st.info.max_k,
            observe_only=st.observe_only,
            plugin_mode=st.plugin_mode,
        )

    def policy_info(self, rec: PolicyRecord) -> pb.PolicyInfo:
        return pb.PolicyInfo(
            name=rec.spec.name,
            algorithm=rec.spec.algorithm,
            yaml=rec.yaml,
            revision=rec.revision,
            source=rec.source,
            set_at_s=rec.set_at_s,
            engine_id=rec.engine_id,
        )

    def status(self) -> pb.Status:
        engines, _ = self.engine_page(0, 0)
        total = len(self._engines)
        return pb.Status(
            version=controller.__version__,
            uptime_s=max(0.0, self.clock() - self._started_at),
            policy=self.policy_info(self.policy_store.default),
            engines=engines,
            snapshot_path=str(self.snapshots.path),
            last_snapshot_s=self.snapshots.last_saved_s,
            engines_total=total,
            engines_truncated=len(engines) < total,
        )

    def engine_page(self, offset: int, limit: int) -> tuple[list[pb.EngineStatus], int]:
        """Engines by id from ``offset``: at most ``limit`` (0: no count limit), and no more than fit
        a quarter of the message size limit. Returns them and the next page's offset (0: no more)."""
        ids = sorted(self._engines)
        budget = self.config.max_message_bytes // 4
        out: list[pb.EngineStatus] = []
        size = 0
        end = len(ids) if not limit else min(len(ids), offset + limit)
        i = offset
        while i < end:
            es = self.engine_status(self._engines[ids[i]])
            size += es.ByteSize() + 8
            if out and size > budget:
                break
            out.append(es)
            i += 1
        return out, (i if i < len(ids) else 0)

    # -- snapshots -------------------------------------------------------------------------------

    def state(self, *, clean: bool = False) -> dict[str, Any]:
        return {
            "directive_version": self._version,
            "fleet_policy_version": self._fleet_version,
            "clean": clean,
            "policies": self.policy_store.to_json(),
            "engines": {
                eid: {
                    "info": info_to_json(st.info),
                    "loop": st.loop.state_dict(),
                    "rejected": st.rejected,
                    "instance_id": st.instance_id,
                    "last_sequence": st.last_sequence,
                }
                for eid, st in self._engines.items()
            },
        }

    def save_snapshot(self, *, clean: bool = False) -> bool:
        """Write the state now (on the caller's thread). False when it could not be written."""
        try:
            state = self.state(clean=clean)
        except Exception:
            log.exception("snapshot: could not collect the state")
            ok = False
        else:
            ok = self.snapshots.save(state)
            if not ok and self._reset_unsaveable():
                ok = self.snapshots.save(self.state(clean=clean))
        return self._snapshot_done(ok)

    def _snapshot_done(self, ok: bool) -> bool:
        if ok:
            self.metrics.last_snapshot.set(self.snapshots.last_saved_s)
        else:
            self.metrics.snapshot_failures.inc()
        return ok

    def _reset_unsaveable(self) -> bool:
        """After a failed write: reset the loops whose state JSON cannot hold (non-finite numbers),
        so one engine cannot keep every later snapshot from being written. True if any was reset."""
        bad = []
        for st in self._engines.values():
            try:
                json.dumps(st.loop.state_dict(), allow_nan=False)
            except (TypeError, ValueError):
                bad.append(st)
        for st in bad:
            self._reset_loop(st, "its state cannot be saved")
        return bool(bad)

    def _restore(self) -> None:
        """Restore what the snapshot holds; the sidecar starts whatever the file contains.

        A file that is not a snapshot, or whose default policy or counters are unusable, is moved
        aside and the start is clean; a bad engine entry, override or history entry is dropped alone
        (the original file is copied aside) and the rest restored.
        """
        state = self.snapshots.load()
        if state is not None:
            problems: list[str] = []
            try:
                self._restore_from(state, problems)
            except (PolicyError, SnapshotError) as e:
                self.snapshots.quarantine(f"cannot be restored: {_oneline(str(e))}")
                self._engines.clear()
                self._version = self._fleet_version = 0
            else:
                for p in problems:
                    log.warning("snapshot %s: %s", self.snapshots.path, _oneline(p))
                if problems:
                    self.snapshots.keep_copy(f"{len(problems)} entries dropped on restore")
                return
        text, source = resolve_policy_text(self.config.default_policy)
        self._store = PolicyStore(default=parse_policy(text, source=source), source=source, clock=self.clock)

    def _restore_from(self, state: Mapping[str, Any], problems: list[str]) -> None:
        """Raises SnapshotError/PolicyError when the snapshot as a whole is unusable; appends a line
        to ``problems`` for each entry dropped."""
        self._store = PolicyStore.from_json(
            mapping_field(state, "policies", path="state"), clock=self.clock, problems=problems
        )
        saved = int_field(state, "directive_version", path="state", hi=MAX_COUNT - CRASH_VERSION_GAP)
        self._version = saved if state.get("clean") is True else saved + CRASH_VERSION_GAP
        self._fleet_version = int_field(state, "fleet_policy_version", path="state", default=0)
        engines = state.get("engines", {})
        if not isinstance(engines, Mapping):
            problems.append(
                f"state.engines: expected an object, got {type(engines).__name__}; no engine restored"
            )
            engines = {}
        for eid, e in engines.items():
            at = f"state.engines[{eid!r}]"
            try:
                self._engines[eid] = self._engine_from_json(eid, e, at)
            except (SnapshotError, PolicyError, TelemetryError, ValueError) as err:
                problems.append(f"{at}: {err}; engine dropped")
        log.info(
            "restored snapshot %s: policy %s revision %d, %d engines, directive version %d",
            self.snapshots.path,
            self._store.default.spec.name,
            self._store.default.revision,
            len(self._engines),
            self._version,
        )

    def _engine_from_json(self, eid: str, e: Any, at: str) -> EngineState:
        """One engine's saved state, checked like a Hello and a report. Raises SnapshotError,
        TelemetryError or ValueError."""
        if not isinstance(e, Mapping):
            raise SnapshotError(f"{at}: expected an object, got {type(e).__name__}")
        info = info_from_json(mapping_field(e, "info", path=at))
        if info.engine_id != eid:
            raise SnapshotError(f"{at}.info.engine_id: {info.engine_id!r} is not the entry's id")
        ls = mapping_field(e, "loop", path=at)
        totals = totals_from_json(mapping_field(ls, "totals", path=f"{at}.loop"), path=f"{at}.loop.totals")
        loop = self._new_loop(info)
        if ls.get("policy") == loop.spec.name:
            try:
                loop.load_state_dict(ls)
            except (ValueError, KeyError, TypeError, IndexError) as err:
                log.warning("engine %s: statistics not restored (%s); totals kept", eid, _oneline(str(err)))
                loop = self._new_loop(info)
        loop.totals = totals
        return EngineState(
            info,
            loop,
            rejected=int_field(e, "rejected", path=at, default=0),
            instance_id=str_field(e, "instance_id", path=at, max_len=MAX_INSTANCE_ID, default=""),
            last_sequence=int_field(e, "last_sequence", path=at, hi=MAX_SEQUENCE, default=0),
        )

    # -- background ------------------------------------------------------------------------------

    async def _run(self) -> None:
        self._last_snapshot_attempt = self._last_posteriors = self.clock()
        while True:
            await asyncio.sleep(self.config.decision_tick_s)
            try:
                self.tick()
                now = self.clock()
                if (
                    self.fleet is not None
                    and now - self._last_posteriors >= self.config.posteriors_interval_s
                ):
                    self._last_posteriors = now
                    self.publish_posteriors()
                if now - self._last_snapshot_attempt >= self.config.snapshot_interval_s:
                    self._last_snapshot_attempt = now
                    ok = await asyncio.to_thread(self.snapshots.save, self.state())
                    if not ok and self._reset_unsaveable():
                        ok = await asyncio.to_thread(self.snapshots.save, self.state())
                    self._snapshot_done(ok)
            except Exception:
                log.exception("sidecar tick failed; continuing")

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("sidecar background task died", exc_info=task.exception())

    def _bind(self, server: grpc.aio.Server, side: str) -> str:
        """Listen on the engine or admin address; a Unix socket gets ``engine_socket_mode``."""
        cfg = self.config
        listen = cfg.listen_address(side)
        addr = parse_address(listen, field=f"{side}_listen")
        if isinstance(addr, str):
            if len(addr.encode()) > MAX_UNIX_PATH:
                raise ConfigError(
                    f"socket path {addr} is longer than {MAX_UNIX_PATH} bytes; use a shorter path",
                    field=f"{side}_listen",
                )
            parent = Path(addr).parent
            if not parent.exists():
                parent.mkdir(parents=True, mode=0o700)
            remove_stale_socket(Path(addr), field=f"{side}_listen")
            target = f"unix://{addr}"
            # The socket is created by the bind: a tight umask closes the window before the chmod.
            old = os.umask(0o177)
            try:
                server.add_insecure_port(target)
            finally:
                os.umask(old)
            os.chmod(addr, cfg.engine_socket_mode)
            return target
        host, port = addr
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        cert = getattr(cfg, f"{side}_tls_cert_file")
        if cert:
            creds = server_credentials(
                cert_file=cert,
                key_file=getattr(cfg, f"{side}_tls_key_file"),
                client_ca_file=getattr(cfg, f"{side}_tls_client_ca_file"),
                field=side,
            )
            bound = server.add_secure_port(where, creds)
        else:
            bound = server.add_insecure_port(where)
        if bound == 0:
            raise OSError(f"cannot listen on {listen}")
        return _client_target(listen, bound)

    async def _close_servers(self) -> None:
        for server in (self._engine_server, self._admin_server):
            if server is not None:
                await server.stop(grace=0.5)
        self._engine_server = self._admin_server = None
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
