"""Seeded synthetic traffic for the embedded engine: request classes, phases, per-token acceptance.

Every request is pre-generated from ``(seed, phase, index)`` alone, so engines running different
policies on the same seed see the same requests in the same order (common random numbers): the
difference in their goodput is the policy's, not the dice's.

Acceptance follows the ``spectrace`` semantics of DESIGN.md: ``acc[method][t]`` is how many draft
tokens the method would have had accepted had a draft of unlimited length started right after output
token ``t``. It is built from a per-token "this method would have guessed this token" indicator, so
``acc[t] = s[t+1] * (1 + acc[t+1])``: consecutive positions agree the way a real draft does. Code
has copying bursts (a regime where the next tokens repeat context), where n-gram lookup is nearly
always right; outside them n-gram rarely is, while EAGLE-3 is steadily good except on high-entropy
("creative") text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from policies.arms import Method

#: Longest run an ``acc`` entry records; engines truncate at their max_k anyway.
ACC_CAP = 16
#: Methods the generator scores (``off`` drafts nothing).
METHODS: tuple[Method, ...] = (Method.EAGLE3, Method.NGRAM)


@dataclass(frozen=True, slots=True)
class MethodAcceptance:
    """Per-token probability that the method guesses the token, outside and inside a copying burst."""

    base: float
    burst: float

    def __post_init__(self) -> None:
        for name in ("base", "burst"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"acceptance {name}: must be in [0, 1], got {v!r}")


@dataclass(frozen=True, slots=True)
class TrafficClass:
    """A kind of request: lengths and how well each method drafts for it."""

    name: str
    prompt_tokens: int
    output_tokens: int
    acceptance: Mapping[Method, MethodAcceptance]
    #: Fraction of output tokens inside copying bursts, and the bursts' mean length in tokens.
    burst_fraction: float = 0.0
    burst_tokens: float = 32.0
    #: Per-request spread of the base acceptance (standard deviation, absolute).
    request_spread: float = 0.05

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("traffic class: name is required")
        if self.prompt_tokens < 1 or self.output_tokens < 2:
            raise ValueError(f"traffic class {self.name}: prompt_tokens >= 1 and output_tokens >= 2 required")
        if not 0.0 <= self.burst_fraction < 1.0:
            raise ValueError(f"traffic class {self.name}: burst_fraction must be in [0, 1)")
        if self.burst_tokens < 1.0:
            raise ValueError(f"traffic class {self.name}: burst_tokens must be >= 1")
        missing = [m.value for m in METHODS if m not in self.acceptance]
        if missing:
            raise ValueError(f"traffic class {self.name}: acceptance missing for {', '.join(missing)}")
        object.__setattr__(self, "acceptance", MappingProxyType(dict(self.acceptance)))


@dataclass(frozen=True, slots=True)
class Phase:
    """A stretch of virtual time with a class mix and a closed-loop concurrency."""

    duration_s: float
    mix: Mapping[str, float]
    concurrency: int

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise ValueError(f"phase: duration_s must be > 0, got {self.duration_s!r}")
        if self.concurrency < 1:
            raise ValueError(f"phase: concurrency must be >= 1, got {self.concurrency!r}")
        if not self.mix or any(w < 0 for w in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError("phase: mix needs non-negative weights with a positive sum")
        object.__setattr__(self, "mix", MappingProxyType(dict(self.mix)))


@dataclass(frozen=True, slots=True)
class Request:
    """One pre-generated request; ``acc[m]`` has one entry per output token."""

    request_id: str
    traffic_class: str
    prompt_tokens: int
    output_tokens: int
    acc: Mapping[Method, np.ndarray]


@dataclass(frozen=True, slots=True)
class Schedule:
    phases: tuple[Phase, ...]

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("schedule: at least one phase")

    @property
    def duration_s(self) -> float:
        return float(sum(p.duration_s for p in self.phases))

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
        return Schedule(tuple(Phase(p.duration_s * f, p.mix, p.concurrency) for p in self.phases))


def _acc(success: np.ndarray) -> np.ndarray:
    """acc[t] = length of the run of successes starting at t + 1 (0 for the last token), capped."""
    n = len(success)
    idx = np.arange(n)
    zero_at = np.where(success, n, idx)
    next_zero = np.minimum.accumulate(zero_at[::-1])[::-1]
    run = next_zero - idx  # run of successes starting at t
    out = np.zeros(n, dtype=np.int32)
    out[:-1] = run[1:]
    return np.minimum(out, ACC_CAP)


def _bursts(rng: np.random.Generator, n: int, fraction: float, mean_len: float) -> np.ndarray:
    """A two-state regime per token: True inside a copying burst (alternating geometric segments)."""
    inside = np.zeros(n, dtype=bool)
    if fraction <= 0.0:
        return inside
    gap_mean = mean_len * (1.0 - fraction) / fraction
    pos = 0
    state = bool(rng.random() < fraction)
    while pos < n:
        seg = int(rng.geometric(1.0 / max(mean_len if state else gap_mean, 1.0)))
        if state:
            inside[pos : pos + seg] = True
        pos += seg
        state = not state
    return inside


@dataclass(frozen=True, slots=True)
class Traffic:
    """Classes, a phase schedule and a seed: every request, on demand, the same each time."""

    classes: Mapping[str, TrafficClass]
    schedule: Schedule
    seed: int = 0
    _names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", MappingProxyType(dict(self.classes)))
        object.__setattr__(self, "_names", tuple(sorted(self.classes)))
        for i, p in enumerate(self.schedule.phases):
            unknown = sorted(set(p.mix) - set(self.classes))
            if unknown:
                raise ValueError(f"schedule.phases[{i}].mix: unknown class {unknown[0]!r}")

    def request(self, phase: int, index: int) -> Request:
        """The ``index``-th request started during ``phase``."""
        p = self.schedule.phases[phase]
        rng = np.random.default_rng([self.seed, phase, index])
        names = [c for c in self._names if p.mix.get(c, 0.0) > 0]
        w = np.array([p.mix[c] for c in names], dtype=np.float64)
        cls = self.classes[names[int(rng.choice(len(names), p=w / w.sum()))]]
        out_n = int(np.clip(rng.lognormal(np.log(cls.output_tokens), 0.4), 16, 8 * cls.output_tokens))
        prompt = int(np.clip(rng.lognormal(np.log(cls.prompt_tokens), 0.5), 8, 32 * cls.prompt_tokens))
        burst = _bursts(rng, out_n, cls.burst_fraction, cls.burst_tokens)
        acc: dict[Method, np.ndarray] = {}
        for m in METHODS:
            a = cls.acceptance[m]
            base = float(np.clip(a.base + rng.normal(0.0, cls.request_spread), 0.0, 0.99))
            p_tok = np.where(burst, a.burst, base)
            acc[m] = _acc(rng.random(out_n) < p_tok)
        return Request(f"p{phase}-r{index}", cls.name, prompt, out_n, MappingProxyType(acc))

    def requests(self, phase: int, count: int) -> list[Request]:
        return [self.request(phase, i) for i in range(count)]


def _cls(
    name: str,
    prompt: int,
    output: int,
    eagle: tuple[float, float],
    ngram: tuple[float, float],
    burst_fraction: float = 0.0,
    burst_tokens: float = 32.0,
) -> TrafficClass:
    return TrafficClass(
        name=name,
        prompt_tokens=prompt,
        output_tokens=output,
        acceptance={Method.EAGLE3: MethodAcceptance(*eagle), Method.NGRAM: MethodAcceptance(*ngram)},
        burst_fraction=burst_fraction,
        burst_tokens=burst_tokens,
    )


#: Per-token acceptance loosely after research/anchors.md (EAGLE-3 conditional acceptance ~0.7-0.8 on
#: chat and maths; n-gram near useless on chat, near perfect while code copies its context).
DEFAULT_CLASSES: Mapping[str, TrafficClass] = MappingProxyType(
    {
        "chat": _cls("chat", 400, 220, eagle=(0.74, 0.85), ngram=(0.06, 0.7), burst_fraction=0.04),
        "code": _cls(
            "code", 1200, 320, eagle=(0.66, 0.85), ngram=(0.08, 0.97), burst_fraction=0.45, burst_tokens=40
        ),
        "maths": _cls("maths", 250, 400, eagle=(0.80, 0.9), ngram=(0.12, 0.8), burst_fraction=0.08),
        "creative": _cls("creative", 200, 300, eagle=(0.22, 0.6), ngram=(0.03, 0.5), burst_fraction=0.02),
    }
)

#: The demo's drift: chat at batch 1, code at batch 4, then a large batch of hard-to-draft text.
DEMO_SCHEDULE = Schedule(
    (
        Phase(1.0, {"chat": 0.8, "maths": 0.2}, 1),
        Phase(1.0, {"code": 1.0}, 4),
        Phase(1.0, {"creative": 0.7, "chat": 0.3}, 48),
    )
)


def demo_traffic(
    *, seed: int = 0, duration_s: float = 20.0, phases: Sequence[Phase] | None = None
) -> Traffic:
    sched = Schedule(tuple(phases)) if phases is not None else DEMO_SCHEDULE
    return Traffic(classes=DEFAULT_CLASSES, schedule=sched.scaled(duration_s), seed=seed)
