"""The slow loop's learner interface: one bandit problem per context, one round per decision."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.arms import Arm, Method
from policies.context import Context
from policies.observation import StepBatch, StepObservation
from policies.params import Param, shown


class ArmTable:
    """Per-context sufficient statistics (weight, sum, sum of squares) over a fixed arm list."""

    __slots__ = ("n", "q", "s")

    def __init__(self, n_arms: int) -> None:
        self.n = np.zeros(n_arms)
        self.s = np.zeros(n_arms)
        self.q = np.zeros(n_arms)

    def add(self, i: int, reward: float, weight: float) -> None:
        self.n[i] += weight
        self.s[i] += weight * reward
        self.q[i] += weight * reward * reward

    def decay(self, gamma: float) -> None:
        self.n *= gamma
        self.s *= gamma
        self.q *= gamma

    def means(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.n > 0, self.s / np.where(self.n > 0, self.n, 1.0), np.nan)

    def to_json(self) -> dict[str, list[float]]:
        return {"n": self.n.tolist(), "s": self.s.tolist(), "q": self.q.tolist()}

    @classmethod
    def from_json(cls, d: Mapping[str, Sequence[float]], n_arms: int) -> ArmTable:
        t = cls(n_arms)
        for name in ("n", "s", "q"):
            v = np.asarray(d[name], dtype=np.float64)
            if v.shape != (n_arms,):
                raise ValueError(f"arm table {name}: expected {n_arms} values, got {v.shape}")
            setattr(t, name, v)
        return t


class Learner(ABC):
    """A bandit over ``arms``, kept separately per context key.

    Rewards are goodput in tokens per second. ``update`` takes one round's mean reward per arm
    observed in that round; ``select`` picks the arm for the next round among ``allowed`` indices.
    """

    NAME: ClassVar[str]
    PARAMS: ClassVar[Mapping[str, Param]] = {}

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        self.arms = tuple(arms)
        self.params = dict(params)
        self.rng = rng
        self.tables: dict[Context, ArmTable] = {}

    def table(self, ctx: Context) -> ArmTable:
        t = self.tables.get(ctx)
        if t is None:
            t = self.tables[ctx] = ArmTable(len(self.arms))
        return t

    def update(self, ctx: Context, rewards: Mapping[int, float]) -> None:
        """One round in ``ctx``: ``rewards`` maps arm index to its mean goodput in the round."""
        t = self.table(ctx)
        self._before_round(t)
        for i, r in rewards.items():
            t.add(i, r, 1.0)

    def observe_round(self, ctx: Context, rows: np.ndarray, tokens: np.ndarray) -> None:  # noqa: B027
        """Optional hook, after ``update``: request-steps each arm drafted in ``ctx`` this round, and the
        tokens they emitted (arrays over ``arms``)."""

    def _before_round(self, t: ArmTable) -> None:  # noqa: B027 - optional hook
        """Hook for discounting."""

    def observe(self, batch: StepBatch, buckets: Sequence[str], per_class: bool) -> None:  # noqa: B027
        """Hook for learners that model steps directly, before any round: the steps of one report in
        order (each with requests and a positive duration), ``buckets`` their batch buckets' labels;
        ``per_class``: learn per traffic class as well as pooled."""

    def plan_bucket(
        self, bucket: str, classes: Sequence[str], allowed: Sequence[int], *, sample: bool = True
    ) -> dict[str, int] | None:
        """A joint choice for all contexts of one batch bucket (keys: class names and ``"*"``).

        Learners that can price how classes sharing a batch interact (one EAGLE draft pass serves every
        row) return it; the default None makes the loop choose per context with ``select``.
        ``sample=False`` asks for the greedy plan (no exploration, no random draws).
        """
        return None

    def plan_draws(self, bucket: str, classes: Sequence[str], allowed: Sequence[int]) -> None:
        """The random draws ``plan_bucket`` (sampling) would make, in the same order, without the plan.

        The loop calls it for a bucket whose contexts were all idle this round: none of them reads the
        sampled plan, but every later draw must come out as it would have. The default plans and drops
        the plan; a learner whose planning costs more than its draws makes only the draws.
        """
        self.plan_bucket(bucket, classes, allowed)

    def on_drift(self, cls: str, method: Method, keep: float) -> None:
        """Acceptance of ``method`` changed for traffic class ``cls``: re-explore its arms there.

        Tabular learners keep ``keep`` of the weight of those arms' statistics in every context of the
        class, so their posteriors widen (0: they count as untried again).
        """
        idx = [i for i, a in enumerate(self.arms) if a.method is method]
        for ctx, t in self.tables.items():
            if idx and ctx.traffic_class == cls:
                t.n[idx] *= keep
                t.s[idx] *= keep
                t.q[idx] *= keep

    @abstractmethod
    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        """Index of the arm to play next in ``ctx``."""

    def estimates(self, ctx: Context) -> np.ndarray:
        """Current goodput estimate per arm (NaN where unobserved)."""
        return self.table(ctx).means()

    def switch_check(
        self,
        ctx: Context,
        allowed: Sequence[int],
        current: int,
        new: int,
        *,
        others: Mapping[Context, int] | None = None,
    ) -> tuple[float, float] | None:
        """(predicted goodput gain of ``new`` over ``current``, the margin it must beat), in tok/s;
        ``others``: the arm in play in every other context (learners that plan a bucket jointly judge
        a class's switch with its peers on theirs).

        Learners that know how uncertain their predictions are return a margin learned from it (the
        hysteresis on value: no switch unless the gain beats it); the default None leaves only the
        policy's ``switch_margin`` and dwell.
        """
        return None

    def bounded_move(self, ctx: Context, allowed: Sequence[int], current: int, new: int) -> int:
        """The arm to move to from ``current`` when the plan says ``new``: ``new`` itself, unless the
        learner cannot yet predict so far from what it has seen (then a nearer arm on the way)."""
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"tables": {c.key: t.to_json() for c, t in self.tables.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.tables = {
            Context.parse(c): ArmTable.from_json(t, len(self.arms)) for c, t in state["tables"].items()
        }


class StepwiseLearner(Learner):
    """A learner that reads a report's steps one at a time (its statistics are per step)."""

    def observe(self, batch: StepBatch, buckets: Sequence[str], per_class: bool) -> None:
        for obs, bucket in zip(batch.steps, buckets, strict=True):
            self._observe_step(obs, bucket, per_class)

    @abstractmethod
    def _observe_step(self, obs: StepObservation, bucket: str, per_class: bool) -> None:
        """Learn from one step (with requests and a positive duration) of batch bucket ``bucket``."""


def greedy(means: np.ndarray, allowed: Sequence[int]) -> int:
    """The allowed arm with the best mean; unobserved arms first, in order, so each gets tried once."""
    for i in allowed:
        if np.isnan(means[i]):
            return i
    return max(allowed, key=lambda i: means[i])


def saved_numbers(
    value: Any, where: str, shape: tuple[int | None, ...], *, lo: float = 0.0, hi: float = math.inf
) -> np.ndarray:
    """A saved array of ``shape`` (a leading None: any length), every value a finite number in [lo, hi]; for
    learners' ``load_state_dict``, whose snapshots come from disk and the network. Raises ValueError
    naming ``where`` (a string of digits or a bool is not a number here, though numpy would take it)."""
    dims = " x ".join("n" if d is None else str(d) for d in shape)

    def fits(v: Any, rest: tuple[int | None, ...]) -> bool:
        if not rest:
            return isinstance(v, int | float) and not isinstance(v, bool)
        return (
            isinstance(v, list | tuple)
            and (rest[0] is None or len(v) == rest[0])
            and all(fits(x, rest[1:]) for x in v)
        )

    if not fits(value, shape):
        raise ValueError(f"{where}: expected a list of numbers of shape ({dims}), got {shown(value)}")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except OverflowError:  # an integer beyond a double's range
        raise ValueError(f"{where}: holds a number beyond a double's range") from None
    if not (np.isfinite(arr).all() and (arr >= lo).all() and (arr <= hi).all()):
        raise ValueError(f"{where}: every value must be finite and in [{lo:g}, {hi:g}], got {shown(value)}")
    return arr
