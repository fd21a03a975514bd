"""The sidecar's Prometheus metrics, on an injected registry, and the ``/metrics`` HTTP endpoint.

Token counters and everything derived from them (acceptance rate, mean accepted per step, recent
goodput, queue wait, current arms, directive age) come from one custom collector that keeps the raw
sums and computes ratios at scrape time, so a ratio can never disagree with its counters.

What must hold: the per-engine gauges (goodput, queue wait and length, current arms, directive version
and age) are exported only while the engine is connected; every per-engine series goes with its
engine (``forget_engine``), so unique engine ids cannot grow ``/metrics`` without bound; label values
carry no control characters; the endpoint serves no ``*_created`` series (a view of the registry
without them, not a process-wide switch); goodput is the tokens of measured steps over their time
(a step reported with ``duration_s`` 0 was not measured: its tokens have no time to go over), and
absent while no recent step was measured, never a 0 or an infinity that was not observed.
"""

from __future__ import annotations

import contextlib
import platform
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

import controller
from controller.validation import PROTOCOL_VERSIONS
from controller.wire.names import escape_text
from policies.arms import METHODS_BY_CODE, Arm
from policies.observation import StepBatch

PREFIX = "speccontrol"
#: Steps kept per engine for the recent goodput and queue-wait figures.
RECENT_STEPS = 256
#: Decision-round latency buckets (seconds): the target is a p99 under 5 ms.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Engine-labelled counters and gauges (each removed with its engine).
_ENGINE_SERIES = ("decisions", "switches", "duplicates", "lost_batches", "engine_dropped")


@dataclass(slots=True)
class _Engine:
    #: (method, k) -> [drafted, accepted, emitted, request_steps]
    by_arm: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    steps: int = 0
    recent: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    queue_length: int = 0
    connected: bool = False
    arms: dict[str, Arm] = field(default_factory=dict)
    directive_version: int = 0
    directive_issued_at: float | None = None
    #: The control loop's safety events by kind (drift alarm, held by margin, ...), lifetime.
    guards: dict[str, int] = field(default_factory=dict)


def _goodput(recent: Iterable[tuple[int, float, float]]) -> float | None:
    """Emitted tokens per second of engine time over the measured steps of ``recent`` (None: none
    measured). An unmeasured step's tokens are left out with it: counted over the others' time they
    would inflate the figure by as much as the engine leaves unmeasured."""
    tokens = busy = 0.0
    for emitted, duration, _ in recent:
        if duration > 0:
            tokens += emitted
            busy += duration
    return tokens / busy if busy > 0 else None


class _TelemetryCollector(Collector):
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.engines: dict[str, _Engine] = {}

    def engine(self, engine_id: str) -> _Engine:
        e = self.engines.get(engine_id)
        if e is None:
            e = self.engines[engine_id] = _Engine()
        return e

    def collect(self) -> Iterable[Metric]:
        p = PREFIX
        labels = ["engine", "method", "k"]
        drafted = CounterMetricFamily(f"{p}_drafted_tokens", "Draft tokens verified.", labels=labels)
        accepted = CounterMetricFamily(f"{p}_accepted_tokens", "Draft tokens accepted.", labels=labels)
        emitted = CounterMetricFamily(
            f"{p}_emitted_tokens", "Tokens emitted (accepted + 1 per request-step).", labels=labels
        )
        rsteps = CounterMetricFamily(f"{p}_request_steps", "Request-steps reported.", labels=labels)
        rate = GaugeMetricFamily(
            f"{p}_acceptance_rate", "Accepted / drafted tokens, lifetime.", labels=labels
        )
        mean = GaugeMetricFamily(
            f"{p}_mean_accepted_per_step", "Accepted tokens per request-step, lifetime.", labels=labels
        )
        steps = CounterMetricFamily(f"{p}_engine_steps", "Engine steps reported.", labels=["engine"])
        goodput = GaugeMetricFamily(
            f"{p}_goodput_tokens_per_second",
            f"Emitted tokens per second of engine time over the last {RECENT_STEPS} steps.",
            labels=["engine"],
        )
        qwait = GaugeMetricFamily(
            f"{p}_queue_wait_seconds",
            f"Mean queue wait reported over the last {RECENT_STEPS} steps.",
            labels=["engine"],
        )
        qlen = GaugeMetricFamily(
            f"{p}_queue_length", "Waiting requests after the last step.", labels=["engine"]
        )
        arm = GaugeMetricFamily(
            f"{p}_current_arm",
            "1 for the arm each context currently plays.",
            labels=["engine", "context", "method", "k"],
        )
        cur_k = GaugeMetricFamily(
            f"{p}_current_k", "Draft length each context currently plays.", labels=["engine", "context"]
        )
        version = GaugeMetricFamily(
            f"{p}_directive_version", "Version of the engine's current directive.", labels=["engine"]
        )
        age = GaugeMetricFamily(
            f"{p}_directive_age_seconds",
            "Seconds since the engine's current directive was issued.",
            labels=["engine"],
        )
        connected = GaugeMetricFamily(f"{p}_engines_connected", "Engines with an open stream.")
        guards = CounterMetricFamily(
            f"{p}_policy_guard_events",
            "Control-loop safety events: drift alarms, switches held by the margin, exploration denied "
            "by the high-load budget, p99 TPOT guard trips, moves the cost model could not price yet "
            "cut short.",
            labels=["engine", "guard"],
        )
        now = self.clock()
        n_connected = 0
        with self.lock:
            for raw_id, e in sorted(self.engines.items()):
                eid = escape_text(
                    raw_id
                )  # checked at the edge; a label must hold no control character anyway
                for (m, k), (d, a, em, n) in sorted(e.by_arm.items()):
                    lv = [eid, m, str(k)]
                    drafted.add_metric(lv, d)
                    accepted.add_metric(lv, a)
                    emitted.add_metric(lv, em)
                    rsteps.add_metric(lv, n)
                    if d:
                        rate.add_metric(lv, a / d)
                    if n:
                        mean.add_metric(lv, a / n)
                steps.add_metric([eid], e.steps)
                for g, v in sorted(e.guards.items()):
                    guards.add_metric([eid, g], v)
                if not e.connected:
                    # The gauges below describe an engine as it is now: a detached one's last values
                    # would go on driving what scales on them (the fleet's max queue wait) while it
                    # is down. Its counters above stay (they only grow).
                    continue
                n_connected += 1
                if e.recent:
                    if (gp := _goodput(e.recent)) is not None:
                        goodput.add_metric([eid], gp)
                    qwait.add_metric([eid], sum(r[2] for r in e.recent) / len(e.recent))
                qlen.add_metric([eid], e.queue_length)
                for raw_ctx, a_ in sorted(e.arms.items()):
                    ctx = escape_text(raw_ctx)
                    arm.add_metric([eid, ctx, a_.method.value, str(a_.k)], 1.0)
                    cur_k.add_metric([eid, ctx], a_.k)
                if e.directive_issued_at is not None:
                    version.add_metric([eid], e.directive_version)
                    age.add_metric([eid], max(0.0, now - e.directive_issued_at))
        connected.add_metric([], n_connected)
        yield from (drafted, accepted, emitted, rsteps, rate, mean, steps, goodput, qwait, qlen)
        yield from (arm, cur_k, version, age, connected, guards)


class SidecarMetrics:
    """Everything the sidecar exports. Thread-safe: scrapes run on the HTTP server's thread."""

    def __init__(self, *, registry: CollectorRegistry, clock: Callable[[], float]) -> None:
        self.registry = registry
        self._t = _TelemetryCollector(clock)
        registry.register(self._t)
        p = PREFIX
        self.decisions = Counter(f"{p}_decisions", "Decision rounds run.", ["engine"], registry=registry)
        self.switches = Counter(f"{p}_switches", "Context arm changes.", ["engine"], registry=registry)
        self.rejected = Counter(
            f"{p}_rejected_telemetry", "Engine messages rejected, by reason.", ["reason"], registry=registry
        )
        self.duplicates = Counter(
            f"{p}_duplicate_reports",
            "Report batches dropped as duplicates (sequence not increasing).",
            ["engine"],
            registry=registry,
        )
        self.lost_batches = Counter(
            f"{p}_lost_report_batches",
            "Report batches never received (sequence gaps: lost in a sidecar crash or by the engine).",
            ["engine"],
            registry=registry,
        )
        self.rejected_admin = Counter(
            f"{p}_rejected_admin_requests",
            "Admin requests refused, by reason (unauthenticated, invalid policy, rate limited, ...).",
            ["reason"],
            registry=registry,
        )
        self.engine_dropped = Counter(
            f"{p}_engine_dropped_steps",
            "Steps the engine dropped locally (its queue was full).",
            ["engine"],
            registry=registry,
        )
        self.snapshot_failures = Counter(
            f"{p}_snapshot_failures", "Snapshot writes that failed.", registry=registry
        )
        self.last_snapshot = Gauge(
            f"{p}_last_snapshot_timestamp_seconds",
            "Unix time of the last successful snapshot.",
            registry=registry,
        )
        self.loop_resets = Counter(
            f"{p}_control_loop_resets",
            "Control loops started afresh because their state broke (decisions, estimates or snapshot).",
            registry=registry,
        )
        self.decision_seconds = Histogram(
            f"{p}_decision_seconds",
            "Time one decision round takes (an engine's control loop deciding its next directive).",
            buckets=DECISION_BUCKETS,
            registry=registry,
        )
        self.build_info = Gauge(
            f"{p}_build_info",
            "Always 1; the labels say which sidecar build serves.",
            ["version", "protocol_versions", "python_version"],
            registry=registry,
        )
        self.build_info.labels(
            controller.__version__, ",".join(map(str, PROTOCOL_VERSIONS)), platform.python_version()
        ).set(1)

    def forget_engine(self, engine_id: str) -> None:
        """Drop every series of an engine the sidecar no longer holds."""
        with self._t.lock:
            self._t.engines.pop(engine_id, None)
        for name in _ENGINE_SERIES:
            metric: Counter = getattr(self, name)
            with contextlib.suppress(KeyError):  # the engine never had this series
                metric.remove(engine_id)

    def observe(self, engine_id: str, batch: StepBatch) -> None:
        """The steps of one report: one lock, the batch's rows grouped at once."""
        if not len(batch):
            return
        n = batch.n
        has_rows = n > 0
        emitted = n.copy()
        if has_rows.any():
            emitted[has_rows] += np.add.reduceat(batch.accepted, batch.offsets[:-1][has_rows])
        with self._t.lock:
            e = self._t.engine(engine_id)
            e.steps += len(batch)
            e.queue_length = int(batch.queue_length[-1])
            e.recent.extend(
                zip(
                    emitted.tolist(),
                    np.maximum(batch.duration_s, 0.0).tolist(),
                    batch.queue_wait_s.tolist(),
                    strict=True,
                )
            )
            if len(batch.method):
                self._by_arm(e, batch.method, batch.k, batch.drafted, batch.accepted)

    def _by_arm(
        self, e: _Engine, method: np.ndarray, k: np.ndarray, drafted: np.ndarray, accepted: np.ndarray
    ) -> None:
        """Add rows to the per-(method, k) sums, one numpy pass per arm present."""
        n = len(method)
        key = method.astype(np.int64) * 1024 + k.astype(np.int64)
        first = int(key[0])
        if (key == first).all():  # the usual case: one arm for all rows, no grouping needed
            row = e.by_arm.setdefault((METHODS_BY_CODE[first // 1024].value, first % 1024), [0, 0, 0, 0])
            a_sum = int(accepted.sum())
            row[0] += int(drafted.sum())
            row[1] += a_sum
            row[2] += a_sum + n
            row[3] += n
            return
        uniq, inv = np.unique(key, return_inverse=True)
        d = np.bincount(inv, weights=drafted, minlength=len(uniq))
        a = np.bincount(inv, weights=accepted, minlength=len(uniq))
        c = np.bincount(inv, minlength=len(uniq))
        for i, u in enumerate(uniq.tolist()):
            row = e.by_arm.setdefault((METHODS_BY_CODE[u // 1024].value, u % 1024), [0, 0, 0, 0])
            row[0] += int(d[i])
            row[1] += int(a[i])
            row[2] += int(a[i]) + int(c[i])
            row[3] += int(c[i])

    def set_connected(self, engine_id: str, connected: bool) -> None:
        with self._t.lock:
            e = self._t.engine(engine_id)
            e.connected = connected
            if not connected:  # what it measured described it before it went away, not once it is back
                e.recent.clear()
                e.queue_length = 0

    def set_directive(self, engine_id: str, *, version: int, issued_at: float, arms: dict[str, Arm]) -> None:
        with self._t.lock:
            e = self._t.engine(engine_id)
            e.directive_version, e.directive_issued_at, e.arms = version, issued_at, dict(arms)

    def set_guards(self, engine_id: str, counts: dict[str, int]) -> None:
        with self._t.lock:
            self._t.engine(engine_id).guards = dict(counts)

    def recent_goodput(self, engine_id: str) -> float:
        with self._t.lock:
            e = self._t.engines.get(engine_id)
            g = _goodput(e.recent) if e is not None else None
            return 0.0 if g is None else g


class _WithoutCreated(Collector):
    """A registry's metrics without the ``*_created`` samples (start times of counters and
    histograms, which only double the series count)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for m in self.registry.collect():
            samples = [x for x in m.samples if not x.name.endswith("_created")]
            if len(samples) != len(m.samples):
                m.samples = samples
            yield m


class MetricsServer:
    """``/metrics`` over HTTP for one registry, on a background thread of prometheus_client's."""

    def __init__(self, *, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry, self.host, self.port = registry, host, port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Bind and serve; returns the URL of the metrics page (with the bound port)."""
        view = CollectorRegistry(auto_describe=False)
        view.register(_WithoutCreated(self.registry))
        server, thread = start_http_server(self.port, addr=self.host, registry=view)
        self._server, self._thread = server, thread
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{server.server_port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
