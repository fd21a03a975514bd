"""The slow loop's learner interface: one bandit problem per context, one round per decision."""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.arms import Arm, Method
from policies.context import MAX_BATCH_SIZE, Context
from policies.observation import StepBatch, StepObservation
from policies.params import Param, shown

#: The largest saved counter: every integer up to it is exact in a double (the loop's own bound; it
#: cannot be imported from ``policies.loop``, which imports the learners).
MAX_COUNT = (1 << 53) - 1
#: The largest reward (goodput, tokens per second) a saved state may hold: far above any engine (2^20
#: requests emitting 65 tokens each in a microsecond step make 7e13), and low enough that the sums of
#: squares learners form from saved statistics cannot overflow (a Python float's ** raises then).
MAX_REWARD = 1e18
#: A batch bucket's label as ``BatchBuckets.label`` writes it: ``N``, ``LO-HI`` or ``LO+``.
_BUCKET = re.compile(r"(?P<lo>[1-9][0-9]{0,6})(?:-(?P<hi>[1-9][0-9]{0,6})|(?P<plus>\+))?")


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
    def from_json(cls, d: Any, n_arms: int, where: str = "arm table") -> ArmTable:
        """A saved table; raises ValueError naming ``where`` unless it holds ``n_arms`` finite values per
        statistic that rounds of rewards could have summed to: weights in [0, MAX_COUNT] (one per round),
        sums within ``MAX_REWARD`` times the weight, sums of squares within its square (a weighted
        mean reward beyond it overflowed the learners' arithmetic; a reward may have any sign)."""
        d = saved_mapping(d, where, "a mapping with n, s and q")
        n = saved_numbers(d.get("n"), f"{where}.n", (n_arms,), hi=MAX_COUNT)
        s = saved_numbers(d.get("s"), f"{where}.s", (n_arms,), lo=-math.inf)
        q = saved_numbers(d.get("q"), f"{where}.q", (n_arms,))
        for name, v, bound in (("s", np.abs(s), MAX_REWARD), ("q", q, MAX_REWARD**2)):
            over = np.flatnonzero(v > n * bound)
            if over.size:
                raise ValueError(
                    f"{where}.{name}: arm {int(over[0])}'s mean beyond {bound:g} for its weight {n[over[0]]:g}"
                )
        t = cls(n_arms)
        t.n, t.s, t.q = n, s, q
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
        """Load what ``state_dict`` saved. Snapshots come from disk and the network: every field is
        checked first (``_loaded``), and on ValueError, naming the field, nothing of the learner changed."""
        for name, value in self._loaded(saved_mapping(state, "learner state", "a mapping")).items():
            setattr(self, name, value)

    def _loaded(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The attributes a saved ``state`` restores, by name, all checked; raises ValueError naming the
        first field of the wrong shape. Subclasses add their own fields to their base's."""
        n = len(self.arms)
        tables = saved_mapping(state.get("tables"), "tables", "a mapping of context to arm table")
        return {
            "tables": {
                saved_context(c, "tables"): ArmTable.from_json(t, n, f"tables[{c!r}]")
                for c, t in tables.items()
            }
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
    value: Any,
    where: str,
    shape: tuple[int | None, ...],
    *,
    lo: float = 0.0,
    hi: float = math.inf,
    infinite: bool = False,
) -> np.ndarray:
    """A saved array of ``shape`` (a leading None: any length), every value a finite number in [lo, hi]
    (``infinite``: or +-inf where [lo, hi] holds it; never NaN); for learners' ``load_state_dict``,
    whose snapshots come from disk and the network. Raises ValueError naming ``where`` (a string of
    digits or a bool is not a number here, though numpy would take it)."""
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
    if not ((infinite or np.isfinite(arr).all()) and (arr >= lo).all() and (arr <= hi).all()):
        what = "a number" if infinite else "finite"
        raise ValueError(f"{where}: every value must be {what} and in [{lo:g}, {hi:g}], got {shown(value)}")
    return arr


def saved_mapping(value: Any, where: str, what: str) -> Mapping[str, Any]:
    """``value`` if it is a mapping with string keys (what JSON objects are); else ValueError naming
    ``where`` and ``what`` was expected."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: {what} expected, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise ValueError(f"{where}: keys must be strings, got {shown(k)}")
    return value


def saved_number(value: Any, where: str, *, lo: float = 0.0, hi: float = math.inf) -> float:
    """A saved finite number in [lo, hi] (not a bool nor a string of digits); ValueError naming ``where``."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    try:
        x = float(value) if ok else math.nan
    except OverflowError:  # an integer beyond a double's range
        x = math.nan
    if not (math.isfinite(x) and lo <= x <= hi):
        raise ValueError(f"{where}: expected a finite number in [{lo:g}, {hi:g}], got {shown(value)}")
    return x


def saved_count(value: Any, where: str) -> int:
    """A saved counter: an integer in [0, MAX_COUNT]; ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{where}: expected an integer in [0, {MAX_COUNT}], got {shown(value)}")
    return value


def saved_flag(value: Any, where: str) -> bool:
    """A saved bool (``bool()`` would take any string, "false" included, as true); ValueError naming ``where``."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {shown(value)}")
    return value


def saved_class(value: Any, where: str) -> str:
    """A saved traffic class name: any non-empty string (what a context takes); ValueError naming ``where``."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: expected a traffic class (a non-empty string), got {shown(value)}")
    return value


def saved_bucket(label: Any, where: str) -> str:
    """A saved batch bucket label, as ``BatchBuckets.label`` writes one (``N``, ``LO-HI``, ``LO+``, bounds
    in [1, MAX_BATCH_SIZE]); ValueError naming ``where``. Learners are not told the policy's buckets, so
    only the form is checked: a label of other buckets is never looked up, but one that is not a
    label at all would fail where a learner reads the batch size off it."""
    m = _BUCKET.fullmatch(label) if isinstance(label, str) else None
    lo = int(m["lo"]) if m else 0
    hi = int(m["hi"]) if m and m["hi"] else lo
    # The open bucket starts one past the last bound, which may itself be MAX_BATCH_SIZE.
    top = MAX_BATCH_SIZE + 1 if m and m["plus"] else MAX_BATCH_SIZE
    if m is None or hi > top or hi < lo or (m["hi"] and hi == lo):
        raise ValueError(f"{where}: {shown(label)} is not a batch bucket label (N, LO-HI or LO+)")
    return str(label)


def saved_context(key: Any, where: str) -> Context:
    """A saved context key (``BUCKET/CLASS``, the bucket a label ``saved_bucket`` takes); ValueError
    naming ``where`` and the key."""
    at = f"{where}[{shown(key)}]"
    if not isinstance(key, str):
        raise ValueError(f"{where}: keys must be contexts (BUCKET/CLASS), got {shown(key)}")
    try:
        ctx = Context.parse(key)
    except ValueError as e:
        raise ValueError(f"{at}: {e}") from None
    saved_bucket(ctx.bucket, at)
    return ctx
