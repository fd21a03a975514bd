"""The sidecar's registry and decisions: engines attach, their telemetry feeds one ControlLoop each,
directives go back on their streams; policies are set, rolled back and written through.

``Sidecar`` holds the state (policies, engines, the directive version counter) and binds nothing: it
is built and driven in-process (``open``, ``attach``, ``ingest``, ``tick``, ``set_policy``, ``close``),
which is what ``controller.server.SidecarServer`` does from its gRPC services and background task.
What must hold: every directive version is strictly greater than any sent before (also across a
restart); a policy change, with the fresh loops it gives engines, is on disk before it is
acknowledged; one engine's broken loop is reset alone and never breaks status, snapshots or other
engines; the registry never grows past ``max_engines``; a cleared fleet policy takes the engines that
follow the default back to the sidecar's own policy, written through like any policy change.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

import controller
from controller.config import SidecarConfig
from controller.fleet import CLEARED_DIGEST, FleetLink, policy_digest
from controller.limits import ReportLimit, TokenBucket
from controller.metrics import SidecarMetrics
from controller.policy_store import PolicyNotSaved, PolicyRecord, PolicyStore
from controller.snapshot import SnapshotStore
from controller.state import (
    SavedEngine,
    load_state,
    oneline,
    report_problems,
    state_to_json,
)
from controller.state_dir import StateDirLock
from controller.streams import EngineStreams, Session, StreamEnd, put_latest
from controller.v1 import controller_pb2 as pb
from controller.validation import (
    Limits,
    TelemetryError,
    batch_request_steps,
    check_batch_header,
    parse_policy_checked,
    read_batch,
)
from controller.wire.convert import arm_to_pb, directive_to_pb
from controller.wire.link import RefusalLog
from policies.arms import Arm
from policies.classes import DEFAULT_CLASS, MAX_CLASSES_PER_ENGINE, ClassBound
from policies.directive import Directive
from policies.engine import EngineInfo
from policies.loop import ControlLoop, Totals, engine_seed
from policies.observation import StepBatch, StepObservation
from policies.presets import resolve_policy_text
from policies.spec import PolicyError, PolicySpec

log = logging.getLogger(__name__)

#: Contexts listed per engine in status (each is one class x batch bucket it learned about).
MAX_STATUS_CONTEXTS = 256
WATCH_QUEUE = 256
#: Bursts of policy changes allowed before ``max_policy_changes_per_s`` applies.
POLICY_CHANGE_BURST = 10.0


#: The source a fleet policy is set under (``fleet v7``): what tells the fleet's revisions of the
#: default policy from the sidecar's own when the fleet's policy is cleared.
_FLEET_SOURCE = re.compile(r"fleet v[0-9]+")


def fleet_source(version: int) -> str:
    return f"fleet v{version}"


def is_fleet_source(source: str) -> bool:
    return _FLEET_SOURCE.fullmatch(source) is not None


def _seeded_loop(info: EngineInfo, spec: PolicySpec) -> ControlLoop:
    """An engine's fresh loop, its generator seeded from the policy's seed and the engine's id: engines
    of one policy (here or on other replicas, fleet warm-started from one donor or not) draw numbers
    of their own, and the same engine draws the same ones on every run."""
    return ControlLoop(spec=spec, engine=info, seed=engine_seed(spec.seed, info.engine_id))


def engine_report_limit(config: SidecarConfig, *, clock: Callable[[], float] = time.monotonic) -> ReportLimit:
    """An engine's report budget under ``config``: ``max_engine_steps_per_s`` and
    ``max_engine_request_steps_per_s``, each with ``telemetry_burst_s`` of it saved up, and at least
    one whole batch the sidecar takes (a batch larger than the burst would be refused for good)."""
    burst_s = config.telemetry_burst_s
    steps, rows = config.max_engine_steps_per_s, config.max_engine_request_steps_per_s
    largest = config.max_steps_per_batch
    return ReportLimit(
        steps=TokenBucket(rate=steps, burst=max(steps * burst_s, float(largest)), clock=clock),
        request_steps=TokenBucket(
            rate=rows, burst=max(rows * burst_s, float(largest * config.max_requests_per_step)), clock=clock
        ),
    )


class FleetPolicyLimited(RuntimeError):
    """A fleet policy came while ``max_policy_changes_per_s`` was spent (the fleet link retries it)."""


@dataclass(eq=False, slots=True)
class EngineState:
    info: EngineInfo
    loop: ControlLoop
    #: Its open streams and the report sequences of the instance that sends on them.
    link: EngineStreams = field(default_factory=EngineStreams)
    #: The sidecar-stamped directive last sent (None until the engine first attaches).
    directive: Directive | None = None
    loop_version: int = -1
    sent_at: float = 0.0
    rejected: int = 0
    last_seen: float = 0.0
    #: Its report budget (steps and request-steps per second; ``engine_report_limit``).
    report_limit: ReportLimit | None = None
    #: The engine said it cannot apply directives (an observe-only adapter): status shows them as
    #: recommendations.
    observe_only: bool = False
    #: Traffic classes learned per context (at most MAX_CLASSES_PER_ENGINE, "default" among them),
    #: and the steps whose other classes were pooled into "default" (the simulator's rule too).
    class_bound: ClassBound = field(default_factory=ClassBound)
    #: Hello.plugin_mode of the last attach ("" when the engine is not the vLLM plugin).
    plugin_mode: str = ""
    #: Its rate-limited batches are logged by the engine links' rule (one line per ``REFUSED_LOG_S``,
    #: the next counting those refused meanwhile; the metric counts each): its stream stays up, so a
    #: line per batch let an engine over the limit write the sidecar's log as fast as it sent.
    limited_log: RefusalLog = field(default_factory=lambda: RefusalLog(time.monotonic))

    @property
    def connected(self) -> bool:
        return self.link.connected

    @property
    def classes(self) -> set[str]:
        return self.class_bound.known

    @property
    def classes_pooled(self) -> int:
        return self.class_bound.pooled_steps

    @property
    def instance_id(self) -> str:
        return self.link.instance_id

    @property
    def last_sequence(self) -> int:
        return self.link.last_sequence

    @last_sequence.setter
    def last_sequence(self, value: int) -> None:
        self.link.last_sequence = value

    def saved(self) -> SavedEngine:
        return SavedEngine(
            info=self.info,
            loop=self.loop.state_dict(),
            totals=self.loop.totals,
            rejected=self.rejected,
            instance_id=self.link.instance_id,
            last_sequence=self.link.last_sequence,
            classes=tuple(self.classes),
        )


EngineSession = Session[EngineState]
#: An engine's streams, its instance and the report sequence a snapshot being written holds.
DurableMark = tuple[EngineStreams, str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Collected:
    """A state collected for a snapshot: the JSON, what it makes durable, and its number (later
    collections are newer; an older one is never written over a newer one)."""

    state: dict[str, Any]
    marks: list[DurableMark]
    generation: int


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
        self._started_at = 0.0
        #: The fleet link (None when ``mqtt_url`` is empty; the server starts it) and the version of
        #: the fleet policy applied.
        self.fleet: FleetLink | None = None
        self._fleet_version = 0
        #: SHA-256 of the applied fleet policy's YAML ("" = unknown), saved with its version so that a
        #: same-numbered but different policy after a restart (a broker that lost its retained copy
        #: numbers from 1 again) is told apart from the retained copy of the one applied.
        self._fleet_digest = ""
        #: model -> (engine, learned state) of the posteriors last shared.
        self._shared: dict[str, tuple[str, dict[str, Any]]] = {}
        self._lock: StateDirLock | None = None
        #: Snapshot states collected so far (numbers them).
        self._generation = 0
        #: Called with (engine id, steps) for every applied batch (``serve --record-steps``).
        self.step_sink: Callable[[str, Sequence[StepObservation]], None] | None = None

    # -- public surface --------------------------------------------------------------------------

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

    def open(self) -> None:
        """Take the state directory and restore the snapshot. Raises StateDirLocked/OSError."""
        self._started_at = self.clock()
        self._lock = StateDirLock.acquire(Path(self.config.state_dir))
        try:
            self._restore()
        except BaseException:
            self._release_lock()
            raise
        # The file must stop saying where the version counter was before anything is issued: a clean
        # snapshot restores its exact counter, and one of a crash its counter past the gap; left as
        # it is, a kill -9 before the next periodic snapshot would issue the same versions again at
        # the start after it (engines drop a version they have seen as stale).
        if not self.save_snapshot():
            log.warning("the state could not be written at start; a crash before the next snapshot may "
                        "issue directive versions again")  # fmt: skip

    def end_streams(self) -> None:
        """Tell every open stream to end (the engines reconnect to whoever serves next)."""
        for st in self._engines.values():
            st.link.push(StreamEnd())

    def close(self, *, snapshot: bool = True) -> None:
        """Write the final (clean) snapshot and let go of the state directory."""
        if snapshot and self._store is not None:
            self.save_snapshot(clean=True)
        self._release_lock()

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    # -- engines (called by EngineService) -------------------------------------------------------

    def attach(
        self, info: EngineInfo, *, instance_id: str = "", observe_only: bool = False, plugin_mode: str = ""
    ) -> EngineSession:
        """A new stream for ``info``. Raises TelemetryError when the sidecar holds too many engines, when
        another engine process holds this engine id on an open stream, or when the engine's batches
        may hold more requests than this sidecar takes in a step."""
        most = self.limits.max_requests_per_step
        if info.max_batch_size > most:
            # Attached, its first full step would have its whole report batch refused and its stream
            # ended, and so on at every reconnect: said once here, where the operator can act on it.
            raise TelemetryError(
                "max_batch_size_over_limit",
                f"hello.max_batch_size: the engine runs up to {info.max_batch_size} requests a step, more "
                f"than this sidecar's max_requests_per_step ({most}) takes in a report; raise "
                f"max_requests_per_step in the sidecar's config to at least {info.max_batch_size}",
            )
        st = self._engines.get(info.engine_id)
        now = self.clock()
        if st is not None and st.link.connected:
            held = st.link.instance_id
            # Two processes under one id would reset each other's sequences (and one would be acked
            # for the other's batches): the second waits until the first's streams end (a restarted
            # engine retries while its predecessor's stream closes). Where either side names no
            # instance (an older engine), only its description can tell: another one would replace
            # the loop the open stream feeds and have that stream's next report refused.
            if (instance_id and held not in ("", instance_id)) or (
                (not instance_id or not held) and st.info != info
            ):
                raise TelemetryError(
                    "engine_id_in_use",
                    f"engine id {info.engine_id!r} is attached by another engine process "
                    f"({f'instance {held}' if held else 'another description'}); give each engine its "
                    "own id (SPECCONTROL_ENGINE_ID)",
                )
        if st is not None:  # a stream over the bound changes nothing (description, loop, last seen)
            st.link.check_room()
        if st is None:
            self._make_room()
            st = self._engines[info.engine_id] = EngineState(info, self._warm_loop(info))
        elif st.info != info:
            log.info("engine %s reattached with a different description: new control loop", info.engine_id)
            old = st.loop.totals
            st.info, st.loop, st.loop_version = info, self._new_loop(info), -1
            st.loop.totals = old
        if st.report_limit is None:
            st.report_limit = engine_report_limit(self.config)
        st.last_seen = now
        st.observe_only = observe_only
        st.plugin_mode = plugin_mode
        q = st.link.open(instance_id)
        try:
            before = st.directive
            try:
                self._decide(st, now)
            except Exception:  # a restored or fleet-warmed loop that cannot decide: as in tick_engine
                log.exception("engine %s: decision failed at attach", info.engine_id)
                self._reset_loop(st, "its decision failed")
                self._decide(st, now)
        except BaseException:
            st.link.close(q)  # a refused stream must not leave the engine shown as connected
            raise
        self.metrics.set_connected(info.engine_id, True)
        if st.directive is not None and st.directive is before:
            put_latest(q, st.directive)  # nothing new for the others: this stream still needs one
        log.info(
            "engine %s attached (%s, max_k %d%s%s)",
            info.engine_id,
            info.model,
            info.max_k,
            f", instance {instance_id}, acked {st.last_sequence}" if instance_id else "",
            f", plugin mode: {plugin_mode}" if plugin_mode else "",
        )
        return Session(st, st.link, q, instance_id=instance_id)

    def _make_room(self) -> None:
        """At ``max_engines``, forget the engines unheard longest; refuse when all are connected.

        The registry can hold more than ``max_engines`` (a snapshot restored under a lowered limit):
        as many idle ones go as bring it back under the limit, so it shrinks to it, not stays above.
        """
        excess = len(self._engines) - self.config.max_engines + 1
        if excess <= 0:
            return
        idle = [st for st in self._engines.values() if not st.connected]
        if len(idle) < excess:
            raise TelemetryError(
                "too_many_engines", f"hello: the sidecar already serves {self.config.max_engines} engines"
            )
        idle.sort(key=lambda st: st.last_seen)
        for gone in idle[:excess]:
            del self._engines[gone.info.engine_id]
            self.metrics.forget_engine(gone.info.engine_id)
            log.warning(
                "engine %s forgotten to make room (max_engines %d)",
                gone.info.engine_id,
                self.config.max_engines,
            )

    def _warm_loop(self, info: EngineInfo) -> ControlLoop:
        """A new engine's loop, loaded with the statistics the fleet shared for its model if they fit.

        Only the learned tables are taken (``ControlLoop.load_learned``): the counters, the round in
        progress, the dwell timers and the directive in force describe the other engine's traffic.
        """
        loop = self._new_loop(info)
        shared = self.fleet.latest_posteriors(info.model) if self.fleet is not None else None
        if not shared or shared.get("policy") != loop.spec.name:
            return loop
        try:
            loop.load_learned(shared)
        except (ValueError, KeyError, TypeError) as e:
            # Another arm set or state version; a partial load must not be left behind.
            log.info("engine %s: fleet posteriors for %s not used: %s", info.engine_id, info.model, e)
            return self._new_loop(info)
        loop.totals = Totals()
        log.info("engine %s: warm start from the fleet's posteriors for %s", info.engine_id, info.model)
        return loop

    def detach(self, session: EngineSession) -> None:
        st = session.engine
        st.link.close(session.queue)
        # Heard until its stream closed (an engine without traffic sends nothing for hours): the
        # eviction order is by when an engine went idle, not by its last Hello or report.
        st.last_seen = self.clock()
        self.metrics.set_connected(st.info.engine_id, st.connected)
        log.info("engine %s detached", st.info.engine_id)

    def ingest(self, session: EngineSession, batch: pb.StepReportBatch) -> None:
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
        lost = session.sequences.admit(batch.sequence)
        if lost is None:
            self.metrics.duplicates.labels(eid).inc()
            return
        if lost:
            self.metrics.lost_batches.labels(eid).inc(lost)
        st.last_seen = self.clock()
        limit = st.report_limit
        over = (
            limit.take(len(batch.steps), batch_request_steps(batch, self.limits)) if limit is not None else ""
        )
        if over:
            # Refused without ending the stream: a reconnect would only bring the same flood back.
            self._rate_limited(st, over)
            return
        try:
            steps = read_batch(batch, st.info, self.limits)
        except TelemetryError as e:
            self.reject(st, e)
            raise
        if batch.dropped_steps:
            self.metrics.engine_dropped.labels(eid).inc(batch.dropped_steps)
        steps = self._bound_classes(st, steps)
        st.loop.observe(steps)
        self.metrics.observe(eid, steps)
        if self.step_sink is not None:
            self.step_sink(eid, steps.steps)

    def _bound_classes(self, st: EngineState, batch: StepBatch) -> StepBatch:
        """The steps with every traffic class beyond the engine's first ``MAX_CLASSES_PER_ENGINE``
        pooled into ``default`` (``policies.classes``: each class is a context, and an engine naming a
        new one on every step must not grow them without bound); said once per engine."""
        before = st.class_bound.pooled_steps
        batch = st.class_bound.apply(batch)
        if st.class_bound.pooled_steps and not before:
            log.warning(
                "engine %s: more than %d traffic classes; further ones are pooled into %r",
                st.info.engine_id,
                MAX_CLASSES_PER_ENGINE,
                DEFAULT_CLASS,
            )
        return batch

    def reject(self, st: EngineState | None, e: TelemetryError, *, logged: bool = True) -> None:
        self.metrics.rejected.labels(e.reason).inc()
        if st is not None:
            st.rejected += 1
        if logged:
            log.warning(
                "rejected telemetry%s: %s: %s", f" from {st.info.engine_id}" if st else "", e.reason, e
            )

    def _rate_limited(self, st: EngineState, over: str) -> None:
        """A batch over the engine's rate (``over``: "steps" or "request_steps") refused: counted,
        logged by ``st.limited_log``'s rule."""
        if over == "steps":
            e = TelemetryError(
                "rate_limited",
                f"reports: over {self.config.max_engine_steps_per_s:g} steps/s (max_engine_steps_per_s)",
            )
        else:
            e = TelemetryError(
                "rate_limited_request_steps",
                f"reports: over {self.config.max_engine_request_steps_per_s:g} request-steps/s "
                "(max_engine_request_steps_per_s)",
            )
        line = st.limited_log.line(e)
        self.reject(st, e, logged=False)
        if line is not None:
            log.warning("rejected telemetry from %s: %s: %s", st.info.engine_id, e.reason, line)

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
        """Parse, check every affected engine can run it, write it through, then switch. Raises
        PolicyError, or PolicyNotSaved (nothing changed)."""
        spec = parse_policy_checked(yaml_text, source=source or "<policy>")
        overrides = self.policy_store.overrides()
        if engine_id and engine_id not in overrides and len(overrides) >= self.config.max_engines:
            raise PolicyError(
                f"at most {self.config.max_engines} engines (max_engines) may have a policy of their own",
                source=source or "<policy>",
            )
        affected = self._affected(engine_id)
        loops = {eid: self._loop_for(self._engines[eid].info, spec) for eid in affected}
        rec = self._durably(
            lambda: self.policy_store.set_spec(spec, source=source or "<policy>", engine_id=engine_id),
            lambda: loops,
        )
        log.info("policy %s (revision %d) set for %s", spec.name, rec.revision, engine_id or "all engines")
        return rec

    def _durably(
        self, change: Callable[[], PolicyRecord], new_loops: Callable[[], Mapping[str, ControlLoop]]
    ) -> PolicyRecord:
        """Make a policy change in the store, give the engines it affects ``new_loops()`` (built after
        the change) and write both through before anything acts on them (the change must survive a
        kill -9 right after it is acknowledged, fresh loops included: written with the old loops, the
        restart loaded their statistics into the new policy where it bore the old one's name). Then
        the connected ones decide. When the write fails, the store and the loops are as they were and
        PolicyNotSaved says why: a change that is not on disk is not made."""
        before = self.policy_store.copy()
        rec = change()
        try:
            loops = new_loops()
        except BaseException:
            self._store = before
            raise
        old = {eid: (self._engines[eid].loop, self._engines[eid].loop_version) for eid in loops}
        for eid, loop in loops.items():
            st = self._engines[eid]
            loop.totals = st.loop.totals
            st.loop, st.loop_version = loop, -1
        if not self.save_snapshot():
            self._store = before
            for eid, (loop, version) in old.items():
                self._engines[eid].loop, self._engines[eid].loop_version = loop, version
            why = self.snapshots.last_error or "see the sidecar's log"
            log.error("policy change refused: the state could not be written (%s)", why)
            raise PolicyNotSaved(
                f"policy not changed: the state could not be written to {self.snapshots.path}: {why}"
            )
        now = self.clock()
        for eid in loops:
            if self._engines[eid].connected:
                self._decide(self._engines[eid], now)
        return rec

    def _on_fleet_policy(self, yaml_text: str, version: int) -> None:
        """A newer fleet policy arrived: switch like a local SetPolicy. A PolicyError refuses it (for
        good); PolicyNotSaved or FleetPolicyLimited refuse it for now (the fleet link tries again)."""
        self._spend_fleet_change()
        with self._fleet_version_held(version, policy_digest(yaml_text)):
            self.set_policy(yaml_text, source=fleet_source(version))  # writes the new version through

    def _on_fleet_policy_cleared(self, version: int) -> None:
        """The fleet's policy was cleared (``controllerctl policy clear --fleet``; ``version`` is the
        clear's): engines without an override go back to the sidecar's local policy, the newest
        revision of its default that the fleet did not set (``controllerctl policy set`` here, or
        ``default_policy`` when its history holds none), as a new revision written through. When the
        default in force is not the fleet's (a local set or rollback since), nothing changes but
        the version kept. Refused like a fleet policy: a PolicyError for good; PolicyNotSaved or
        FleetPolicyLimited for now (the fleet link tries again)."""
        current = self.policy_store.default
        if not is_fleet_source(current.source):
            # (the digest a clear is known by: its retained copy is not applied again after a restart)
            self._fleet_version, self._fleet_digest = version, CLEARED_DIGEST
            log.info("fleet policy cleared (v%d); the local policy %s stays", version, current.spec.name)
            return
        self._spend_fleet_change()
        with self._fleet_version_held(version, CLEARED_DIGEST):
            yaml_text, source = self._local_default()
            rec = self.set_policy(yaml_text, source=source)  # writes the clear's version through
        log.info(
            "fleet policy cleared (v%d): back to the local policy %s from %s", version, rec.spec.name, source
        )

    def _spend_fleet_change(self) -> None:
        """Spend one of the admin changes' budget on a fleet policy or clear (a flood of them must not
        rebuild every loop and write the state at the publisher's pace); FleetPolicyLimited when spent."""
        if not self.policy_changes.take():
            raise FleetPolicyLimited(
                f"policy changes are limited to {self.config.max_policy_changes_per_s:g}/s"
            )

    @contextlib.contextmanager
    def _fleet_version_held(self, version: int, digest: str) -> Iterator[None]:
        """The fleet's version and digest are ``version`` and ``digest`` while the change inside is
        written through (the snapshot saves them with it); the ones before if it fails."""
        before = self._fleet_version, self._fleet_digest
        self._fleet_version, self._fleet_digest = version, digest
        try:
            yield
        except BaseException:
            self._fleet_version, self._fleet_digest = before
            raise

    def _local_default(self) -> tuple[str, str]:
        """The sidecar's own default policy (YAML, source): the newest revision the fleet did not set,
        else ``default_policy`` (a history of fleet policies only, or one they pushed out)."""
        for rec in self.policy_store.history():
            if not is_fleet_source(rec.source):
                return rec.yaml, rec.source
        return resolve_policy_text(self.config.default_policy)

    @property
    def fleet_policy_version(self) -> int:
        """The version of the last fleet policy applied here (0: none)."""
        return self._fleet_version

    @property
    def fleet_policy_digest(self) -> str:
        """SHA-256 of the last fleet policy applied here ("" = none, or unknown)."""
        return self._fleet_digest

    def rollback_policy(self, engine_id: str = "") -> PolicyRecord:
        """Raises NoPreviousPolicy, or PolicyNotSaved (nothing changed)."""
        affected = self._affected(engine_id)
        rec = self._durably(
            lambda: self.policy_store.rollback(engine_id),
            lambda: {eid: self._new_loop(self._engines[eid].info) for eid in affected},
        )
        log.info(
            "policy rolled back to %s (revision %d) for %s", rec.spec.name, rec.revision, engine_id or "all"
        )
        return rec

    def _affected(self, engine_id: str) -> list[str]:
        if engine_id:
            return [engine_id] if engine_id in self._engines else []
        overridden = self.policy_store.overrides()
        return [e for e in self._engines if e not in overridden]

    def _loop_for(self, info: EngineInfo, spec: PolicySpec) -> ControlLoop:
        try:
            return _seeded_loop(info, spec)
        except ValueError as e:
            raise PolicyError(f"engine {info.engine_id!r}: {e}", source=spec.name) from None

    def _new_loop(self, info: EngineInfo) -> ControlLoop:
        return _seeded_loop(info, self.policy_store.effective(info.engine_id).spec)

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
            self.tick_engine(st, now)

    def tick_engine(self, st: EngineState, now: float) -> bool:
        """``tick`` for one engine (nothing when it is not connected). True when its loop ran a
        decision round (the costly part of a tick: a server yields to its streams after one)."""
        if not st.connected:
            return False
        rounds = st.loop.rounds
        try:
            self._decide(st, now)
        except Exception:
            log.exception("engine %s: decision failed; keeping its last directive", st.info.engine_id)
            self._reset_loop(st, "its decision failed")
            return True
        return st.loop.rounds != rounds

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
                    "bounded_move": t.bounded_moves,
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
            st.link.push(st.directive)
            self._notify(st)
            self._publish_state(st, arms)
        elif now - st.sent_at >= st.directive.ttl_s / 3 or (
            st.link.ack_pending and now - st.sent_at >= self.config.ack_interval_s
        ):
            # A refresh keeps the TTL from lapsing and tells the engine which batches it may forget.
            st.sent_at = now
            st.link.push(st.directive)

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
                put_latest(q, msg)

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
            fleet=self._fleet_status(),
        )

    def _fleet_status(self) -> pb.FleetLinkStatus | None:
        if self.fleet is None:
            return None
        return pb.FleetLinkStatus(
            fleet=self.fleet.topics.fleet,
            node_id=self.fleet.node_id,
            broker=self.fleet.broker.describe(),
            connected=self.fleet.connected,
            policy_version=self._fleet_version,
            policy_cleared=self._fleet_version > 0 and self._fleet_digest == CLEARED_DIGEST,
        )

    def engine_page(self, offset: int, limit: int, after: str = "") -> tuple[list[pb.EngineStatus], int]:
        """Engines by id from ``offset`` (or, where ``after`` is given, from the first id after it): at
        most ``limit`` (0: no count limit), and no more than fit a quarter of the message size limit.
        Returns them and the next page's offset (0: no more)."""
        ids = sorted(self._engines)
        if after:
            offset = bisect.bisect_right(ids, after)
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
        return self._collect(clean=clean).state

    def _collect(self, *, clean: bool = False) -> Collected:
        """The state to write, numbered, and per engine the sequence it covers (durable once written)."""
        engines: dict[str, SavedEngine] = {}
        marks: list[DurableMark] = []
        for eid, st in self._engines.items():
            e = engines[eid] = st.saved()
            marks.append((st.link, e.instance_id, e.last_sequence))
        state = state_to_json(
            policies=self.policy_store,
            directive_version=self._version,
            fleet_policy_version=self._fleet_version,
            fleet_policy_digest=self._fleet_digest,
            engines=engines,
            clean=clean,
        )
        self._generation += 1
        return Collected(state=state, marks=marks, generation=self._generation)

    def _write(self, c: Collected) -> bool:
        return self.snapshots.save(c.state, generation=c.generation)

    def save_snapshot(self, *, clean: bool = False) -> bool:
        """Write the state now (on the caller's thread). False when it could not be written."""
        try:
            c = self._collect(clean=clean)
        except Exception:
            log.exception("snapshot: could not collect the state")
            return self._snapshot_done(False, [])
        ok = self._write(c)
        if not ok and self._reset_unsaveable():
            c = self._collect(clean=clean)
            ok = self._write(c)
        return self._snapshot_done(ok, c.marks)

    async def save_snapshot_async(self) -> bool:
        """``save_snapshot`` with the write on a worker thread (the state is collected here). A policy
        change written through meanwhile is newer: this older state is then not written over it."""
        c = self._collect()
        ok = await asyncio.to_thread(self._write, c)
        if not ok and self._reset_unsaveable():
            c = self._collect()
            ok = await asyncio.to_thread(self._write, c)
        return self._snapshot_done(ok, c.marks)

    def _snapshot_done(self, ok: bool, marks: Sequence[DurableMark]) -> bool:
        """After a snapshot write: what it holds may now be acknowledged to the engines."""
        if ok:
            self.metrics.last_snapshot.set(self.snapshots.last_saved_s)
            for link, instance_id, sequence in marks:
                link.saved(instance_id, sequence)
        else:
            self.metrics.snapshot_failures.inc()
        return ok

    def unsaved_batches(self) -> bool:
        """Some engine instance has batches applied that no written snapshot holds (its acknowledgement
        waits for the next snapshot)."""
        return any(st.link.unsaved for st in self._engines.values())

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

        A file that is not a snapshot, or whose default policy record or counters are unusable, is
        moved aside and the start is clean; a bad engine entry, override or history entry is dropped
        alone (the original file is copied aside) and the rest restored, and so is a default policy
        document this version refuses (a rule added since): the configured one serves instead, and
        the engines, counters and version counter are kept, not moved aside with it.
        """
        saved = load_state(self.snapshots, clock=self.clock, fallback=self.config.load_default_policy)
        if saved is None:
            default, source = self.config.load_default_policy()
            self._store = PolicyStore(default=default, source=source, clock=self.clock)
            return
        self._store = saved.policies
        self._version = saved.directive_version
        self._fleet_version = saved.fleet_policy_version
        self._fleet_digest = saved.fleet_policy_digest
        for eid, e in saved.engines.items():
            try:
                self._engines[eid] = self._engine_from_saved(e)
            except (PolicyError, ValueError) as err:
                saved.problems.append(f"state.engines[{eid!r}]: {err}; engine dropped")
        log.info(
            "restored snapshot %s: policy %s revision %d, %d engines, directive version %d",
            self.snapshots.path,
            self._store.default.spec.name,
            self._store.default.revision,
            len(self._engines),
            self._version,
        )
        report_problems(self.snapshots, saved.problems)

    def _engine_from_saved(self, e: SavedEngine) -> EngineState:
        """An engine's restored state: its loop's statistics when its policy is still the one saved,
        its counters always. Raises ValueError when the engine cannot run its policy."""
        loop = self._new_loop(e.info)
        if e.loop.get("policy") == loop.spec.name:
            try:
                loop.load_state_dict(e.loop)
            except (ValueError, KeyError, TypeError, IndexError) as err:
                log.warning(
                    "engine %s: statistics not restored (%s); totals kept",
                    e.info.engine_id,
                    oneline(str(err)),
                )
                loop = self._new_loop(e.info)
        loop.totals = e.totals
        return EngineState(
            e.info,
            loop,
            link=EngineStreams(
                instance_id=e.instance_id, last_sequence=e.last_sequence, durable_sequence=e.last_sequence
            ),
            rejected=e.rejected,
            # The classes it named before count against its bound after a restart too.
            class_bound=ClassBound(known=set(e.classes)),
        )
