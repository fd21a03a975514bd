"""Autoscaling in the simulator: the Kubernetes HPA algorithm driven by queue wait, and warm starts.

Two parts, both measured in this module's run:

* **Learning curves**: the default policy replayed on one replica from a cold start and from a warm one
  (a ControlLoop state learned on other traffic of the same kind, as the fleet link shares it), giving
  goodput over time and the time to reach 95 % of steady goodput.
* **Fleet**: a fluid queue in front of N replicas. Each ready replica serves requests at its measured
  steady rate times its learning-curve efficiency for its age; the HPA reads the mean queue wait
  (``speccontrol_queue_wait_seconds``) every sync period and applies the upstream ratio rule
  ``desired = ceil(current * metric / target)`` with its tolerance, scale-up rate limits and
  scale-down stabilisation window; new pods serve only after a start-up delay (vLLM: 60-180 s, as
  community notes on autoscaling vLLM report). Latency is a fluid approximation: queue wait plus the
  measured service time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.spec import PolicySpec
from sim.costmodel import Profile
from sim.engines import EngineModel
from sim.files import save_figure
from sim.replay import Replayer
from sim.run import RunResult
from sim.trace import Trace
from sim.traffic import generate


@dataclass(frozen=True, slots=True)
class HpaSettings:
    """The HPA's knobs (defaults: Kubernetes' own, a 0.5 s queue-wait target, a vLLM start-up)."""

    target_queue_wait_s: float = 0.5
    #: A second metric, busy slots / max_num_seqs (from vllm:num_requests_running); the HPA takes the
    #: larger of the two recommendations. Queue wait alone is zero below saturation, so on its own it
    #: drives the fleet to min_replicas after every drain. None: queue wait only.
    target_utilisation: float | None = 0.8
    #: Ratios within 1 +- tolerance leave the replica count alone (kube-controller-manager default).
    tolerance: float = 0.1
    sync_period_s: float = 15.0
    #: Scale-down acts on the highest recommendation of this window (HPA default 300 s).
    scale_down_window_s: float = 300.0
    #: Scale-up per sync period: the larger of this many pods and this percentage (HPA defaults).
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    min_replicas: int = 1
    max_replicas: int = 16
    #: Seconds from pod creation until the replica serves (model load, warm-up).
    startup_s: float = 120.0

    def __post_init__(self) -> None:
        if self.target_queue_wait_s <= 0 or self.sync_period_s <= 0:
            raise ValueError("target_queue_wait_s and sync_period_s must be positive")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= max_replicas")


@dataclass(slots=True)
class Hpa:
    """The replica-count decision, one call per sync period (pure; time is passed in)."""

    settings: HpaSettings
    _history: deque[tuple[float, int]] = field(default_factory=deque)

    def decide(self, now: float, current: int, queue_wait_s: float, utilisation: float | None = None) -> int:
        s = self.settings
        raw = self._ratio_rule(current, queue_wait_s / s.target_queue_wait_s)
        if s.target_utilisation is not None and utilisation is not None:
            raw = max(raw, self._ratio_rule(current, utilisation / s.target_utilisation))
        raw = min(max(raw, s.min_replicas), s.max_replicas)
        self._history.append((now, raw))
        while self._history and self._history[0][0] < now - s.scale_down_window_s:
            self._history.popleft()
        if raw < current:
            # Stabilisation: never below the highest recommendation of the window, and, as in Kubernetes,
            # never above the current count: the window holds raw recommendations, which exceed the
            # current count after a rate-limited scale-up, and a scale-down must not turn into a
            # scale-up that skips the scale-up limits.
            return min(current, max(r for _, r in self._history))
        limit = max(current + s.scale_up_pods, math.floor(current * (1 + s.scale_up_percent / 100)))
        return min(raw, limit, s.max_replicas)

    def _ratio_rule(self, current: int, ratio: float) -> int:
        if abs(ratio - 1.0) <= self.settings.tolerance:
            return current
        # Capped at max_replicas (as decide caps it anyway) before ceil: a target of 5e-324 made the
        # ratio infinite, and ceil(inf) raised OverflowError.
        return math.ceil(min(current * ratio, float(self.settings.max_replicas)))


@dataclass(frozen=True, slots=True)
class LearningCurve:
    """A replica's goodput relative to its steady goodput, by seconds since it started serving."""

    t_s: np.ndarray
    efficiency: np.ndarray
    steady_tok_s: float

    def at(self, age_s: float) -> float:
        if age_s >= float(self.t_s[-1]):
            return 1.0
        return float(np.interp(age_s, self.t_s, self.efficiency))

    def at_ages(self, ages: np.ndarray) -> np.ndarray:
        """``at`` of each age, at once (the same figures: ``np.interp`` of each, 1 from the last)."""
        return np.where(ages >= float(self.t_s[-1]), 1.0, np.interp(ages, self.t_s, self.efficiency))

    def time_to(self, fraction: float = 0.95) -> float:
        hit = np.flatnonzero(self.efficiency >= fraction)
        return float(self.t_s[hit[0]]) if len(hit) else math.inf


def curve_from(result: RunResult, *, window_s: float, steady_tok_s: float) -> LearningCurve:
    """Goodput in consecutive windows of the run's timeline, relative to ``steady_tok_s``."""
    tl = result.timeline
    end = tl.end_s - float(result.submit_s.min())
    edges = np.arange(0.0, float(end[-1]) + window_s, window_s)
    idx = np.searchsorted(edges, end, side="right") - 1
    tokens = np.bincount(idx, weights=tl.emitted, minlength=len(edges))[: len(edges) - 1]
    eff = tokens / window_s / steady_tok_s
    return LearningCurve(t_s=edges[1:], efficiency=np.minimum(eff, 1.5), steady_tok_s=steady_tok_s)


@dataclass(frozen=True, slots=True)
class ReplicaMeasure:
    """What one replica does, measured by replaying the policy: steady rate and learning curves."""

    steady_tok_s: float
    mean_output_tokens: float
    service_s: float
    cold: LearningCurve
    warm: LearningCurve


def measure_replica(
    *,
    policy: PolicySpec,
    profile: Profile,
    engine: EngineModel,
    scenario: str = "mixed",
    concurrency: int = 32,
    requests: int = 1200,
    window_s: float = 5.0,
    seed: int = 0,
) -> ReplicaMeasure:
    """Cold and warm replays of the same traffic; the warm loop first learned on other traffic."""
    trace = generate(scenario, n_requests=requests, seed=seed + 1)
    other = generate(scenario, n_requests=requests, seed=seed + 2)

    def replay(tr: Trace, state: dict[str, Any] | None) -> tuple[RunResult, Replayer]:
        r = Replayer(
            trace=tr,
            profile=profile,
            engine=engine,
            policy=policy,
            concurrency=concurrency,
            seed=seed,
            loop_state=state,
        )
        return r.run(), r

    _, teacher = replay(other, None)
    cold, _ = replay(trace, None)
    warm, _ = replay(trace, teacher.final_state)
    # Steady goodput: the warm replica over the middle half of its run, when every slot is busy (a
    # closed loop drains at the end) and the policy has long settled.
    steady = _middle_goodput(warm)
    lat = cold.latency()
    return ReplicaMeasure(
        steady_tok_s=steady,
        mean_output_tokens=float(cold.output_tokens.mean()),
        service_s=float(np.mean(lat["e2e"] - lat["ttft"])),
        cold=curve_from(cold, window_s=window_s, steady_tok_s=steady),
        warm=curve_from(warm, window_s=window_s, steady_tok_s=steady),
    )


def _middle_goodput(result: RunResult) -> float:
    tl = result.timeline
    lo, hi = len(tl.end_s) // 4, (3 * len(tl.end_s)) // 4
    return float(tl.emitted[lo + 1 : hi + 1].sum() / (tl.end_s[hi] - tl.end_s[lo]))


@dataclass(frozen=True, slots=True)
class FleetSeries:
    t_s: np.ndarray
    arrival_rps: np.ndarray
    replicas: np.ndarray  # pods the HPA asked for
    ready: np.ndarray  # pods serving
    queue: np.ndarray
    queue_wait_s: np.ndarray
    p99_e2e_s: np.ndarray  # over the last 60 s


#: ``simulate_fleet`` reports progress every this many steps.
PROGRESS_EVERY = 1000


def load_triples(t: np.ndarray, *, base_rps: float, at_s: float) -> np.ndarray:
    """The scenario "load triples": a steady rate that triples at ``at_s``."""
    return np.where(t < at_s, base_rps, 3.0 * base_rps)


def simulate_fleet(
    *,
    replica: ReplicaMeasure,
    arrival_rps: np.ndarray,
    hpa: HpaSettings,
    warm_start: bool,
    initial_replicas: int = 2,
    dt_s: float = 1.0,
    progress: Callable[[int], None] | None = None,
) -> FleetSeries:
    """Fluid queue + HPA, one step per ``dt_s``; new replicas learn along the cold or warm curve.
    ``progress`` gets the number of steps done since its last call, every ``PROGRESS_EVERY`` steps.

    The replicas are arrays, one entry per pod: a week at thousands of replicas took an hour as
    Python lists. Capacity is summed in the pods' order (``np.add.accumulate``, as ``sum`` did), so
    the figures are those of the element-by-element loop to the bit."""
    curve = replica.warm if warm_start else replica.cold
    per_replica_rps = replica.steady_tok_s / replica.mean_output_tokens
    n = len(arrival_rps)
    t = np.arange(n) * dt_s
    control = Hpa(hpa)
    # The HPA has been running at the initial size (its stabilisation window remembers it).
    control.decide(-hpa.sync_period_s, initial_replicas, hpa.target_queue_wait_s, hpa.target_utilisation)
    # Start times of pods: existing ones have long been serving.
    starts = np.full(initial_replicas, -1e9)
    queue = 0.0
    waits: deque[float] = deque()
    busy: deque[float] = deque()
    out = {k: np.zeros(n) for k in ("replicas", "ready", "queue", "wait", "p99")}
    e2e_window: deque[float] = deque(maxlen=max(1, int(60 / dt_s)))
    for i in range(n):
        now = float(t[i])
        ages = now - starts - hpa.startup_s
        ready_ages = ages[ages >= 0]
        eff = curve.at_ages(ready_ages)
        rates = per_replica_rps * eff
        capacity = (float(np.add.accumulate(rates)[-1]) if len(rates) else 0.0) * dt_s
        queue += float(arrival_rps[i]) * dt_s
        served = min(queue, capacity)
        queue -= served
        wait = queue / (capacity / dt_s) if capacity > 0 else queue / max(float(arrival_rps[i]), 1e-9)
        waits.append(wait)
        # Busy share of the serving slots (a replica at its steady rate has every slot busy).
        busy.append(served / capacity if capacity > 0 else 1.0)
        mean_eff = float(np.mean(eff)) if len(eff) else 1.0
        e2e_window.append(wait + replica.service_s / max(mean_eff, 1e-3))
        if i > 0 and now % hpa.sync_period_s < dt_s:
            want = control.decide(now, len(starts), float(np.mean(waits)), float(np.mean(busy)))
            waits.clear()
            busy.clear()
            if want > len(starts):
                starts = np.concatenate([starts, np.full(want - len(starts), now)])
            elif want < len(starts):
                # Remove the youngest pods first (least learned, possibly not ready).
                starts = np.sort(starts)[:want]
        out["replicas"][i] = len(starts)
        out["ready"][i] = len(ready_ages)
        out["queue"][i] = queue
        out["wait"][i] = wait
        out["p99"][i] = float(np.percentile(np.asarray(e2e_window), 99))
        if progress is not None and ((i + 1) % PROGRESS_EVERY == 0 or i == n - 1):
            progress((i + 1) - i // PROGRESS_EVERY * PROGRESS_EVERY)
    return FleetSeries(
        t_s=t,
        arrival_rps=np.asarray(arrival_rps, dtype=np.float64),
        replicas=out["replicas"],
        ready=out["ready"],
        queue=out["queue"],
        queue_wait_s=out["wait"],
        p99_e2e_s=out["p99"],
    )


def summarise(series: FleetSeries, after_s: float) -> dict[str, float]:
    """Figures after the load step: peak replicas, queue-wait integral and peak, worst p99."""
    m = series.t_s >= after_s
    return {
        "max_replicas": float(series.replicas[m].max()),
        "queue_wait_s_integral": float(series.queue_wait_s[m].sum()),
        "max_queue_wait_s": float(series.queue_wait_s[m].max()),
        "max_p99_e2e_s": float(series.p99_e2e_s[m].max()),
    }


def plot(series: Sequence[tuple[str, FleetSeries]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    # One colour and line style per start (cold, warm) on every panel, so the two never blur together.
    looks = {"cold": ("tab:blue", "-"), "warm": ("tab:orange", "--")}
    for i, (label, s) in enumerate(series):
        color, style = looks.get(label, (f"C{i + 2}", "-."))
        kw = {"color": color, "linestyle": style, "linewidth": 1.6}
        axes[0].step(s.t_s, s.replicas, where="post", label=f"{label}: pods", **kw)
        axes[0].step(
            s.t_s, s.ready, where="post", color=color, linestyle=":", linewidth=1.0, label=f"{label}: ready"
        )
        axes[1].plot(s.t_s, s.queue_wait_s, label=label, **kw)
        axes[2].plot(s.t_s, s.p99_e2e_s, label=label, **kw)
    axes[0].set_ylabel("replicas")
    axes[1].set_ylabel("queue wait (s)")
    axes[2].set_ylabel("p99 e2e, 60 s (s)")
    axes[2].set_xlabel("time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Load triples: HPA on queue wait and slot utilisation, warm vs cold replicas")
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
