"""Model-based goodput policy (in the spirit of SmartSpec / TurboSpec, arXiv 2406.14066).

Instead of treating every (method, K) as an unrelated arm, it learns the two things goodput is made of:

* **acceptance** per (traffic class, method, draft position): conditional probabilities that position j is
  accepted given j-1 were, from verified drafts (censored at their K) and from counterfactual scores the
  engine reports for methods it did not verify (n-gram on every request-step: full information);
* **step cost** as one linear model of the step's features (batched tokens: drafts verified, one per
  request and the prompt tokens prefilled alongside; EAGLE-3 sequential draft positions, a P-EAGLE pass,
  n-gram lookup), fitted by discounted least squares on measured step times. Counting the prefill
  tokens the engine reports keeps a burst of new prompts from being charged to whatever drafts ran then.

Acceptance does not depend on batch size while cost does, so a batch size never seen needs no
exploration: its goodput is predicted from the shared models. Thompson sampling on both models explores
where they are uncertain. Expected goodput of arm (m, K) at batch size B:
``B * (1 + sum_{j<=K} prod_{i<=j} p_m,i) / cost(B, m, K)``.

Switches are judged by the same models (``switch_check``): the loop keeps the arm in play unless the
predicted gain beats a margin learnt from the posteriors' spread, so Thompson draws do not flip a
context between neighbours whose difference the data cannot resolve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.algorithms.base import (
    Learner,
    saved_bucket,
    saved_class,
    saved_context,
    saved_flag,
    saved_mapping,
    saved_number,
    saved_numbers,
)
from policies.arms import MAX_K, METHOD_CODES, Arm, Method
from policies.context import ANY_CLASS, MAX_BATCH_SIZE, Context
from policies.observation import NOT_SCORED, StepBatch
from policies.params import Param, shown

_EAGLE = METHOD_CODES[Method.EAGLE3]
_PEAGLE = METHOD_CODES[Method.P_EAGLE]
_NGRAM = METHOD_CODES[Method.NGRAM]
_OFF = METHOD_CODES[Method.OFF]
_N_CODES = len(METHOD_CODES)
#: The cost model's features of a step, by column (``cost_features`` lays them out, and only it).
F_INTERCEPT, F_TOKENS, F_EAGLE, F_EAGLE_PASSES, F_PEAGLE, F_NGRAM = range(6)
_N_FEATURES = 6
_TOKEN_SCALE = 32.0
#: Method codes an acceptance table may be kept for, as saved ("CLASS|CODE"): every method that drafts.
_TABLE_CODES = {str(c): c for m, c in METHOD_CODES.items() if m is not Method.OFF}
#: Relative slack on the orderings a saved state must keep (wins <= trials, ...): the learner's own
#: arithmetic keeps them exactly, but a snapshot from another build may have summed in another order.
_SLACK = 1e-9
#: The most cells (table x slot x accepted x K) of one acceptance histogram: 4 Mi, 32 MiB of counts.
_HIST_CELLS = 1 << 22


def cost_features(tokens: Any, passes: Any, peagle: Any, ngram: Any) -> np.ndarray:
    """The step-cost features, one row per step or candidate plan (a vector when every argument is a
    scalar; arguments broadcast): an intercept; the batched tokens (drafts verified, one per request,
    prompt tokens prefilled) / 32; whether EAGLE-3 ran and its sequential passes (its longest K, or 1
    for the head alone); whether P-EAGLE drafted; whether n-gram drafted."""
    x = np.empty((*np.broadcast(tokens, passes, peagle, ngram).shape, _N_FEATURES))
    x[..., F_INTERCEPT] = 1.0
    x[..., F_TOKENS] = np.divide(tokens, _TOKEN_SCALE)
    x[..., F_EAGLE] = np.greater(passes, 0)
    x[..., F_EAGLE_PASSES] = passes
    x[..., F_PEAGLE] = peagle
    x[..., F_NGRAM] = ngram
    return x


class GoodputModel(Learner):
    NAME: ClassVar[str] = "goodput_model"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "memory_steps": Param(
            2000.0, "Steps after which an observation's weight has fallen to 1/e (tracks drift).", 10.0, 1e7
        ),
        "max_k": Param(8, "Longest draft the acceptance model tracks.", 1, 64),
        "ridge": Param(1e-3, "Ridge precision on the cost model's coefficients.", 1e-9, 1e3),
        "explore": Param(
            1.0,
            "Scale of the cost model's posterior noise in Thompson draws (0: greedy, no draws at all; "
            "acceptance draws use the full posterior whenever it is above 0).",
            0.0,
            10.0,
        ),
        "rule_memory_rounds": Param(
            10.0, "Decision rounds after which the per-request rule's share of rows weighs 1/e.", 1.0, 1e6
        ),
        "switch_confidence": Param(
            2.0,
            "Standard errors of the predicted goodput gain a switch must beat (0: no value hysteresis).",
            0.0,
            10.0,
        ),
        "switch_draws": Param(
            64, "Posterior draws the switch test's standard deviation is taken over.", 8, 4096
        ),
        "switch_settled_trials": Param(
            50.0,
            "Discounted trials every draft position of an arm needs, and steps the cost model needs along "
            "a switch's direction, before a switch to it is held back.",
            0.0,
            1e6,
        ),
        "switch_floor": Param(
            0.005,
            "Smallest relative predicted gain worth a switch, however certain the models are.",
            0.0,
            1.0,
        ),
        "unsettled_step": Param(
            2,
            "Most draft positions K moves (a class's first arm from its bucket's pooled arm; on a "
            "K-table engine every switch) while the cost model has not seen the step cost vary along "
            "that move (0: no limit).",
            0,
            64,
        ),
    }

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        super().__init__(arms=arms, params=params, rng=rng)
        self._kmax = int(self.params["max_k"])
        self._gamma = float(np.exp(-1.0 / float(self.params["memory_steps"])))
        # Acceptance: per (class, method code): trials and successes per position 1..kmax.
        self._acc: dict[tuple[str, int], np.ndarray] = {}
        # Cost: discounted normal equations of duration (ms) on step features.
        self._ridge = np.eye(_N_FEATURES) * float(self.params["ridge"])
        self._xtx = self._ridge.copy()
        # Draft positions 1..kmax, built once.
        self._pos = np.arange(1, self._kmax + 1)
        self._xty = np.zeros(_N_FEATURES)
        self._yy = 0.0
        self._w = 0.0
        # Mean batch size per bucket label, and the share of each traffic class in it.
        self._batch: dict[str, np.ndarray] = {}
        self._mix: dict[str, dict[str, float]] = {}
        # Whether the engine runs the EAGLE-3 head every step (it reports the head's first position).
        self._head = False
        # Per context: discounted request-steps, those drafted with n-gram, and the n-gram ones' emitted
        # and verified tokens. Where the plan has no n-gram arm they are the per-request rule's rows
        # (see ``plan_bucket``).
        self._ngram_rows: dict[Context, np.ndarray] = {}
        self._round_keep = float(np.exp(-1.0 / float(self.params["rule_memory_rounds"])))
        # The arms as columns, for pricing them all at once.
        self._arm_k = np.array([a.k for a in self.arms], dtype=np.int64)
        self._arm_code = np.array([METHOD_CODES[a.method] for a in self.arms], dtype=np.int64)
        self._eagle_k = np.array(
            [a.k if a.method is Method.EAGLE3 else 0 for a in self.arms], dtype=np.float64
        )
        self._peagle = np.array([a.method is Method.P_EAGLE and a.k > 0 for a in self.arms])
        self._ngram = np.array([a.method is Method.NGRAM and a.k > 0 for a in self.arms])
        # Per arm, the draft positions it verifies (none for K=0).
        self._drafts = self._pos <= np.minimum(self._arm_k, self._kmax)[:, None]
        # Beta parameters per class, dropped whenever acceptance counts change.
        self._params_of: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # Per (class, arms): the drafted positions, their Beta parameters and the posterior mean of
        # accepted drafts (what ``_accepted`` derives from ``_params_of``), dropped with it.
        self._accepted_of: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, ...]] = {}
        # Per length of report batch: each step's discount weight, and the batch's total discount.
        self._step_weights: dict[int, tuple[np.ndarray, float]] = {}
        # The cost model's posterior (mean, covariance factor), computed once per change of its fit,
        # and its covariance without the exploration scale (None: too few steps).
        self._fit: tuple[np.ndarray, np.ndarray | None] | None = None
        self._cov: np.ndarray | None = None
        #: Cost-model updates refused because they would have made its statistics non-finite.
        self.refused_updates = 0

    # -- learning ----------------------------------------------------------------------------------

    def observe(self, batch: StepBatch, buckets: Sequence[str], per_class: bool) -> None:
        """The steps of one report as one update, equal to learning from each in turn.

        Every discount keeps its exact power: a statistic updated by e of the steps decays by
        ``gamma**e`` and the i-th update's contribution by ``gamma**(e-1-i)``, so the order of the
        float sums is all that a batch of many steps changes against the same steps one by one.
        """
        s = len(batch)
        if not s:
            return
        weights = self._step_weights.get(s)
        if weights is None:  # report batches repeat their length: build the weights once
            # Step i weighs gamma**(s-1-i) in every statistic all steps update.
            w = self._gamma ** np.arange(s - 1, -1, -1, dtype=np.float64)
            w.flags.writeable = False  # shared by every batch of this length
            weights = (w, self._gamma**s)
            if len(self._step_weights) < 256:
                self._step_weights[s] = weights
        w, gs = weights
        self._learn_cost(batch, w, gs)
        classes = self._learn_mix(batch, buckets, per_class)
        self._learn_acceptance(batch, classes)

    def _learn_cost(self, batch: StepBatch, w: np.ndarray, gs: float) -> None:
        """The cost model's normal equations, one weighted row per step."""
        # The head flag holds from the first step that reports it on, for that step's features too.
        head = [self._head]
        for depth in batch.counterfactual_depth:
            head.append(head[-1] or Method.EAGLE3 in depth)
        self._head = head[-1]
        method, starts = batch.method, batch.offsets[:-1]
        spec = np.where(method == _OFF, 0, batch.k)
        drafting = spec > 0
        flags = np.empty((len(method), 3), dtype=np.int64)
        flags[:, 0] = np.where(method == _EAGLE, spec, 0)
        flags[:, 1] = (method == _PEAGLE) & drafting
        flags[:, 2] = (method == _NGRAM) & drafting
        per_step = np.maximum.reduceat(flags, starts)
        passes = np.maximum(per_step[:, 0], np.array(head[1:], dtype=np.int64))
        # Verified tokens are the drafted ones: an n-gram draft can fall short of its K (the passes
        # above stay K: EAGLE-3 runs its K forwards whatever it drafts).
        tokens = np.add.reduceat(np.minimum(spec, batch.drafted), starts) + batch.n + batch.prefill_tokens
        x = cost_features(tokens, passes, per_step[:, 1], per_step[:, 2])
        y = batch.duration_s * 1e3
        xw = x.T * w
        ridge = self._ridge
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused, not warned about
            self._commit_cost(
                gs * (self._xtx - ridge) + ridge + xw @ x,
                gs * self._xty + xw @ y,
                gs * self._yy + float(w @ (y * y)),
                gs * self._w + float(w.sum()),
            )

    def _commit_cost(self, xtx: np.ndarray, xty: np.ndarray, yy: float, w: float) -> None:
        """Take the cost model's new statistics, unless any is not finite: then they are refused and
        the model keeps what it had (NaN would poison every estimate, status and snapshot after it)."""
        if not (np.isfinite(xtx).all() and np.isfinite(xty).all() and math.isfinite(yy) and math.isfinite(w)):
            self.refused_updates += 1
            return
        self._xtx, self._xty, self._yy, self._w = xtx, xty, yy, w
        self._fit = None
        self._forget_params()

    def _learn_mix(
        self, batch: StepBatch, labels: Sequence[str], per_class: bool
    ) -> tuple[list[str], np.ndarray] | None:
        """Batch size and class mix per bucket (discounted once per step of their own bucket).

        Returns the classes (sorted) and each row's index into them when learning per class.
        """
        g = self._gamma
        n, step_of = batch.n, batch.step_of
        by_bucket: dict[str, list[int]] = {}
        for i, b in enumerate(labels):
            by_bucket.setdefault(b, []).append(i)
        names: list[str] | None = None
        cls_of = np.zeros(0, dtype=np.int64)
        if per_class:
            present = batch.classes_in(slice(None))
            names = [c for c, _ in present]
            # Each row's class as an index into the sorted names of the classes rows have.
            lut = np.zeros(len(batch.class_names), dtype=np.int64)
            lut[[j for _, j in present]] = np.arange(len(present))
            cls_of = lut[batch.class_of]
            share = np.bincount(step_of * len(names) + cls_of, minlength=len(batch) * len(names))
            share = share.reshape(len(batch), -1) / n[:, None]
        batch_size = batch.batch_size.tolist()
        for b, idx in by_bucket.items():
            wb = g ** np.arange(len(idx) - 1, -1, -1, dtype=np.float64)
            gb = g ** len(idx)
            arr = self._batch.setdefault(b, np.zeros(2))
            arr *= gb
            arr += (sum(float(wb[r]) * batch_size[i] for r, i in enumerate(idx)), float(wb.sum()))
            if names is not None:
                mix = self._mix.setdefault(b, {})
                for c in mix:
                    mix[c] *= gb
                add = wb @ share[idx]
                for i in idx:  # new classes in the order the steps bring them (as step by step)
                    for j in np.flatnonzero(share[i]).tolist():
                        mix.setdefault(names[j], 0.0)
                for j in np.flatnonzero(add).tolist():
                    mix[names[j]] += float(add[j])
        return None if names is None else (names, cls_of)

    def _learn_acceptance(self, batch: StepBatch, classes: tuple[list[str], np.ndarray] | None) -> None:
        """Acceptance counts of all rows at once, as a histogram of (table, slot, accepted, K).

        Step by step, a table (class, method) decays once per count it gets: once for the verified
        drafts of a step, once more for the method's counterfactual scores. Each counted row has a slot
        (its step, verified or counterfactual); the table's slots filled after it give its power.
        """
        step_of, s = batch.step_of, len(batch)
        kmax = self._kmax
        sink = _N_CODES  # rows that count nowhere (not drafted, not scored)
        # Keys are built in int64: method codes arrive as int8 and a batch of 64 steps already
        # overflows ``code * 2 * steps`` in that width.
        method, k, accepted = (
            batch.method.astype(np.int64),
            batch.k.astype(np.int64),
            batch.accepted.astype(np.int64),
        )
        table = np.where((method != _OFF) & (k > 0), method, sink)
        slot = step_of.astype(np.int64) * 2
        acc, depth = accepted, k
        scored = batch.counterfactual_methods()
        if scored:
            tables, slots, accs, depths = [table], [slot], [acc], [depth]
            for meth in scored:
                col = batch.counterfactual(meth)
                per_step = [min(d.get(meth, kmax), kmax) for d in batch.counterfactual_depth]
                tables.append(np.where(col != NOT_SCORED, METHOD_CODES[meth], sink))
                slots.append(slot + 1)
                accs.append(np.maximum(col, 0))
                depths.append(np.array(per_step)[step_of])
            table, slot = np.concatenate(tables), np.concatenate(slots)
            acc, depth = np.concatenate(accs), np.concatenate(depths)
        names: list[str] = []
        n_tables = _N_CODES + 1
        if classes is not None:  # every row counts for the pooled class and for its own
            names, cls_of = classes
            reps = len(table) // len(cls_of)
            own = np.where(table == sink, sink, (1 + np.tile(cls_of, reps)) * (_N_CODES + 1) + table)
            table, slot = np.concatenate([table, own]), np.concatenate([slot, slot])
            acc, depth = np.concatenate([acc, acc]), np.concatenate([depth, depth])
            n_tables *= 1 + len(names)
        # The histogram is dense over (table, slot, accepted, K): a report of many steps and many
        # classes made it gigabytes (1024 steps of 256 classes: about 1.7 GiB and 10 s a report).
        # Above ``_HIST_CELLS`` cells it is counted a run of steps at a time, each run applied after
        # the one before as the steps would be one by one (the same sums, in another order).
        cells = n_tables * 2 * (kmax + 1) ** 2  # a step's share of the histogram
        run = max(1, _HIST_CELLS // cells)
        if s <= run:
            self._count_acceptance(table, slot, acc, depth, s, n_tables, names)
            return
        order = np.argsort(slot, kind="stable")
        table, slot, acc, depth = table[order], slot[order], acc[order], depth[order]
        bounds = np.searchsorted(slot, 2 * np.arange(0, s + run, run).clip(max=s))
        for i, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)):
            first = i * run
            # Only the tables the run's rows count in (a run of few steps names few classes).
            ids, of = np.unique(table[lo:hi], return_inverse=True)
            self._count_acceptance(
                of.reshape(-1),
                slot[lo:hi] - 2 * first,
                acc[lo:hi],
                depth[lo:hi],
                min(run, s - first),
                len(ids),
                names,
                ids,
            )

    def _count_acceptance(
        self,
        table: np.ndarray,
        slot: np.ndarray,
        acc: np.ndarray,
        depth: np.ndarray,
        s: int,
        n_tables: int,
        names: list[str],
        ids: np.ndarray | None = None,
    ) -> None:
        """``_learn_acceptance``'s counts of rows in ``s`` steps (slots ``0 .. 2s - 1``), applied to the
        acceptance tables; ``table`` indexes ``ids``, the tables' own ids, when given."""
        kmax, sink = self._kmax, _N_CODES
        k1 = kmax + 1
        # Accepted and K beyond kmax compare with positions 1..kmax like kmax itself.
        key = ((table * (2 * s) + slot) * k1 + np.minimum(acc, kmax)) * k1 + np.minimum(depth, kmax)
        hist = np.bincount(key, minlength=n_tables * 2 * s * k1 * k1).reshape(n_tables, 2 * s, k1, k1)
        filled = hist.reshape(n_tables, 2 * s, -1).max(axis=2) > 0
        later = np.cumsum(filled[:, ::-1], axis=1)[:, ::-1]  # slots filled at or after each slot
        counts = later[:, 0]
        weighted = np.einsum("tsak,ts->tak", hist, self._gamma ** (later - 1.0))
        # at_least[t, a, k]: weight of rows with accepted >= a and K >= k.
        at_least = weighted[:, ::-1, ::-1].cumsum(axis=1).cumsum(axis=2)[:, ::-1, ::-1]
        j = self._pos
        trials, wins = at_least[:, j - 1, j], at_least[:, j, j]
        for tid in np.flatnonzero(counts).tolist():
            cls_i, code = divmod(tid if ids is None else int(ids[tid]), _N_CODES + 1)
            if code == sink:
                continue
            key_ = (ANY_CLASS if cls_i == 0 else names[cls_i - 1], code)
            t = self._acc.get(key_)
            if t is None:
                t = self._acc[key_] = np.zeros((2, kmax))
            t *= self._gamma ** int(counts[tid])
            t[0] += trials[tid]
            t[1] += wins[tid]

    def update(self, ctx: Context, rewards: Mapping[int, float]) -> None:
        """Round rewards are implied by the models; nothing else to learn from them."""

    def observe_round(self, ctx: Context, rows: np.ndarray, tokens: np.ndarray) -> None:
        """How many of a context's request-steps each arm drafted this round, and what they emitted."""
        ng = self._ngram
        n_ng = rows[ng]
        stats = np.array(
            [rows.sum(), n_ng.sum(), tokens[ng].sum(), float(n_ng @ (self._arm_k[ng] + 1))], dtype=np.float64
        )
        r = self._ngram_rows.get(ctx)
        if r is None:
            self._ngram_rows[ctx] = stats
        else:
            r *= self._round_keep
            r += stats

    def on_drift(self, cls: str, method: Method, keep: float) -> None:
        """Shrink the class x method acceptance counts: the Beta posteriors widen and re-learn fast."""
        t = self._acc.get((cls, METHOD_CODES[method]))
        if t is not None:
            t *= keep
            self._forget_params()

    # -- deciding ----------------------------------------------------------------------------------

    def _posterior(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The cost model's mean and the factor of its covariance (None: not sampled yet), once per fit."""
        if self._fit is None:
            theta, factor, self._cov = _cost_fit(
                self._xtx, self._xty, self._yy, self._w, float(self.params["explore"])
            )
            self._fit = (theta, factor)
        return self._fit

    def _theta(self, sample: bool) -> np.ndarray:
        theta, factor = self._posterior()
        if not sample or factor is None or float(self.params["explore"]) == 0:
            return theta
        # The draw of Generator.multivariate_normal(theta, cov, method="eigh"), same random stream.
        out: np.ndarray = theta + self.rng.standard_normal(_N_FEATURES) @ factor.T
        return out

    def _beta_params(self, cls: str) -> tuple[np.ndarray, np.ndarray]:
        """Beta posteriors (alpha, beta) per arm and draft position for ``cls``, once per change of counts."""
        params = self._params_of.get(cls)
        if params is None:
            trials = np.zeros((len(self.arms), self._kmax))
            wins = np.zeros((len(self.arms), self._kmax))
            for code in set(self._arm_code.tolist()):
                t = self._acc.get((cls, code))
                if t is None and cls != ANY_CLASS:
                    t = self._acc.get((ANY_CLASS, code))
                if t is not None:
                    rows = self._arm_code == code
                    trials[rows] = t[0]
                    wins[rows] = t[1]
            params = self._params_of[cls] = (1.0 + wins, 1.0 + np.maximum(trials - wins, 0.0))
        return params

    def _forget_params(self) -> None:
        """The acceptance counts or the cost fit changed: what was derived from them goes."""
        self._params_of.clear()
        self._accepted_of.clear()

    def _accepted(self, cls: str, idx: Sequence[int], sample: bool) -> np.ndarray:
        """Expected accepted drafts per arm of ``idx`` (Beta draws in arm order when sampling).

        A decision round asks this for the same class and arms many times (twice per bucket, and per
        context): what does not depend on the draw is derived once per change of the counts."""
        key = (cls, tuple(idx))
        got = self._accepted_of.get(key)
        if got is None:
            alpha, beta = self._beta_params(cls)
            drafted = self._drafts[idx]
            a, b = alpha[idx][drafted], beta[idx][drafted]
            p = np.zeros(drafted.shape)
            p[drafted] = a / (a + b)
            mean = np.cumprod(p, axis=1).sum(axis=1)
            mean.flags.writeable = False  # returned to every caller until the counts change
            got = self._accepted_of[key] = (drafted, a, b, mean)
        drafted, a, b, mean = got
        if not (sample and float(self.params["explore"]) > 0):
            return mean
        p = np.zeros(drafted.shape)
        p[drafted] = self.rng.beta(a, b)
        out: np.ndarray = np.cumprod(p, axis=1).sum(axis=1)
        return out

    def _batch_size(self, bucket: str) -> float:
        b = self._batch.get(bucket)
        if b is not None and b[1] > 1e-9:
            return float(b[0] / b[1])
        lo, _, hi = bucket.partition("-")
        lo = lo.rstrip("+")
        return (float(lo) + float(hi)) / 2 if hi else float(lo)

    def _goodputs(self, ctx: Context, idx: Sequence[int], sample: bool) -> np.ndarray:
        batch = self._batch_size(ctx.bucket)
        theta = self._theta(sample)
        cost = self._costs(theta, batch, np.asarray(idx, dtype=np.int64))
        out: np.ndarray = batch * (1.0 + self._accepted(ctx.traffic_class, idx, sample)) / (cost / 1e3)
        return out

    def _rule_rows(self, ctx: Context) -> tuple[float, float, float]:
        """Share of a context's rows drafted with n-gram, and their mean emitted and verified tokens."""
        r = self._ngram_rows.get(ctx)
        if r is None or r[0] <= 0 or r[1] <= 0:
            return 0.0, 0.0, 0.0
        return float(r[1] / r[0]), float(r[2] / r[1]), float(r[3] / r[1])

    def plan_bucket(
        self, bucket: str, classes: Sequence[str], allowed: Sequence[int], *, sample: bool = True
    ) -> dict[str, int] | None:
        """Best arm per class for a batch that mixes the classes in their observed shares.

        Coordinate ascent on the joint goodput under one Thompson draw of both models: the step's cost
        depends on every row (one EAGLE-3 pass of the longest K serves all rows), so each class's arm is
        chosen given the others'. ``"*"`` gets the best single arm for the whole batch.

        Where no n-gram arm is allowed, rows drafted with n-gram are the per-request rule's (inside
        copy spans): they stay n-gram whatever the plan, so the plan is chosen for the other rows,
        with the rule's rows in the step at their observed share, tokens and verify cost. Their share
        lowers the worth of a deeper EAGLE-3 draft, whose passes every row pays for.
        """
        idx = list(allowed)
        if not idx:
            return None
        batch = self._batch_size(bucket)
        theta = self._theta(sample=sample)
        sample = sample and float(self.params["explore"]) > 0
        arms = np.asarray(idx, dtype=np.int64)
        by_rule = not bool(self._ngram[arms].any())
        pooled = int(
            self._joint(bucket, theta, batch, arms, [ANY_CLASS], np.ones(1), self._accepted(ANY_CLASS, idx, sample)[None],
                        np.zeros(1, dtype=np.int64), by_rule)[0]
        )  # fmt: skip
        out = {ANY_CLASS: idx[pooled]}
        mix = self._mix.get(bucket, {})
        shares = {c: mix.get(c, 0.0) for c in classes}
        total = sum(shares.values())
        if not classes or total <= 0:
            return out
        share = np.array([shares[c] / total for c in classes])
        acc = np.array([self._accepted(c, idx, sample) for c in classes])  # (classes, arms)
        choice = self._joint(
            bucket, theta, batch, arms, list(classes), share, acc, np.full(len(classes), pooled), by_rule
        )
        out.update({c: idx[int(j)] for c, j in zip(classes, choice, strict=True)})
        return out

    def plan_draws(self, bucket: str, classes: Sequence[str], allowed: Sequence[int]) -> None:
        """``plan_bucket``'s draws (the cost model's, then each class's acceptance), without ``_joint``."""
        idx = list(allowed)
        if not idx:
            return
        self._theta(sample=True)
        sample = float(self.params["explore"]) > 0
        self._accepted(ANY_CLASS, idx, sample)
        mix = self._mix.get(bucket, {})
        if not classes or sum(mix.get(c, 0.0) for c in classes) <= 0:
            return
        for c in classes:
            self._accepted(c, idx, sample)

    def _joint(
        self,
        bucket: str,
        theta: np.ndarray,
        batch: float,
        arms: np.ndarray,
        classes: list[str],
        share: np.ndarray,
        acc: np.ndarray,
        start: np.ndarray,
        by_rule: bool,
    ) -> np.ndarray:
        """Each class's arm (positions in ``arms``), by coordinate ascent on the step's goodput."""
        ng = (
            np.array([self._rule_rows(Context(bucket=bucket, traffic_class=c)) for c in classes])
            if by_rule
            else np.zeros((len(classes), 3))
        )
        f, ng_tokens, ng_verify = ng[:, 0], ng[:, 1], ng[:, 2]
        planned = share * (1.0 - f)  # the rows that follow the plan
        fixed_tokens = float(share @ (f * ng_tokens))
        fixed_verify = float(share @ (f * ng_verify))
        rule_ngram = bool((f > 0).any())
        k = self._arm_k[arms]
        eagle = self._eagle_k[arms]
        peagle = self._peagle[arms]
        ngram = self._ngram[arms]
        head = 1.0 if self._head else 0.0
        floor = max(self._cost_floor(), 1e-3)
        choice = start.copy()
        rows = np.arange(len(classes))
        alone = len(classes) == 1  # nothing to coordinate with: the first pass is the optimum
        for _ in range(1 if alone else 3):
            moved = False
            for ci in range(len(classes)):
                mine = planned[ci] > 0
                if alone:  # the other classes' sums are 0 (and numpy calls over an empty set cost more)
                    o_verify = o_tokens = o_eagle = 0.0
                    o_peagle = o_ngram = False
                else:
                    others = rows != ci
                    picked = choice[others & (planned > 0)]
                    o_verify = float(planned[others] @ (k[choice[others]] + 1))
                    o_tokens = float(planned[others] @ (1.0 + acc[others, choice[others]]))
                    o_eagle = float(eagle[picked].max(initial=0.0))
                    o_peagle, o_ngram = bool(peagle[picked].any()), bool(ngram[picked].any())
                x = cost_features(
                    (o_verify + fixed_verify + planned[ci] * (k + 1)) * batch,
                    np.maximum(max(o_eagle, head), eagle * mine),
                    o_peagle | (peagle & mine),
                    o_ngram | rule_ngram | (ngram & mine),
                )
                cost = np.maximum(x @ theta, floor)
                tokens = o_tokens + fixed_tokens + planned[ci] * (1.0 + acc[ci])
                best = int(np.argmax(batch * tokens / cost))
                if best != choice[ci]:
                    choice[ci], moved = best, True
            if not moved:
                break
        return choice

    def _arm_features(self, batch: float, arms: np.ndarray) -> np.ndarray:
        """Step features of each arm played by the whole batch."""
        passes = np.maximum(self._eagle_k[arms], 1.0 if self._head else 0.0)
        return cost_features(batch * (self._arm_k[arms] + 1), passes, self._peagle[arms], self._ngram[arms])

    def _costs(self, theta: np.ndarray, batch: float, arms: np.ndarray) -> np.ndarray:
        """Predicted step time (ms) of each arm played by the whole batch."""
        out: np.ndarray = np.maximum(self._arm_features(batch, arms) @ theta, max(self._cost_floor(), 1e-3))
        return out

    def _cost_floor(self) -> float:
        # Until steps with several arms were seen, cost predictions are guesses: floor them at a tenth
        # of the mean observed step so no arm looks free.
        return 0.1 * float(self._xty[0] / self._xtx[0, 0]) if self._xtx[0, 0] > 1 else 1e-3

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        idx = list(allowed)
        return int(idx[int(np.argmax(self._goodputs(ctx, idx, sample=True)))])

    def estimates(self, ctx: Context) -> np.ndarray:
        if self._w == 0:
            return np.full(len(self.arms), np.nan)
        return self._goodputs(ctx, list(range(len(self.arms))), sample=False)

    def _assignment_values(
        self,
        bucket: str,
        classes: list[str],
        assign: np.ndarray,
        ci: int,
        options: np.ndarray,
        by_rule: bool,
        draws: int,
    ) -> np.ndarray:
        """The bucket's step goodput with class ``classes[ci]`` on each arm of ``options`` and the others
        on ``assign``, by the objective ``plan_bucket`` maximises (shares, the rule's rows, one EAGLE-3
        pass serving every row). ``draws = 0``: greedy, shape ``(1, len(options))``; otherwise
        ``(draws, len(options))`` under joint draws of both posteriors (not scaled by ``explore``),
        one draw shared by all options, so what they have in common cancels in their differences."""
        batch = self._batch_size(bucket)
        if classes == [ANY_CLASS]:
            share = np.ones(1)
        else:
            mix = self._mix.get(bucket, {})
            w = np.array([mix.get(c, 0.0) for c in classes])
            share = w / w.sum() if w.sum() > 0 else np.full(len(classes), 1.0 / len(classes))
        ng = (
            np.array([self._rule_rows(Context(bucket=bucket, traffic_class=c)) for c in classes])
            if by_rule
            else np.zeros((len(classes), 3))
        )
        f = ng[:, 0]
        planned = share * (1.0 - f)
        fixed_tokens = float(share @ (f * ng[:, 1]))
        fixed_verify = float(share @ (f * ng[:, 2]))
        rule_ngram = bool((f > 0).any())
        theta = self._theta(sample=False)
        n = max(draws, 1)
        if draws:
            cov = self._cov if self._cov is not None else np.zeros((_N_FEATURES, _N_FEATURES))
            ev, u = np.linalg.eigh((cov + cov.T) / 2)
            thetas = theta + self.rng.standard_normal((draws, _N_FEATURES)) @ (u * np.sqrt(np.abs(ev))).T
        else:
            thetas = theta[None]
        arms_used = sorted(set(assign.tolist()) | set(options.tolist()))
        # acc[c][arm]: expected accepted drafts per draw, one acceptance draw per (class, method).
        acc: list[dict[int, np.ndarray]] = []
        for c in classes:
            alpha, beta = self._beta_params(c)
            by_code: dict[int, np.ndarray] = {}
            per_arm: dict[int, np.ndarray] = {}
            for i in arms_used:
                code = int(self._arm_code[i])
                if code not in by_code:
                    mean = alpha[i] / (alpha[i] + beta[i])
                    by_code[code] = (
                        self.rng.beta(alpha[i], beta[i], size=(draws, self._kmax)) if draws else mean[None]
                    )
                per_arm[i] = np.cumprod(by_code[code] * self._drafts[i], axis=1).sum(axis=1)
            acc.append(per_arm)
        head = 1.0 if self._head else 0.0
        floor = max(self._cost_floor(), 1e-3)
        out = np.empty((n, len(options)))
        for j, o in enumerate(options.tolist()):
            a = assign.copy()
            a[ci] = o
            on = planned > 0
            x = cost_features(
                (float(planned @ (self._arm_k[a] + 1)) + fixed_verify) * batch,
                max(float(self._eagle_k[a][on].max(initial=0.0)), head),
                bool(self._peagle[a][on].any()),
                bool(self._ngram[a][on].any()) or rule_ngram,
            )
            tokens = fixed_tokens + sum(planned[c] * (1.0 + acc[c][int(a[c])]) for c in range(len(classes)))
            cost = np.maximum(thetas @ x, floor)
            out[:, j] = batch * tokens / cost * 1e3
        return out

    def _settled(self, cls: str, arm: int) -> bool:
        """Whether every draft position ``arm`` verifies has been seen ``switch_settled_trials`` times
        (discounted) for ``cls``: positions deeper than the K in play are never verified, and their
        estimates fall back to the prior as the counts decay."""
        need = float(self.params["switch_settled_trials"])
        if not self._drafts[arm].any():  # off verifies no position: nothing to settle (no table exists)
            return True
        code = int(self._arm_code[arm])
        t = self._acc.get((cls, code))
        if t is None and cls != ANY_CLASS:
            t = self._acc.get((ANY_CLASS, code))
        if t is None:
            return need <= 0
        return bool((t[0][self._drafts[arm]] >= need).all())

    def _cost_settled(self, batch: float, current: int, new: int) -> bool:
        """Whether the cost model has seen enough steps along the direction in which ``new``'s step
        differs from ``current``'s: ``switch_settled_trials`` (discounted) steps' worth. An engine that
        has only ever played one K (a K table, where K is the batch's) has never seen the draft-pass
        coefficient vary; the posterior spread along it is the ridge prior's, so without this the value
        hysteresis would hold back every switch that would identify it and keep the first K forever.
        With ``n`` steps at each of two feature vectors, ``d' (X'X)^-1 d`` is about ``2 / n``."""
        need = float(self.params["switch_settled_trials"])
        if need <= 0:
            return True
        x = self._arm_features(batch, np.array([current, new], dtype=np.int64))
        d = x[1] - x[0]
        if not d.any():
            return True
        spread = float(d @ np.linalg.solve(self._xtx, d))
        return spread * need <= 2.0

    def bounded_move(self, ctx: Context, allowed: Sequence[int], current: int, new: int) -> int:
        """``new``, or, where the cost model has not seen the step cost vary between ``current`` and
        ``new`` (an engine that has played one K so far), the arm of the same method at most
        ``unsettled_step`` draft positions from ``current`` toward it. From one K alone the cost of the
        draft passes cannot be told from the rest of the step (the features move together); the ridge
        prior then puts most of the step on the passes, and the plan jumps to K = 1, a guess that
        costs a quarter of the throughput at batch 32 for the whole dwell. A short move is as
        informative (one more K identifies the slope) and costs little; once the slope is seen, the
        next round may go straight to the plan's arm. The loop asks this for a class's first arm
        (``current``: the bucket's pooled arm) and, on an engine with one K per batch, for every
        switch."""
        step = int(self.params["unsettled_step"])
        a, b = self.arms[current], self.arms[new]
        if step <= 0 or a.method is not b.method or a.k == 0 or b.k == 0 or abs(b.k - a.k) <= step:
            return new
        if self._cost_settled(self._batch_size(ctx.bucket), current, new):
            return new
        toward = a.k + step if b.k > a.k else a.k - step
        on_way = [i for i in allowed if self.arms[i].method is b.method and min(a.k, toward) <= self.arms[i].k <= max(a.k, toward) and i != current]  # fmt: skip
        if not on_way:
            return new
        return min(on_way, key=lambda i: abs(self.arms[i].k - toward))

    def switch_check(
        self,
        ctx: Context,
        allowed: Sequence[int],
        current: int,
        new: int,
        *,
        others: Mapping[Context, int] | None = None,
    ) -> tuple[float, float] | None:
        """The predicted (greedy) gain of ``new`` over ``current`` in the bucket's step goodput, with
        the bucket's other classes on their arms in play (``others``, by context), and the margin it
        must beat: ``switch_confidence`` standard deviations of that gain under the posteriors (from
        ``switch_draws`` joint draws, so what the two arms share cancels), and at least
        ``switch_floor`` of the current value. A neighbour whose edge the data cannot tell from noise
        does not displace the arm in play, however often Thompson sampling proposes it."""
        z = float(self.params["switch_confidence"])
        floor = float(self.params["switch_floor"])
        if (z <= 0 and floor <= 0) or self._w == 0:
            return None
        bucket, cls = ctx.bucket, ctx.traffic_class
        if not self._settled(cls, new) or not self._cost_settled(self._batch_size(bucket), current, new):
            return None  # as an unestimated arm: it has to be tried before it can be judged
        by_rule = not bool(self._ngram[np.asarray(list(allowed), dtype=np.int64)].any())
        if cls == ANY_CLASS:
            classes, assign = [ANY_CLASS], np.array([current], dtype=np.int64)
        else:
            peers = {
                k.traffic_class: i
                for k, i in (others or {}).items()
                if k.bucket == bucket and k.traffic_class not in (ANY_CLASS, cls)
            }
            classes = [cls, *sorted(peers)]
            assign = np.array([current, *(peers[c] for c in classes[1:])], dtype=np.int64)
        options = np.array([current, new], dtype=np.int64)
        greedy = self._assignment_values(bucket, classes, assign, 0, options, by_rule, 0)[0]
        if not np.isfinite(greedy).all():
            return None
        margin = floor * max(float(greedy[0]), 0.0)
        if z > 0 and self._cov is not None:
            d = self._assignment_values(
                bucket, classes, assign, 0, options, by_rule, int(self.params["switch_draws"])
            )
            sd = float(np.std(d[:, 1] - d[:, 0]))
            if np.isfinite(sd):
                margin = max(margin, z * sd)
        return float(greedy[1] - greedy[0]), margin

    # -- snapshots ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "acc": {f"{c}|{m}": t.tolist() for (c, m), t in self._acc.items()},
            "xtx": self._xtx.tolist(),
            "xty": self._xty.tolist(),
            "yy": self._yy,
            "w": self._w,
            "batch": {b: v.tolist() for b, v in self._batch.items()},
            # A copy: the sidecar writes the state on another thread while this one goes on learning.
            "mix": {b: dict(m) for b, m in self._mix.items()},
            "head": self._head,
            "ngram_rows": {c.key: v.tolist() for c, v in self._ngram_rows.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        # What was derived from the statistics it had goes with them.
        self._fit = None
        self._forget_params()

    def _loaded(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Every statistic checked against what this learner's arms and params imply and what its own
        updates keep (shapes, finite, counts and shares >= 0, wins <= trials, a solvable cost model);
        raises ValueError naming the first field that is not. No ``tables``: this learner keeps none."""
        kmax = self._kmax
        acc: dict[tuple[str, int], np.ndarray] = {}
        saved = saved_mapping(state.get("acc"), "acc", "a mapping of 'CLASS|METHOD' to acceptance counts")
        for key, t in saved.items():
            where = f"acc[{key!r}]"
            cls, _, code = key.rpartition("|")
            if code not in _TABLE_CODES:
                codes = ", ".join(sorted(_TABLE_CODES))
                raise ValueError(f"{where}: {code!r} is not the code of a drafting method (one of {codes})")
            saved_class(cls, where)
            arr = saved_numbers(t, where, (2, kmax))
            # Row 0: trials per draft position, row 1: those accepted (a subset).
            over = np.flatnonzero(arr[1] > arr[0] * (1.0 + _SLACK))
            if over.size:
                raise ValueError(f"{where}: more accepted than tried at draft position {int(over[0]) + 1}")
            acc[(cls, _TABLE_CODES[code])] = arr
        # The normal equations of non-negative features and durations: every sum is >= 0.
        xtx = saved_numbers(state.get("xtx"), "xtx", (_N_FEATURES, _N_FEATURES))
        xty = saved_numbers(state.get("xty"), "xty", (_N_FEATURES,))
        yy, w = saved_number(state.get("yy"), "yy"), saved_number(state.get("w"), "w")
        _check_cost_model(xtx, xty, yy, w, float(self.params["explore"]))
        batch: dict[str, np.ndarray] = {}
        saved = saved_mapping(state.get("batch"), "batch", "a mapping of bucket to batch-size sums")
        for b, v in saved.items():
            where = f"batch[{b!r}]"
            saved_bucket(b, where)
            arr = saved_numbers(v, where, (2,))
            # (weighted sum of batch sizes, total weight): their ratio is the bucket's mean batch size.
            if arr[0] > arr[1] * MAX_BATCH_SIZE * (1.0 + _SLACK):
                raise ValueError(
                    f"{where}: a mean batch size above {MAX_BATCH_SIZE}, got {shown(arr.tolist())}"
                )
            batch[b] = arr
        mix: dict[str, dict[str, float]] = {}
        saved = saved_mapping(state.get("mix", {}), "mix", "a mapping of bucket to class shares")
        for b, m in saved.items():
            where = f"mix[{b!r}]"
            saved_bucket(b, where)
            shares = saved_mapping(m, where, "a mapping of traffic class to share")
            mix[b] = {saved_class(c, where): saved_number(v, f"{where}[{c!r}]") for c, v in shares.items()}
        rows: dict[Context, np.ndarray] = {}
        saved = saved_mapping(state.get("ngram_rows", {}), "ngram_rows", "a mapping of context to row counts")
        for c, v in saved.items():
            where = f"ngram_rows[{c!r}]"
            ctx = saved_context(c, "ngram_rows")
            arr = saved_numbers(v, where, (4,))
            # (request-steps, those drafted with n-gram, their emitted and verified tokens): a share of
            # rows above 1 would plan a negative share for the rest, and no row emits or verifies more
            # than MAX_K + 1 tokens.
            if arr[1] > arr[0] * (1.0 + _SLACK):
                raise ValueError(f"{where}: more n-gram rows than rows, got {shown(arr.tolist())}")
            if max(arr[2], arr[3]) > arr[1] * (MAX_K + 1) * (1.0 + _SLACK):
                raise ValueError(
                    f"{where}: more than {MAX_K + 1} tokens per n-gram row, got {shown(arr.tolist())}"
                )
            rows[ctx] = arr
        return {
            "_acc": acc,
            "_xtx": xtx,
            "_xty": xty,
            "_yy": yy,
            "_w": w,
            "_batch": batch,
            "_mix": mix,
            "_head": saved_flag(state.get("head", False), "head"),
            "_ngram_rows": rows,
        }


def _cost_fit(
    xtx: np.ndarray, xty: np.ndarray, yy: float, w: float, explore: float
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The cost model's mean, the factor of its covariance scaled by ``explore`` (None: too few steps to
    sample) and its covariance unscaled (None likewise), from the normal equations."""
    theta: np.ndarray = np.linalg.solve(xtx, xty)
    factor = cov = None
    if w >= 2:
        resid = max(yy - float(theta @ xty), 0.0) / max(w - _N_FEATURES, 1.0)
        cov = np.linalg.inv(xtx) * max(resid, 1e-6)
        scaled = cov * explore**2
        # eigh tolerates the singular covariance of features that have not varied yet (the
        # factor is what Generator.multivariate_normal(method="eigh") uses).
        s, u = np.linalg.eigh((scaled + scaled.T) / 2)
        factor = u * np.sqrt(np.abs(s))
    return theta, factor, cov


def _check_cost_model(xtx: np.ndarray, xty: np.ndarray, yy: float, w: float, explore: float) -> None:
    """Saved normal equations the learner can use: ``xtx`` symmetric and positive definite (the ridge
    keeps it so; updates only add to it), and the fit ``_posterior`` will make of them finite, so no
    solve, inverse or draw fails or turns to NaN later. Raises ValueError naming the field."""
    scale = float(np.abs(xtx).max())
    # Summed in floating point, the two triangles can differ in the last bits.
    if float(np.abs(xtx - xtx.T).max()) > _SLACK * scale:
        raise ValueError(f"xtx: not symmetric, got {shown(xtx.tolist())}")
    try:
        np.linalg.cholesky(xtx)
    except np.linalg.LinAlgError:
        raise ValueError(
            f"xtx: not positive definite (the cost model cannot be fitted), got {shown(xtx.tolist())}"
        ) from None
    try:
        with np.errstate(all="ignore"):
            fit = _cost_fit(xtx, xty, yy, w, explore)
    except np.linalg.LinAlgError as e:
        raise ValueError(f"xtx, xty, yy, w: the cost model cannot be fitted to them ({e})") from None
    if not all(np.isfinite(a).all() for a in fit if a is not None):
        raise ValueError("xtx, xty, yy, w: the cost model cannot be fitted to them (the fit is not finite)")
