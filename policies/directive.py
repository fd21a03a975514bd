"""The Directive: what the slow loop tells an engine, as plain immutable values.

Its wire form is ``controller.v1.Directive``; ``controller`` converts between the two. Engines look
arms up here (``arm_for``) so the plugin, the embedded engine and the simulator read it identically.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from policies.arms import OFF, Arm, Method
from policies.context import ANY_CLASS


def _frozen(m: Mapping[str, float] | None) -> Mapping[str, float]:
    return MappingProxyType(dict(m or {}))


@dataclass(frozen=True, slots=True)
class KRange:
    """Batch sizes ``bs_min..bs_max`` (``bs_max = 0``: unbounded) use draft length ``k``."""

    bs_min: int
    bs_max: int
    k: int

    def covers(self, batch_size: int) -> bool:
        return batch_size >= self.bs_min and (self.bs_max == 0 or batch_size <= self.bs_max)


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """The arm for requests of ``traffic_class`` (``"*"``: any other) at batch sizes in range."""

    traffic_class: str
    bs_min: int
    bs_max: int
    arm: Arm

    def covers(self, batch_size: int) -> bool:
        return batch_size >= self.bs_min and (self.bs_max == 0 or batch_size <= self.bs_max)


@dataclass(frozen=True, slots=True)
class RequestRule:
    """The fast loop's per-request rule: a kind and its numeric parameters (see ``policies.rules``)."""

    kind: str = "none"
    params: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _frozen(self.params))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RequestRule)
            and self.kind == other.kind
            and dict(self.params) == dict(other.params)
        )

    def __hash__(self) -> int:
        return hash((self.kind, tuple(sorted(self.params.items()))))


@dataclass(frozen=True, slots=True)
class Directive:
    version: int
    policy: str
    reason: str
    ttl_s: float
    issued_at_s: float
    k_table: tuple[KRange, ...]
    method: Method
    plan: tuple[PlanEntry, ...] = ()
    rule: RequestRule = field(default_factory=RequestRule)

    def k_for_batch(self, batch_size: int, max_k: int) -> int:
        """The engine-wide K for a batch size, clamped to the engine's maximum."""
        for r in self.k_table:
            if r.covers(batch_size):
                return max(0, min(r.k, max_k))
        return 0

    def width_for_batch(self, batch_size: int, max_k: int) -> int:
        """The draft room an engine leaves each request of a step where it must reserve it before the
        drafts exist (async scheduling's placeholders, which can then only be shortened): the K table's
        entry, or ``max_k`` where the per-request rule may draft n-gram past the plan's K
        (``ngram_span`` drafts a copy span's expected run, up to ``max_k``). A bucket the table turns
        off keeps 0 unless the rule drafts for planned-off requests too (``when_off``). Engines that
        take whole drafts (synchronous scheduling) need no room: they use ``k_for_batch``."""
        k = self.k_for_batch(batch_size, max_k)
        if self.rule.kind == "ngram_span" and (k > 0 or self.rule.params.get("when_off", 1)):
            return max(0, max_k)
        return k

    def arm_for(self, traffic_class: str, batch_size: int) -> Arm:
        """The planned arm for one request (request-granular engines)."""
        fallback: Arm | None = None
        for e in self.plan:
            if not e.covers(batch_size):
                continue
            if e.traffic_class == traffic_class:
                return e.arm
            if e.traffic_class == ANY_CLASS and fallback is None:
                fallback = e.arm
        if fallback is not None:
            return fallback
        k = self.k_for_batch(batch_size, 1 << 30)
        return Arm(self.method, k) if k > 0 and self.method is not Method.OFF else OFF

    def same_decision(self, other: Directive | None) -> bool:
        """True when ``other`` tells the engine the same thing (ignoring version, time and reason)."""
        return (
            other is not None
            and self.k_table == other.k_table
            and self.method == other.method
            and self.plan == other.plan
            and self.rule == other.rule
            and self.ttl_s == other.ttl_s
        )
