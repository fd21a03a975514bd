"""Hedge: a full-information learner (in the spirit of HedgeSpec, arXiv 2510.20064).

Where the engine scores drafts it did not verify (n-gram's counterfactual on every request-step, an
EAGLE head's first position), one step tells what every arm of that method would have accepted, not
only the arm played. Each round, every arm whose acceptance the round revealed gets a reward: its
tokens per row divided by its time per row (measured where it was played, else the mean over played
arms); Hedge's exponential weights over the cumulative scaled rewards then draw the next arm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.algorithms.base import (
    MAX_COUNT,
    MAX_REWARD,
    StepwiseLearner,
    saved_context,
    saved_mapping,
    saved_numbers,
)
from policies.arms import METHOD_CODES, Arm
from policies.context import ANY_CLASS, Context
from policies.observation import NOT_SCORED, StepObservation
from policies.params import Param


class Hedge(StepwiseLearner):
    NAME: ClassVar[str] = "hedge"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "eta": Param(2.0, "Learning rate on rewards scaled to [0, 1] per round.", 0.0, 1000.0),
        "discount": Param(0.95, "Weight kept per round by old rewards (tracks drift).", 0.5, 1.0),
    }

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        super().__init__(arms=arms, params=params, rng=rng)
        self._codes = np.array([METHOD_CODES[a.method] for a in self.arms])
        self._ks = np.array([a.k for a in self.arms])
        # Per context since the last round: tokens and rows per arm (full information), time per row.
        self._tok: dict[Context, np.ndarray] = {}
        self._rows: dict[Context, np.ndarray] = {}
        self._time: dict[Context, np.ndarray] = {}
        self._cum: dict[Context, np.ndarray] = {}

    def _observe_step(self, obs: StepObservation, bucket: str, per_class: bool) -> None:
        n = obs.n
        if n == 0 or obs.duration_s <= 0:
            return
        share = obs.duration_s / n
        classes = np.asarray(obs.traffic_class)
        for c in (ANY_CLASS, *(sorted(set(obs.traffic_class)) if per_class else ())):
            rows = np.ones(n, dtype=bool) if c == ANY_CLASS else classes == c
            key = Context(bucket=bucket, traffic_class=c)
            tok = self._tok.setdefault(key, np.zeros(len(self.arms)))
            cnt = self._rows.setdefault(key, np.zeros(len(self.arms)))
            tm = self._time.setdefault(key, np.zeros((2, len(self.arms))))
            m, k, a = obs.method[rows], obs.k[rows], obs.accepted[rows]
            for j in range(len(self.arms)):
                code, kk = self._codes[j], self._ks[j]
                played = (m == code) & ((k == kk) | (kk == 0))
                tm[0, j] += share * int(played.sum())
                tm[1, j] += int(played.sum())
                if kk == 0:
                    tok[j] += int(rows.sum())
                    cnt[j] += int(rows.sum())
                    continue
                # Verified rows of this method reveal min(acc, K) for every K up to the one drafted.
                ver = (m == code) & (k >= kk)
                vals = list(np.minimum(a[ver], kk))
                cf = obs.counterfactual.get(self.arms[j].method)
                depth = obs.counterfactual_depth.get(self.arms[j].method, 1 << 30)
                if cf is not None and kk <= depth:
                    col = cf[rows]
                    vals.extend(np.minimum(col[col != NOT_SCORED], kk).tolist())
                if vals:
                    tok[j] += float(np.sum(vals)) + len(vals)
                    cnt[j] += len(vals)

    def update(self, ctx: Context, rewards: Mapping[int, float]) -> None:
        super().update(ctx, rewards)
        tok, cnt, tm = self._tok.pop(ctx, None), self._rows.pop(ctx, None), self._time.get(ctx)
        if tok is None or cnt is None or tm is None:
            return
        with np.errstate(invalid="ignore", divide="ignore"):
            per_row_time = np.where(tm[1] > 0, tm[0] / np.where(tm[1] > 0, tm[1], 1.0), np.nan)
        if np.isnan(per_row_time).all():
            return
        t = np.where(np.isnan(per_row_time), np.nanmean(per_row_time), per_row_time)
        seen = cnt > 0
        with np.errstate(invalid="ignore", divide="ignore"):
            g = np.where(seen, tok / np.maximum(cnt, 1e-12) / t, 0.0)
        # A time per row near 0 (a saved one of 5e-324) made g infinite, g / top NaN, and every draw
        # after it failed ("probabilities contain NaN"): goodput is bounded as everywhere else.
        g = np.minimum(np.nan_to_num(g, nan=0.0, posinf=MAX_REWARD), MAX_REWARD)
        top = float(g.max())
        cum = self._cum.setdefault(ctx, np.zeros(len(self.arms)))
        cum *= float(self.params["discount"])
        if top > 0:
            cum += np.where(seen, g / top, 0.0)
        # Time per row is slow to change: half of it is kept across rounds, seconds and rows alike, so
        # the ratio stands for an arm left unplayed. (Rows were floored at 1e-12 in the ratio: some 40
        # rounds unplayed, its time per row fell towards 0 and its goodput had no bound.) Halving stops
        # far above the denormals, where the ratio would lose its digits.
        tm *= np.where(tm[1] >= 1e-200, 0.5, 1.0)

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        idx = np.asarray(allowed)
        cum = self._cum.get(ctx, np.zeros(len(self.arms)))[idx]
        z = float(self.params["eta"]) * cum
        w = np.exp(z - z.max())
        return int(idx[int(self.rng.choice(len(idx), p=w / w.sum()))])

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "cum": {c.key: v.tolist() for c, v in self._cum.items()},
            # Time per row (seconds and rows per arm), kept across rounds: without it, a restored
            # learner scores its first round on the time of whatever arms that round happened to play.
            "time": {c.key: v.tolist() for c, v in self._time.items()},
            # The round in progress (tokens and rows per arm since the last round): without them, a
            # learner restored between rounds scores the round on the steps after the restore only.
            "tokens": {c.key: v.tolist() for c, v in self._tok.items()},
            "rows": {c.key: v.tolist() for c, v in self._rows.items()},
        }

    def _loaded(self, state: Mapping[str, Any]) -> dict[str, Any]:
        n = len(self.arms)
        # "time" is absent from snapshots of older versions: no time measured yet.
        time = saved_mapping(state.get("time", {}), "time", "a mapping of context to time per row")
        cum = saved_mapping(state.get("cum", {}), "cum", "a mapping of context to cumulative rewards")
        # "tokens" and "rows" are absent from snapshots of older versions: the round starts empty.
        tok = saved_mapping(state.get("tokens", {}), "tokens", "a mapping of context to tokens per arm")
        rows = saved_mapping(state.get("rows", {}), "rows", "a mapping of context to rows per arm")
        return {
            "_tok": {
                saved_context(c, "tokens"): saved_numbers(v, f"tokens[{c!r}]", (n,), hi=MAX_COUNT)
                for c, v in tok.items()
            },
            "_rows": {
                saved_context(c, "rows"): saved_numbers(v, f"rows[{c!r}]", (n,), hi=MAX_COUNT)
                for c, v in rows.items()
            },
            **super()._loaded(state),
            "_time": {
                saved_context(c, "time"): saved_numbers(v, f"time[{c!r}]", (2, n)) for c, v in time.items()
            },
            # Discounted sums of rewards scaled to [0, 1], one a round: in [0, MAX_COUNT] (beyond, eta
            # times it overflowed and the draw's weights were NaN).
            "_cum": {
                saved_context(c, "cum"): saved_numbers(v, f"cum[{c!r}]", (n,), hi=MAX_COUNT)
                for c, v in cum.items()
            },
        }
