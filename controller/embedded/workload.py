"""The demo engine's workload: phases of virtual time, each a class mix at a closed-loop concurrency.

Requests come from the simulator's own traffic generator (``sim.traffic``: its classes, acceptance
model and lengths), so the demo and the decision-quality figures share one physics. Every phase's
requests are generated once, seeded by ``(seed, phase)`` alone, into one ``Trace``: engines running
different policies on the same workload see the same requests in the same order (common random
numbers), and the difference in their goodput is the policy's, not the dice's.

A phase's pool is sized from the profile for the most its engine could ever need (every draft of
``max_k`` accepted at its concurrency for the whole phase), capped at ``MAX_POOL``; a longer phase
cycles through its pool again (same requests, fresh ids).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from policies.arms import Method
from sim.costmodel import DEFAULT_PROFILE, Profile, load_profile
from sim.trace import Trace
from sim.traffic import CLASSES, Scenario, generate

#: The methods the demo engine drafts with (the composite drafter: EAGLE-3 and n-gram).
METHODS: tuple[Method, ...] = (Method.EAGLE3, Method.NGRAM)
#: Most requests generated for one phase (a longer phase cycles through them).
MAX_POOL = 1200


@dataclass(frozen=True, slots=True)
class Phase:
    """A stretch of virtual time with a class mix (``sim.traffic`` class names) and a concurrency."""

    duration_s: float
    mix: Mapping[str, float]
    concurrency: int
    #: A short name for printing (e.g. "code editing"); the mix's classes when empty.
    label: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"phase: duration_s must be a finite number > 0, got {self.duration_s!r}")
        if self.concurrency < 1:
            raise ValueError(f"phase: concurrency must be >= 1, got {self.concurrency!r}")
        if not self.mix or any(w < 0 for w in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError("phase: mix needs non-negative weights with a positive sum")
        unknown = sorted(set(self.mix) - set(CLASSES))
        if unknown:
            raise ValueError(f"phase.mix: unknown class {unknown[0]!r} (known: {', '.join(CLASSES)})")
        object.__setattr__(self, "mix", MappingProxyType(dict(self.mix)))

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        total = sum(self.mix.values())
        if len(self.mix) == 1:
            return next(iter(self.mix))
        return "+".join(f"{c} {w / total:.0%}" for c, w in self.mix.items())


@dataclass(frozen=True, slots=True)
class Schedule:
    phases: tuple[Phase, ...]

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("schedule: at least one phase")

    @property
    def duration_s(self) -> float:
        return float(sum(p.duration_s for p in self.phases))

    def starts(self) -> list[float]:
        """Virtual time at which each phase begins."""
        out, t = [], 0.0
        for p in self.phases:
            out.append(t)
            t += p.duration_s
        return out

    def index(self, t: float) -> int:
        """The phase in force at virtual time ``t`` (the last one past the end)."""
        end = 0.0
        for i, p in enumerate(self.phases):
            end += p.duration_s
            if t < end:
                return i
        return len(self.phases) - 1

    def scaled(self, duration_s: float) -> Schedule:
        """The same phases stretched to last ``duration_s`` in all."""
        f = duration_s / self.duration_s
        return Schedule(tuple(Phase(p.duration_s * f, p.mix, p.concurrency, p.label) for p in self.phases))


@dataclass(frozen=True, slots=True)
class Workload:
    """A schedule and its requests: phase ``p``'s ``i``-th request is ``trace`` row ``index(p, i)``."""

    schedule: Schedule
    trace: Trace
    seed: int
    #: First trace row and number of rows of each phase's pool.
    first: tuple[int, ...]
    count: tuple[int, ...]

    @property
    def max_k(self) -> int:
        return self.trace.max_k

    def index(self, phase: int, i: int) -> int:
        return self.first[phase] + i % self.count[phase]


def _pool_size(phase: Phase, profile: Profile, max_k: int) -> int:
    mix = {c: w / sum(phase.mix.values()) for c, w in phase.mix.items()}
    mean_out = sum(w * CLASSES[c].output_median for c, w in mix.items())
    mean_prompt = sum(w * CLASSES[c].prompt_median for c, w in mix.items())
    c = phase.concurrency
    fastest = profile.plain_step_time(c, int(mean_prompt))
    most_tokens = phase.duration_s / fastest * c * (max_k + 1)
    return int(min(MAX_POOL, max(4 * c + 8, math.ceil(1.5 * most_tokens / max(mean_out, 1.0)))))


def _phase_scenario(i: int, phase: Phase, n: int) -> Scenario:
    w = np.array([phase.mix.get(c, 0.0) for c in CLASSES], dtype=np.float64)

    def mix(x: np.ndarray) -> np.ndarray:
        return np.broadcast_to(w, (len(x), len(w)))

    return Scenario(f"phase-{i + 1}", phase.name, mix, n_requests=n)


def build_workload(schedule: Schedule, *, profile: Profile, seed: int = 0, max_k: int = 4) -> Workload:
    """Generate every phase's pool (seeded by ``(seed, phase)``) into one trace."""
    if not 1 <= max_k <= 16:
        raise ValueError(f"max_k must be in 1..16, got {max_k}")
    parts: list[Trace] = []
    for i, p in enumerate(schedule.phases):
        n = _pool_size(p, profile, max_k)
        phase_seed = int(np.random.SeedSequence([seed, i]).generate_state(1)[0])
        parts.append(generate(_phase_scenario(i, p, n), seed=phase_seed, max_k=max_k, methods=METHODS))
    first = tuple(int(x) for x in np.cumsum([0, *(t.n for t in parts[:-1])]))
    trace = Trace(
        max_k=max_k,
        methods=METHODS,
        ids=tuple(f"p{i + 1}-r{j}" for i, t in enumerate(parts) for j in range(t.n)),
        classes=tuple(c for t in parts for c in t.classes),
        prompt_tokens=np.concatenate([t.prompt_tokens for t in parts]),
        output_tokens=np.concatenate([t.output_tokens for t in parts]),
        arrival_s=np.full(sum(t.n for t in parts), np.nan),
        acc={m: np.concatenate([t.acc[m] for t in parts]) for m in METHODS},
        # The n-gram proposer's match, which the per-request rule reads as the plugin's engine does.
        ngram_proposal=_concat_proposals(parts),
        meta={"generator": "controller.embedded.workload", "seed": seed, **_ngram_meta(parts)},
        name="demo",
    )
    return Workload(schedule=schedule, trace=trace, seed=seed, first=first, count=tuple(t.n for t in parts))


def _concat_proposals(parts: Sequence[Trace]) -> np.ndarray | None:
    if any(t.ngram_proposal is None for t in parts):
        return None
    return np.concatenate([t.ngram_proposal for t in parts if t.ngram_proposal is not None])


def _ngram_meta(parts: Sequence[Trace]) -> dict[str, object]:
    ngram = parts[0].meta.get("ngram")
    return {"ngram": ngram} if ngram is not None else {}


#: The demo's drift, one a user recognises: chat alone, then code editing (copy-heavy) for a team,
#: maths under heavy load, then summarisation of long documents under the same load.
DEMO_SCHEDULE = Schedule(
    (
        Phase(1.0, {"chat": 1.0}, 1, "chat"),
        Phase(1.0, {"code-edit": 1.0}, 8, "code editing"),
        Phase(1.0, {"maths": 1.0}, 32, "maths"),
        Phase(1.0, {"summarisation": 1.0}, 32, "summarisation"),
    )
)


def demo_workload(
    *,
    seed: int = 0,
    duration_s: float = 20.0,
    profile: Profile | None = None,
    max_k: int = 8,
    phases: Sequence[Phase] | None = None,
) -> Workload:
    """The demo's schedule (or ``phases``) stretched to ``duration_s``, on ``profile`` (default: 8B)."""
    sched = Schedule(tuple(phases)) if phases is not None else DEMO_SCHEDULE
    prof = profile if profile is not None else load_profile(DEFAULT_PROFILE)
    return build_workload(sched.scaled(duration_s), profile=prof, seed=seed, max_k=max_k)
