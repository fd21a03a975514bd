"""The ControlLoop: observe step reports, decide Directives. Pure and clock-injected.

The sidecar wraps it with gRPC and asyncio; the simulator drives it directly with a virtual clock.
Each decision is one bandit round per context: the goodput each arm achieved in the context since the
last decision becomes that arm's reward, then the learner picks the arm for the next round.

Contexts: for each batch bucket a pooled context ``<bucket>/*`` over all requests (what a
batch-granular engine can act on, and the fallback for classes not seen yet), plus ``<bucket>/<class>``
per traffic class when the engine can choose per request and the policy learns per class.

Random draws (exploration) come from the loop's own generator: a fleet warm start (``load_learned``)
takes another engine's learned tables but never its generator, and the sidecar seeds each engine's
loop with ``engine_seed`` so engines of one policy do not draw the same numbers.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from policies.algorithms import REGISTRY, Learner
from policies.algorithms.base import MAX_REWARD, saved_mapping, saved_number, saved_numbers
from policies.arms import METHODS_BY_CODE, Arm, Method
from policies.context import ANY_CLASS, Context
from policies.directive import Directive, KRange, PlanEntry
from policies.drift import DriftMonitor
from policies.engine import EngineInfo, Granularity
from policies.guards import ExplorationBudget, TpotGuard, greedy_choice, keeps_current
from policies.observation import NOT_SCORED, StepBatch
from policies.params import shown
from policies.spec import PolicySpec

#: The largest counter a saved state may hold: every JSON reader keeps integers up to it exact.
MAX_COUNT = (1 << 53) - 1

_OFF_CODE = METHODS_BY_CODE.index(Method.OFF)

STATE_VERSION = 1
#: The longest directive reason a saved state may hold (``_build`` writes about a kilobyte at most).
MAX_REASON = 1 << 16
#: How far before the saved decision a saved dwell or issue time may be (about 30 years): further, the
#: shift of a clock behind (``_resume``) could overflow it to -inf, which no snapshot holds.
MAX_AGE_S = 1e9


def engine_seed(seed: int, engine_id: str) -> int:
    """The seed of one engine's loop under a policy of seed ``seed``: a 32-bit word (a valid policy
    seed) that differs from engine to engine and is the same on every run and every machine. Engines
    of one policy seeded alike explored in step (the same draws on the same tables after a warm start).
    """
    digest = hashlib.sha256(engine_id.encode("utf-8", "surrogatepass")).digest()
    words = np.frombuffer(digest, dtype="<u4").tolist()
    return int(np.random.SeedSequence([seed, *words]).generate_state(1)[0])


@dataclass(slots=True)
class Totals:
    """Lifetime counters of what the engine reported (for status and snapshots)."""

    steps: int = 0
    request_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    busy_s: float = 0.0
    ignored_rows: int = 0
    #: Safety and drift events: Page-Hinkley alarms, switches held back by the margin, exploratory
    #: choices replaced by the greedy one (budget at high load), TPOT-guard tightenings, moves the
    #: cost model could not price yet cut short (``Learner.bounded_move``).
    drift_alarms: int = 0
    held_by_margin: int = 0
    exploration_denied: int = 0
    tpot_trips: int = 0
    bounded_moves: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, path: str) -> Totals:
        """Counters saved by ``dataclasses.asdict`` (a snapshot, the fleet), each in range (a missing
        one is 0). Raises ValueError naming the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: expected an object, got {type(d).__name__}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            v = d.get(f.name, 0)
            where = f"{path}.{f.name}"
            if f.type in (float, "float"):
                if isinstance(v, bool) or not isinstance(v, int | float):
                    raise ValueError(f"{where}: expected a number, got {type(v).__name__}")
                if not 0 <= v <= MAX_COUNT:  # NaN and the infinities fail it too
                    raise ValueError(f"{where}: {v!r} is outside [0, {MAX_COUNT}]")
                values[f.name] = float(v)
            else:
                values[f.name] = _count(v, where)
        return cls(**values)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def goodput(self) -> float:
        return self.emitted / self.busy_s if self.busy_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Change:
    """One context's arm change at a decision."""

    context: Context
    before: Arm | None
    after: Arm
    estimate: float


@dataclass(slots=True)
class _Acc:
    """Request-steps, tokens emitted and engine time used, per arm, in one context since the last
    decision."""

    tokens: np.ndarray
    time_s: np.ndarray
    rows: np.ndarray


@dataclass(slots=True)
class _Ctx:
    arm: int
    #: When the context got its arm (the ``now`` of that decision); -inf: no arm yet, or its dwell is over.
    since: float
    rounds: int = 0
    acc: _Acc | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"arm": self.arm, "rounds": self.rounds}
        if math.isfinite(self.since):
            out["since_s"] = self.since
        if self.acc is not None:
            a = self.acc
            out["acc"] = {"rows": a.rows.tolist(), "tokens": a.tokens.tolist(), "time_s": a.time_s.tolist()}
        return out


class ControlLoop:
    def __init__(self, *, spec: PolicySpec, engine: EngineInfo, seed: int | None = None) -> None:
        self.spec = spec
        self.engine = engine
        #: Bound every switch the cost model cannot price yet, not only first arms (see ``decide``).
        self._bound_switches = engine.granularity is Granularity.BATCH_STEP
        self.arms: tuple[Arm, ...] = engine.playable(spec.arms) or engine.playable(())
        if not self.arms:
            raise ValueError(f"engine {engine.engine_id!r} offers no arm the policy {spec.name!r} can use")
        self._index = {a: i for i, a in enumerate(self.arms)}
        self.rng = np.random.default_rng(spec.seed if seed is None else seed)
        self.learner: Learner = REGISTRY[spec.algorithm](arms=self.arms, params=spec.params, rng=self.rng)
        self.totals = Totals()
        self.rounds = 0
        self.version = 0
        self._ctx: dict[Context, _Ctx] = {}
        self._last_decision: float | None = None
        #: Set by ``load_state_dict``: the ``now`` of the saved loop's last decision, until the first
        #: clock reading after the load (see ``_resume``).
        self._resume_at: float | None = None
        self._directive: Directive | None = None
        self.last_changes: tuple[Change, ...] = ()
        self._learn_classes = spec.per_class and engine.per_request
        # Row (method code, k) -> arm index; -1 for arms outside the policy's set.
        self._arm_lut = np.full((len(METHODS_BY_CODE), engine.max_k + 1), -1, dtype=np.int64)
        for i, a in enumerate(self.arms):
            self._arm_lut[list(METHODS_BY_CODE).index(a.method), a.k] = i
        self._allowed = self._plannable()
        self.drift = DriftMonitor.from_params(spec.drift) if spec.drift["detector"] != "none" else None
        self.tpot_guard = TpotGuard.from_params(spec.slo)
        self.budget = ExplorationBudget.from_params(spec.exploration)
        #: Drift alarms as (time, class, method), newest last (bounded).
        self.drift_events: list[tuple[float, str, Method]] = []
        # Alarms of the step being observed, applied to the learner after it has learnt from the step.
        self._alarms: list[tuple[str, Method]] = []
        self._labels: dict[int, str] = {}

    def _plannable(self) -> list[int]:
        """Arms the slow loop plans among.

        Under the ``ngram_span`` rule on an engine that picks the method per request, n-gram is drafted
        by the rule inside copy spans; the plan is the arm for the positions between spans, where an
        always-on n-gram arm would verify drafts that are almost never accepted.
        """
        every = list(range(len(self.arms)))
        if self.spec.rule.kind != "ngram_span" or self.engine.granularity is not Granularity.REQUEST_METHOD:
            return every
        rest = [i for i, a in enumerate(self.arms) if a.method is not Method.NGRAM]
        return rest if any(self.arms[i].speculates for i in rest) else every

    # -- observe ---------------------------------------------------------------------------------

    def observe(self, batch: StepBatch) -> None:
        """Learn from the steps of one report, in order (the simulator's reports hold one step).

        The learner gets one update for the batch; a drift alarm splits it where it fires, so the
        learner is shrunk after the step that fired it and before the ones after.
        """
        t = self.totals
        t.steps += len(batch)
        durations = batch.duration_s.tolist()
        for d in durations:  # summed step by step, as the engine's busy time grows
            t.busy_s += max(d, 0.0)
        # Per step in Python values (indexing numpy arrays element by element costs more).
        learnable = [
            i for i, (r, d) in enumerate(zip(batch.n.tolist(), durations, strict=True)) if r and d > 0
        ]
        if not learnable:
            return
        batch = batch.take(learnable)
        n = batch.n
        method = batch.method.astype(np.int64)
        accepted = batch.accepted
        n_all = int(n.sum())
        t.request_steps += n_all
        acc_sum = int(accepted.sum())
        t.drafted += int(batch.drafted.sum())
        t.accepted += acc_sum
        t.emitted += acc_sum + n_all  # StepObservation.emitted, without summing twice
        k = np.where(method == _OFF_CODE, 0, np.minimum(batch.k, self.engine.max_k))
        arm = self._arm_lut[method, k]
        known = arm >= 0
        steps = len(batch)
        known_in = np.bincount(batch.step_of[known], minlength=steps)
        t.ignored_rows += n_all - int(known_in.sum())
        label_of = [self._label(b) for b in batch.batch_size.tolist()]
        learn = [i for i, c in enumerate(known_in.tolist()) if c]
        if not learn:
            return
        pending: list[int] = []
        # Guards see every step in order (a no-op loop when neither is on).
        for i in learn if self.tpot_guard.enabled or self.drift is not None else ():
            pending.append(i)
            rows = batch.rows(i)
            self.tpot_guard.observe(label_of[i], float(batch.duration_s[i]), accepted[rows][known[rows]])
            if self.drift is not None:
                self._watch_drift(batch, i)
                if self._alarms:
                    self.learner.observe(
                        batch.take(pending), [label_of[j] for j in pending], self._learn_classes
                    )
                    pending = []
                    self._apply_alarms()
        if not self.tpot_guard.enabled and self.drift is None:
            pending = learn
        if pending:
            self.learner.observe(batch.take(pending), [label_of[j] for j in pending], self._learn_classes)
        tokens = accepted.astype(np.float64) + 1.0
        if steps == 1:
            share: float | np.ndarray = float(batch.duration_s[0]) / int(n[0])
        else:
            share = np.repeat(batch.duration_s / n, n)
        row_label = None if len(set(label_of)) == 1 else np.repeat(np.array(label_of), n)
        classes = batch.class_of if self._learn_classes else None
        all_known = len(learn) == steps and bool(known.all())
        for label in dict.fromkeys(label_of[i] for i in learn):
            in_bucket = known if row_label is None else known & (row_label == label)
            if row_label is None and all_known:  # the usual batch: every row counts, one bucket
                self._accumulate(Context(bucket=label), arm, tokens, share)
            else:
                self._accumulate(
                    Context(bucket=label), arm[in_bucket], tokens[in_bucket], _rows(share, in_bucket)
                )
            if classes is not None:
                for c, j in batch.classes_in(in_bucket):
                    rows_c = in_bucket & (classes == j)
                    ctx = Context(bucket=label, traffic_class=c)
                    self._accumulate(ctx, arm[rows_c], tokens[rows_c], _rows(share, rows_c))

    def _label(self, batch_size: int) -> str:
        """The batch bucket's label for a batch size (memoised: the buckets never change)."""
        label = self._labels.get(batch_size)
        if label is None:
            buckets = self.spec.buckets
            label = buckets.label(buckets.index(batch_size))
            if len(self._labels) < 4096:
                self._labels[batch_size] = label
        return label

    def _watch_drift(self, batch: StepBatch, i: int) -> None:
        """Feed step ``i``'s first-position acceptance per (class, method); re-explore where it changed."""
        assert self.drift is not None
        codes = list(METHODS_BY_CODE)
        r = batch.rows(i)
        method, k, accepted = batch.method[r], batch.k[r], batch.accepted[r]
        # Pooled first, then the step's own classes by name: (name, index into class_names or -1). The
        # class column is read only when classes are learnt (a batch of whole steps builds it on use).
        names = [(ANY_CLASS, -1)]
        classes = None
        if self._learn_classes:
            classes = batch.class_of[r]
            names += batch.classes_in(r)
        now = float(batch.time_s[i])
        for code in np.unique(method):
            m = METHODS_BY_CODE[int(code)]
            if m is Method.OFF:
                continue
            self._feed_drift(now, names, classes, m, method == code, k, accepted)
        depth = batch.counterfactual_depth[i]
        for m, cf in batch.step_counterfactual(i).items():
            if m is Method.OFF or depth.get(m, 1) < 1:
                continue
            # Rows verified with the same method are already counted from their verified draft.
            rows = (cf != NOT_SCORED) & (method != codes.index(m))
            self._feed_drift(now, names, classes, m, rows, np.ones_like(cf), cf)

    def _feed_drift(
        self,
        now: float,
        names: list[tuple[str, int]],
        classes: np.ndarray | None,
        method: Method,
        rows: np.ndarray,
        k: np.ndarray,
        accepted: np.ndarray,
    ) -> None:
        assert self.drift is not None
        rows = rows & (k > 0)
        for cls, j in names:
            sel = rows if classes is None or j < 0 else rows & (classes == j)
            if sel.any() and self.drift.feed((cls, method.value), (accepted[sel] >= 1).astype(np.float64)):
                self.totals.drift_alarms += 1
                self._alarms.append((cls, method))
                self.drift_events = [*self.drift_events[-63:], (now, cls, method)]

    def _apply_alarms(self) -> None:
        """Re-explore where drift fired, once the learner has seen the step that fired it."""
        for cls, method in self._alarms:
            self.learner.on_drift(cls, method, float(self.spec.drift["shrink"]))
        self._alarms.clear()

    def _accumulate(
        self, ctx: Context, arm: np.ndarray, tokens: np.ndarray, share: float | np.ndarray
    ) -> None:
        """``share``: each row's share of its step's engine time (one value when all rows share a step)."""
        c = self._context(ctx)
        n = len(self.arms)
        if c.acc is None:
            c.acc = _Acc(np.zeros(n), np.zeros(n), np.zeros(n))
        c.acc.tokens += np.bincount(arm, weights=tokens, minlength=n)
        rows = np.bincount(arm, minlength=n)
        c.acc.rows += rows
        if isinstance(share, np.ndarray):
            c.acc.time_s += np.bincount(arm, weights=share, minlength=n)
        else:
            c.acc.time_s += rows * share

    def _context(self, ctx: Context) -> _Ctx:
        c = self._ctx.get(ctx)
        if c is None:
            c = self._ctx[ctx] = _Ctx(arm=-1, since=-np.inf)
        return c

    # -- decide ----------------------------------------------------------------------------------

    def due(self, now: float) -> bool:
        self._resume(now)
        last = self._last_decision
        if last is not None and now < last and math.isfinite(now):
            # The clock stepped back (a wall clock set back by NTP, a VM resumed): the timers move
            # with it, as after a load (``_resume``). Left as they were, no round would run and no
            # context could leave its arm until the clock caught up with the last decision: an hour
            # set back, an hour without learning.
            self._shift(now - last)
        return self._last_decision is None or now - self._last_decision >= self.spec.decision_interval_s

    def _resume(self, now: float) -> None:
        """The first clock reading after ``load_state_dict``. The saved timers (the last decision, each
        context's dwell, the directive's issue time) are the saving loop's clock readings: they hold as
        they are while the clock goes on from there (a restart on the same wall clock, the simulator's
        clock). A clock behind the last decision is not the one that wrote them (another process's
        monotonic clock, a wall clock set back): then they move with it, by as much as it is behind,
        so each keeps the age it had at that decision; left as they were, a context would hold its arm
        and the loop its directive until the clock caught up."""
        at = self._resume_at
        if at is None:
            return
        self._resume_at = None
        if not now < at:  # NaN included: nothing to move by
            return
        self._shift(now - at)

    def _shift(self, shift: float) -> None:
        """Move every timer (the last decision, each context's dwell, the directive's issue time) by
        ``shift`` seconds: each keeps its age on a clock that is ``-shift`` behind the one that set it."""
        for c in self._ctx.values():
            c.since += shift
        if self._last_decision is not None:
            self._last_decision += shift
        if self._directive is not None:
            self._directive = replace(self._directive, issued_at_s=self._directive.issued_at_s + shift)

    def decide(self, now: float) -> Directive:
        """The Directive in force; runs a bandit round first when the decision interval has passed."""
        if self._directive is not None and not self.due(now):
            return self._directive
        self._last_decision = now
        self.rounds += 1
        changes: list[Change] = []
        for b in range(len(self.spec.buckets)):
            self._context(Context(bucket=self.spec.buckets.label(b)))
        joint: dict[Context, int] = {}
        greedy_joint: dict[Context, int] = {}
        allowed_in: dict[str, list[int]] = {}
        high_load: set[str] = set()
        for b in range(len(self.spec.buckets)):
            label = self.spec.buckets.label(b)
            keys = [k for k in self._ctx if k.bucket == label]
            playing = max((self.arms[self._ctx[k].arm].k for k in keys if self._ctx[k].arm >= 0), default=0)
            cap = self.tpot_guard.update(label, playing)
            allowed = self.tpot_guard.restrict(self.arms, self._allowed, cap)
            allowed_in[label] = allowed
            classes = [k.traffic_class for k in keys if not k.pooled]
            # A context idle this round with an arm never reads the sampled plan (it follows the
            # greedy plan, or ``select`` where no plan names it). When every context of the bucket
            # is such, only the plan's random draws are made, so that every later draw is the same.
            idle = sum(1 for k in keys if self._ctx[k].acc is None and self._ctx[k].arm >= 0)
            if idle == len(keys):
                self.learner.plan_draws(label, classes, allowed)
            else:
                plan = self.learner.plan_bucket(label, classes, allowed)
                if plan:
                    joint.update({Context(bucket=label, traffic_class=c): i for c, i in plan.items()})
            high = self.budget.applies(self.spec.buckets.range(b))
            if high:
                high_load.add(label)
            # The greedy plan (no draws) serves the exploration budget and the idle contexts.
            greedy_plan = (
                self.learner.plan_bucket(label, classes, allowed, sample=False) if high or idle else None
            )
            if greedy_plan:
                greedy_joint.update(
                    {Context(bucket=label, traffic_class=c): i for c, i in greedy_plan.items()}
                )
        self.totals.tpot_trips = self.tpot_guard.trips
        # The arm in play per context, kept up to date as the round moves contexts (what
        # ``switch_check`` judges a class's switch with). Built once: rebuilt for every context that
        # proposed a switch, a round with a thousand contexts took about a second.
        in_play = {k: x.arm for k, x in self._ctx.items() if x.arm >= 0}
        for key, c in sorted(self._ctx.items()):
            acc = c.acc
            active = acc is not None
            if acc is not None:
                seen = acc.time_s > 0
                rewards = {int(i): float(acc.tokens[i] / acc.time_s[i]) for i in np.flatnonzero(seen)}
                self.learner.update(key, rewards)
                self.learner.observe_round(key, acc.rows, acc.tokens)
                c.acc = None
                c.rounds += 1
            label = key.bucket
            allowed = allowed_in.get(label, self._allowed)
            forced = c.arm >= 0 and c.arm not in allowed  # the TPOT guard excluded the current arm
            if c.arm >= 0 and now - c.since < self.spec.min_dwell_s and not forced:
                continue
            est = self.learner.estimates(key)
            if not active and c.arm >= 0 and key in greedy_joint:
                # Nothing ran here this round, so there is nothing to explore: a context without
                # traffic follows the models' greedy plan instead of flipping with every draw.
                choice = greedy_joint[key]
            else:
                planned = joint.get(key)
                choice = self.learner.select(key, allowed) if planned is None else planned
            if label in high_load:
                best = greedy_joint.get(key, greedy_choice(est, allowed))
                exploratory = best is not None and choice != best
                if not self.budget.permit(key, exploratory):
                    assert best is not None
                    choice = best
                    self.totals.exploration_denied += 1
            # Moves the cost model cannot price yet are bounded (``Learner.bounded_move``): a class's
            # first arm, from its bucket's pooled arm; on an engine with one K per batch, every switch
            # (there the cost model sees K vary only when a bucket's arm changes).
            ref = c.arm if c.arm >= 0 else self._ctx[Context(bucket=label)].arm
            if ref >= 0 and choice != ref and not forced and (c.arm < 0 or self._bound_switches):
                bounded = self.learner.bounded_move(key, allowed, ref, choice)
                if bounded != choice:
                    self.totals.bounded_moves += 1
                    choice = bounded
            learnt = (
                self.learner.switch_check(key, allowed, c.arm, choice, others=MappingProxyType(in_play))
                if c.arm >= 0 and choice != c.arm and not forced
                else None
            )
            if not forced and keeps_current(est, c.arm, choice, self.spec.switch_margin, learnt=learnt):
                self.totals.held_by_margin += 1
                continue
            if choice != c.arm:
                before = self.arms[c.arm] if c.arm >= 0 else None
                changes.append(Change(key, before, self.arms[choice], float(est[choice])))
                c.arm, c.since = choice, now
                in_play[key] = choice
        self.last_changes = tuple(changes)
        new = self._build(now, changes)
        if not new.same_decision(self._directive):
            self.version += 1
            new = replace(new, version=self.version)
            self._directive = new
        return self._directive if self._directive is not None else new

    def _build(self, now: float, changes: list[Change]) -> Directive:
        spec, eng = self.spec, self.engine
        k_table: list[KRange] = []
        plan: list[PlanEntry] = []
        for b in range(len(spec.buckets)):
            lo, hi = spec.buckets.range(b)
            label = spec.buckets.label(b)
            pooled = self.arms[self._ctx[Context(bucket=label)].arm]
            bucket_k = pooled.k
            if eng.per_request:
                plan.append(PlanEntry(ANY_CLASS, lo, hi, pooled))
                for key, c in sorted(self._ctx.items()):
                    cls = key.traffic_class
                    if key.bucket == label and not key.pooled and c.arm >= 0:
                        arm = self.arms[c.arm]
                        # A class on the bucket's own arm needs no entry ("*" covers it): a class
                        # seen for the first time then changes nothing and issues no new version.
                        if arm != pooled:
                            plan.append(PlanEntry(cls, lo, hi, arm))
                            bucket_k = max(bucket_k, arm.k)
            k_table.append(KRange(lo, hi, bucket_k))
        reason = "; ".join(f"{c.context} {c.before or '-'}→{c.after}" for c in changes[:8]) or "no change"
        if len(changes) > 8:
            reason += f"; +{len(changes) - 8} more"
        return Directive(
            version=self.version,
            policy=spec.name,
            reason=f"round {self.rounds}: {reason}",
            ttl_s=spec.directive_ttl_s,
            issued_at_s=now,
            k_table=_merge(k_table),
            method=eng.primary_method,
            plan=tuple(plan),
            rule=spec.rule,
        )

    # -- introspection ---------------------------------------------------------------------------

    @property
    def directive(self) -> Directive | None:
        return self._directive

    def current_arms(self) -> dict[Context, Arm]:
        return {k: self.arms[c.arm] for k, c in sorted(self._ctx.items()) if c.arm >= 0}

    def estimates(self) -> dict[Context, dict[Arm, float]]:
        out: dict[Context, dict[Arm, float]] = {}
        for key in sorted(self._ctx):
            m = self.learner.estimates(key)
            out[key] = {a: float(m[i]) for i, a in enumerate(self.arms) if not np.isnan(m[i])}
        return out

    # -- snapshots -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; ``load_state_dict`` on a loop of the same policy restores it, and the
        restored loop then decides as this one would: with the round in progress (each context's
        ``acc``), the dwell timers (``since_s``) and the decision timer and directive in force
        (``decision``). Times are the clock readings the loop was given (see ``_resume``)."""
        state: dict[str, Any] = {
            "state_version": STATE_VERSION,
            "policy": self.spec.name,
            "algorithm": self.spec.algorithm,
            "arms": [str(a) for a in self.arms],
            "rounds": self.rounds,
            "version": self.version,
            "totals": {f: getattr(self.totals, f) for f in Totals.__dataclass_fields__},
            "contexts": {k.key: c.to_json() for k, c in self._ctx.items()},
            "learner": self.learner.state_dict(),
            "rng": self.rng.bit_generator.state,
            "guards": {
                "drift": self.drift.state_dict() if self.drift is not None else None,
                "tpot": self.tpot_guard.state_dict(),
                "budget": self.budget.state_dict(),
            },
        }
        d = self._directive
        if self._last_decision is not None and d is not None:
            # The directive itself follows from the contexts' arms; only what they do not hold is kept.
            state["decision"] = {
                "at_s": self._last_decision,
                "issued_at_s": d.issued_at_s,
                "reason": d.reason,
            }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what ``state_dict`` saved. Raises ValueError, naming the field, for any state this loop
        cannot take (another version or arm set, or a document of the wrong shape: snapshots and the
        fleet's posteriors come from disk and the network). On error the loop is half loaded: the
        caller discards it (the sidecar builds a fresh one)."""
        try:
            self._load(state)
        except ValueError:
            raise
        except (ArithmeticError, LookupError, AttributeError, TypeError) as e:
            # The learners' and guards' own loaders trust the shape ``state_dict`` wrote.
            raise ValueError(f"loop state of the wrong shape: {type(e).__name__}: {e}") from e

    def _load(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise ValueError(f"loop state: a mapping expected, got {type(state).__name__}")
        if state.get("state_version") != STATE_VERSION:
            raise ValueError(f"loop state version {state.get('state_version')!r} is not {STATE_VERSION}")
        # Saved states are matched to a policy by its name (the sidecar's snapshot, the fleet's
        # posteriors), and nearly every learner reads another's tables: a same-named policy of another
        # algorithm took them in silence. Absent from the states older versions saved.
        algorithm = state.get("algorithm", self.spec.algorithm)
        if algorithm != self.spec.algorithm:
            raise ValueError(
                f"loop state was saved by algorithm {shown(algorithm)}, not {self.spec.algorithm}"
            )
        if [str(a) for a in self.arms] != list(state["arms"]):
            raise ValueError("loop state was saved for a different arm set")
        for key in ("learner", "totals", "contexts"):
            if not isinstance(state.get(key), Mapping):
                raise ValueError(f"loop state.{key}: a mapping expected, got {type(state.get(key)).__name__}")
        guards = state.get("guards") or {}
        if not isinstance(guards, Mapping):
            raise ValueError(f"loop state.guards: a mapping expected, got {type(guards).__name__}")
        # Absent from the snapshots of older versions (and null): no round had run, or it was not
        # saved; the first decision after the load then runs a round, with every dwell over.
        decision = _decision(state.get("decision"))
        contexts = {}
        for k, v in state["contexts"].items():
            where = f"loop state.contexts[{k!r}]"
            if not isinstance(v, Mapping):
                raise ValueError(f"{where}: a mapping expected, got {type(v).__name__}")
            arm, rounds = v.get("arm"), _count(v.get("rounds"), f"{where}.rounds")
            # -1: the context has not been given an arm yet
            if isinstance(arm, bool) or not isinstance(arm, int) or not -1 <= arm < len(self.arms):
                raise ValueError(
                    f"{where}.arm: {arm!r} is not an arm index (-1 or one of the policy's {len(self.arms)} arms)"
                )
            since = -np.inf
            if v.get("since_s") is not None:
                if arm < 0 or decision is None:
                    raise ValueError(f"{where}.since_s: saved for a context without an arm or a decision")
                since = saved_number(
                    v["since_s"], f"{where}.since_s", lo=decision[0] - MAX_AGE_S, hi=decision[0]
                )
            acc = self._saved_acc(v["acc"], f"{where}.acc") if v.get("acc") is not None else None
            contexts[Context.parse(k)] = _Ctx(arm=arm, since=since, rounds=rounds, acc=acc)
        for ctx in contexts:
            # A class's first arm is bounded from its bucket's pooled arm (``decide``): without that
            # context the state loaded, then every decision failed (KeyError) and the loop was reset.
            if ctx.traffic_class != ANY_CLASS and Context(bucket=ctx.bucket) not in contexts:
                raise ValueError(
                    f"loop state.contexts[{ctx.key!r}]: a class's context without its bucket's pooled one "
                    f"({Context(bucket=ctx.bucket).key!r})"
                )
        _section("learner", self.learner.load_state_dict, state["learner"])
        self.rounds = _count(state.get("rounds"), "loop state.rounds")
        self.version = _count(state.get("version"), "loop state.version")
        self.totals = Totals.from_json(state["totals"], path="loop state.totals")
        self._ctx = contexts
        _section("rng", setattr, self.rng.bit_generator, "state", state["rng"])
        if self.drift is not None and guards.get("drift"):
            _section("guards.drift", self.drift.load_state_dict, guards["drift"])
        for key in ("tpot", "budget"):
            if not isinstance(guards.get(key) or {}, Mapping):
                raise ValueError(f"loop state.guards.{key}: a mapping expected")
        _section("guards.tpot", self.tpot_guard.load_state_dict, guards.get("tpot") or {})
        _section("guards.budget", self.budget.load_state_dict, guards.get("budget") or {})
        self._directive = None
        self._last_decision = self._resume_at = None
        pooled = [
            contexts.get(Context(bucket=self.spec.buckets.label(b))) for b in range(len(self.spec.buckets))
        ]
        if decision is not None and all(c is not None and c.arm >= 0 for c in pooled):
            # The directive in force follows from the arms (``_build``), all but its time and reason.
            at, issued, reason = decision
            self._directive = replace(self._build(issued, []), reason=reason)
            self._last_decision = self._resume_at = at
        else:
            # No decision saved, or saved by a policy of other batch buckets: a round runs first.
            for c in contexts.values():
                c.since = -np.inf

    def load_learned(self, state: Mapping[str, Any]) -> None:
        """``load_state_dict`` of another engine's state (a fleet warm start): its learned tables, its
        guards and each context's arm, not what belongs to that engine's own traffic, clock and draws:
        its round in progress, its dwell timers, the directive it had in force and its random generator
        (this loop keeps its own). The first decision
        then runs a round, with every dwell over, as after an older version's snapshot."""
        if isinstance(state, Mapping) and isinstance(state.get("contexts"), Mapping):
            contexts = {
                k: {f: x for f, x in v.items() if f not in ("acc", "since_s")}
                if isinstance(v, Mapping)
                else v
                for k, v in state["contexts"].items()
            }
            state = {**{f: x for f, x in state.items() if f != "decision"}, "contexts": contexts}
        if isinstance(state, Mapping):
            # This loop's own generator, not the donor's: every replica warm-started from one donor
            # took its state before and drew the same numbers on the same tables (explored in step).
            state = {**state, "rng": self.rng.bit_generator.state}
        self.load_state_dict(state)

    def _saved_acc(self, value: Any, where: str) -> _Acc:
        """A context's saved round in progress (``_Acc``); ValueError naming the field."""
        d = saved_mapping(value, where, "a mapping with rows, tokens and time_s")
        n = len(self.arms)
        rows = saved_numbers(d.get("rows"), f"{where}.rows", (n,), hi=MAX_COUNT)
        if (rows != np.floor(rows)).any():
            raise ValueError(f"{where}.rows: request-steps are whole numbers, got {rows.tolist()}")
        tokens = saved_numbers(d.get("tokens"), f"{where}.tokens", (n,), hi=MAX_COUNT)
        time_s = saved_numbers(d.get("time_s"), f"{where}.time_s", (n,))
        # The round's reward per arm is tokens / time: bounded as the learners bound what they saved.
        over = np.flatnonzero((time_s > 0) & (tokens > time_s * MAX_REWARD))
        if over.size:
            raise ValueError(f"{where}.tokens: arm {int(over[0])}'s goodput is beyond {MAX_REWARD:g}")
        return _Acc(tokens=tokens, time_s=time_s, rows=rows)


def _section(name: str, load: Callable[..., Any], *args: Any) -> None:
    """Run one part's own loader (they trust the shape ``state_dict`` wrote); any error of the wrong
    shape becomes a ValueError naming the part."""
    try:
        load(*args)
    except ValueError as e:
        raise ValueError(f"loop state.{name}: {e}") from e
    except (ArithmeticError, LookupError, AttributeError, TypeError) as e:
        raise ValueError(f"loop state.{name}: of the wrong shape ({type(e).__name__}: {e})") from e


def _decision(value: Any) -> tuple[float, float, str] | None:
    """The saved ``decision``: (its time, the directive's issue time, the directive's reason), or None."""
    if value is None:
        return None
    where = "loop state.decision"
    d = saved_mapping(value, where, "a mapping with at_s, issued_at_s and reason")
    # A clock reading: the sidecar's wall clock (up to ~1e10), the simulator's seconds from 0.
    at = saved_number(d.get("at_s"), f"{where}.at_s", lo=-MAX_AGE_S, hi=1e12)
    issued = saved_number(d.get("issued_at_s"), f"{where}.issued_at_s", lo=at - MAX_AGE_S, hi=at)
    reason = d.get("reason")
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        raise ValueError(f"{where}.reason: expected a string of at most {MAX_REASON} characters")
    return at, issued, reason


def _count(x: Any, where: str) -> int:
    """A saved counter: an integer in [0, MAX_COUNT]. Raises ValueError naming ``where``."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{where}: expected an integer, got {type(x).__name__}")
    if not 0 <= x <= MAX_COUNT:
        raise ValueError(f"{where}: {x} is outside [0, {MAX_COUNT}]")
    return x


def _rows(share: float | np.ndarray, rows: np.ndarray) -> float | np.ndarray:
    """The engine-time shares of the selected rows (one value stands for every row of one step)."""
    return share if isinstance(share, float) else share[rows]


def _merge(table: list[KRange]) -> tuple[KRange, ...]:
    """Adjacent ranges with the same K become one (the form vLLM's schedule takes)."""
    out: list[KRange] = []
    for r in table:
        if out and out[-1].k == r.k and out[-1].bs_max != 0 and out[-1].bs_max + 1 == r.bs_min:
            out[-1] = KRange(out[-1].bs_min, r.bs_max, r.k)
        else:
            out.append(r)
    return tuple(out)


__all__ = ["Change", "ControlLoop", "Totals"]
