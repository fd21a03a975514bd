"""``controllerctl profile fit``: a cost-model profile fitted to recorded engine steps.

The model fitted is the simulator's own step-time model (``Profile.step_time``, the features read from
each step by ``sim.vectorised.step_features``, exactly as the simulator prices its steps), so a fitted
profile prices steps as the engine ran them. Parameters, in the profile's keys:

* ``target.kv_s_per_token``, ``target.batched_s_per_token``, ``target.const_s``: the verify forward. The
  constant holds the per-step overhead as well: in step timings the two cannot be told apart, so the
  fitted profile has ``overhead_s: 0``.
* ``draft.eagle3.*``: one EAGLE-3 forward (``cost: per_forward``, ``fit_k: 1``) or one whole draft
  (``cost: per_draft``).
* ``draft.p_eagle.pass_forwards``: a P-EAGLE pass in EAGLE-3 forwards (whole drafts for ``per_draft``).
* ``draft.ngram.verify_fraction``: n-gram drafting as a share of the verify time.

The model is linear in each parameter alone (bilinear overall: P-EAGLE and n-gram scale other terms),
so it is fitted by Levenberg-Marquardt least squares; confidence intervals come from the Jacobian at
the optimum (``s² (JᵀJ)⁻¹``, Student t). A parameter the steps cannot inform (no P-EAGLE steps, no KV
variation, columns collinear with others) is fixed at the base profile's value; one whose estimate is
negative is fixed at 0. Both are said in the result and in the written YAML. Steps that leave no
parameter free (no drafting), or that all ran at one batch size (how a step grows with the batch is
then unknown, whatever else varies), are refused with FitError; so are steps whose durations fall as
the batch grows (target.batched_s_per_token negative by more than 5 % of the median step over the
steps' batched tokens: batching for free is no engine's profile).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import yaml

from policies import yamldoc
from sim.costmodel import DRAFT_COSTS, DraftCost, Linear, PluginCost, Profile
from sim.engines import EngineModel
from sim.files import save_figure
from sim.steplog import StepLog
from sim.vectorised import step_features

PARAMS: tuple[str, ...] = (
    "target.kv_s_per_token",
    "target.batched_s_per_token",
    "target.const_s",
    "draft.eagle3.kv_s_per_token",
    "draft.eagle3.spec_s_per_token",
    "draft.eagle3.const_s",
    "draft.p_eagle.pass_forwards",
    "draft.ngram.verify_fraction",
)
_KV = (0, 3)
_EAGLE = (3, 4, 5)
#: Relative conditioning below which a parameter counts as not identifiable from the steps.
_COND = 1e-9
#: The note of a parameter fixed at 0 because its estimate was negative.
_NEGATIVE = "the fit went negative"


class FitError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    value: float
    ci_low: float
    ci_high: float
    status: str  # "fitted" or "fixed"
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "ci": [self.ci_low, self.ci_high],
            "status": self.status,
            **({"note": self.note} if self.note else {}),
        }


@dataclass(frozen=True, slots=True)
class Fit:
    profile: Profile
    params: tuple[Param, ...]
    draft_cost: DraftCost
    level: float
    measured_s: np.ndarray
    predicted_s: np.ndarray
    batch: np.ndarray
    source: str
    alternatives: dict[str, float] = field(default_factory=dict)  # draft cost -> residual RMS (s)

    @property
    def residual_s(self) -> np.ndarray:
        out: np.ndarray = self.measured_s - self.predicted_s
        return out

    @property
    def rmse_s(self) -> float:
        return float(np.sqrt(np.mean(self.residual_s**2)))

    @property
    def r2(self) -> float:
        ss = float(np.sum((self.measured_s - self.measured_s.mean()) ** 2))
        return 1.0 - float(np.sum(self.residual_s**2)) / ss if ss > 0 else 1.0

    @property
    def median_abs_rel_error(self) -> float:
        return float(np.median(np.abs(self.residual_s) / self.measured_s))

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)

    def summary(self) -> dict[str, Any]:
        return {
            "method": "least squares (Levenberg-Marquardt) on Profile.step_time, controllerctl profile fit",
            "steps_file": self.source,
            "steps": len(self.measured_s),
            "draft_cost": self.draft_cost,
            "level": self.level,
            "residual_rms_s": self.rmse_s,
            "r2": self.r2,
            "median_abs_rel_error": self.median_abs_rel_error,
            **({"residual_rms_s_by_draft_cost": self.alternatives} if self.alternatives else {}),
            "parameters": {p.name: p.to_json() for p in self.params},
        }


def t_quantile(p: float, df: int) -> float:
    """Student t quantile (Cornish-Fisher expansion about the normal; ample for df >= 5)."""
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def features(steps: StepLog, engine: EngineModel, *, prompt_tokens: float = 0.0) -> dict[str, np.ndarray]:
    """``Profile.step_time``'s keywords per recorded step. KV tokens: as recorded when every step has
    them, else the tokens the step's requests had decoded plus ``prompt_tokens`` per request."""
    n = steps.n
    f = step_features(
        engine,
        n_steps=n,
        g=steps.row_step,
        method=steps.method,
        k=steps.k,
        kv_rows=np.zeros(len(steps.k)),
        prefill_g=np.arange(n),
        prompt=steps.prefill_tokens.astype(np.float64),
    )
    rows = np.bincount(steps.row_step, minlength=n).astype(np.float64)
    f["kv"] = (
        steps.kv_tokens.copy() if steps.kv_tokens is not None else steps.decoded_tokens + prompt_tokens * rows
    )
    return f


def _start(base: Profile, draft_cost: DraftCost) -> np.ndarray:
    """The base profile's values in the fitted profile's units (``fit_k`` 1)."""
    d = base.eagle3_draft
    per = 1.0 / base.fit_k if draft_cost == "per_forward" else 1.0
    pf = base.p_eagle_pass_forwards * (1.0 if draft_cost == "per_forward" else 1.0 / base.fit_k)
    t = base.target
    return np.array(
        [
            t.kv_s_per_token,
            t.batched_s_per_token,
            t.const_s + base.overhead_s,
            d.kv_s_per_token * per,
            d.batched_s_per_token * per,
            d.const_s * per,
            pf,
            base.ngram_verify_fraction,
        ]
    )


def profile_of(base: Profile, theta: Sequence[float] | np.ndarray, draft_cost: DraftCost) -> Profile:
    """``base`` with the step-time model replaced by ``theta`` (``PARAMS`` order)."""
    th = [float(x) for x in theta]
    return dataclasses.replace(
        base,
        target=Linear(th[0], th[1], th[2]),
        eagle3_draft=Linear(th[3], th[4], th[5]),
        fit_k=1,
        p_eagle_pass_forwards=th[6],
        ngram_verify_fraction=th[7],
        overhead_s=0.0,
        moe=None,
        eagle3_cost=draft_cost,
        # Recorded step times already hold the engine's host time (its scheduling, the plugin).
        sync_step_s=0.0,
        plugin_k_table=PluginCost(),
        plugin_composite=PluginCost(),
        plugin_composite_sync=PluginCost(),
    )


def _lm(
    model: Callable[[np.ndarray], np.ndarray], y: np.ndarray, u0: np.ndarray, free: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg-Marquardt over the ``free`` entries of ``u``; returns (u, Jacobian of the free ones)."""

    def jac(u: np.ndarray) -> np.ndarray:
        base = model(u)
        cols = []
        for i in np.flatnonzero(free):
            v = u.copy()
            v[i] += 1.0  # the model is linear in each parameter alone: this difference is exact
            cols.append(model(v) - base)
        return np.stack(cols, axis=1)

    u = u0.copy()
    r = y - model(u)
    cost = float(r @ r)
    lam = 1e-3
    for _ in range(200):
        J = jac(u)
        A = J.T @ J
        g = J.T @ r
        step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-300), g)
        v = u.copy()
        v[free] += step
        rv = y - model(v)
        cv = float(rv @ rv)
        if cv < cost:
            done = cost - cv <= 1e-15 * max(cost, 1e-300)
            u, r, cost = v, rv, cv
            lam = max(lam / 10.0, 1e-12)
            if done or float(np.abs(step).max()) < 1e-12:
                break
        else:
            lam *= 10.0
            if lam > 1e12:
                break
    return u, jac(u)


#: How much a negative target.batched_s_per_token may take off a step over the steps' range of batched
#: tokens (a share of the median step) before the steps are refused rather than the slope fixed at 0.
_ABSURD_FALL = 0.05


def _lacking(steps: StepLog) -> str:
    """What the steps lack for a fit, said as what to record."""
    lack = []
    if np.ptp(steps.batch) == 0:
        lack.append(f"every step at batch {int(steps.batch[0])}")
    if not (steps.k > 0).any():
        lack.append("no request drafted")
    said = "; ".join(lack) or "the columns are collinear"
    return f"{said}: record steps at varied batch sizes, with speculative decoding on"


def fit_steps(
    steps: StepLog,
    *,
    base: Profile,
    engine: EngineModel,
    draft_cost: DraftCost = "per_forward",
    prompt_tokens: float = 0.0,
    level: float = 0.95,
) -> Fit:
    """Fits the step-time model to recorded steps; raises FitError when the steps cannot support it."""
    if draft_cost not in DRAFT_COSTS:
        raise FitError(f"draft cost: expected one of {', '.join(DRAFT_COSTS)}, got {draft_cost!r}")
    if not 0.5 <= level < 1.0:
        raise FitError(f"level: expected 0.5 <= level < 1, got {level}")
    f = features(steps, engine, prompt_tokens=prompt_tokens)
    y = steps.duration_s
    start = _start(base, draft_cost)
    scale = np.where(np.abs(start) > 0, np.abs(start), [1e-8, 1e-5, 1e-3, 1e-9, 1e-6, 1e-3, 1.0, 1e-2])
    notes: dict[int, str] = {}
    batched_slope = 0.0  # target.batched_s_per_token's estimate where it went negative (then fixed at 0)
    free = np.ones(len(PARAMS), dtype=bool)

    def fix(idx: Sequence[int], why: str) -> None:
        for i in idx:
            if free[i]:
                free[i] = False
                notes[i] = why

    if not (f["eagle_forwards"] > 0).any():
        fix(_EAGLE, f"no EAGLE-3 drafting in the steps: base profile {base.name}")
    if not (f["p_eagle_passes"] > 0).any():
        fix((6,), f"no P-EAGLE drafting in the steps: base profile {base.name}")
    if not (f["ngram_rows"] > 0).any():
        fix((7,), f"no n-gram drafting in the steps: base profile {base.name}")
    if np.ptp(f["kv"]) == 0:
        fix(_KV, f"KV tokens do not vary in the steps: base profile {base.name}")

    def model(u: np.ndarray) -> np.ndarray:
        return profile_of(base, u * scale, draft_cost).step_time(**f)

    u = start / scale
    for _ in range(2 * len(PARAMS)):
        n_free = int(free.sum())
        if n_free == 0:
            # Every parameter was fixed in turn (typically one batch size with drafting off: the
            # batched tokens are then constant and collinear with the constants): nothing to fit.
            varied = np.ptp(steps.batch) > 0 and bool((steps.k > 0).any())
            if varied and any(n.startswith(_NEGATIVE) for n in notes.values()):
                # Steps of every size, but durations that do not grow with them: said as such (it
                # read "record steps at varied batch sizes" of steps at 32 batch sizes).
                raise FitError(
                    f"{steps.source}: every parameter the steps inform fits negative (fixed at 0) in the "
                    f"{draft_cost} model: the durations do not grow with the steps' work (check duration_s)"
                )
            raise FitError(f"{steps.source}: the steps inform none of the parameters ({_lacking(steps)})")
        if steps.n - n_free < 5:
            raise FitError(
                f"{steps.source}: {steps.n} steps for {n_free} parameters: record more steps (hundreds)"
            )
        u, J = _lm(model, y, u, free)
        # Columns that the others explain (collinear) cannot be estimated: fix the worst one.
        norms = np.linalg.norm(J, axis=0)
        if (norms == 0).any():
            i = int(np.flatnonzero(free)[int(np.argmin(norms))])
            fix((i,), f"no effect in these steps: base profile {base.name}")
            u[i] = start[i] / scale[i]
            continue
        _, sv, vt = np.linalg.svd(J / norms, full_matrices=False)
        rank = int((sv >= _COND**0.5 * sv[0]).sum())
        if rank < len(sv):
            fi = np.flatnonzero(free)
            # Each column's share of the combinations that (almost) cancel: the norm of its part of
            # the whole near-null space, the same whichever basis of it LAPACK returns. The last
            # singular vector alone was one arbitrary combination when several values were near 0,
            # and which parameter got fixed (and whether the fit then ended at all) changed with the
            # machine's BLAS. Ties (exactly collinear columns): the later parameter, a draft's first.
            share = np.linalg.norm(vt[rank:], axis=0)
            pos = int(np.flatnonzero(share >= share.max() * (1.0 - 1e-6))[-1])
            i = int(fi[pos])
            others = [PARAMS[j] for q, j in enumerate(fi) if j != i and share[q] > 0.1]
            fix(
                (i,),
                f"collinear with {', '.join(others) or 'the others'} in these steps: base profile {base.name}",
            )
            u[i] = start[i] / scale[i]
            continue
        neg = [i for i in np.flatnonzero(free) if u[i] < 0]
        if neg:
            i = int(min(neg, key=lambda j: u[j]))
            if i == 1:
                batched_slope = float(u[1] * scale[1])
            free[i] = False
            notes[i] = f"{_NEGATIVE} ({u[i] * scale[i]:.3g}): fixed at 0"
            u[i] = 0.0
            continue
        break
    else:
        raise FitError(f"{steps.source}: the fit did not settle; record more varied steps")
    if np.ptp(steps.batch) == 0:
        # Prefill or K variation can still give the batched tokens a slope, but not the one the
        # simulator needs (how a step grows with the batch): a profile fitted here charged the whole
        # step per token, the constant fixed at the base profile's, R² 0.
        raise FitError(
            f"{steps.source}: every step at batch {int(steps.batch[0])}: the steps cannot tell how step "
            f"time grows with the batch; record steps at varied batch sizes"
        )
    if batched_slope < 0:
        fall_s = -batched_slope * float(np.ptp(f["batched"]))
        median_s = float(np.median(y))
        if fall_s > _ABSURD_FALL * median_s:
            # Batching for free (the slope clamped at 0, the rest in the constant) is no engine's
            # profile: the durations are not one engine's step times (another's mixed in, a bad clock).
            # A slope negative by a sliver (flat steps, noise) is fixed at 0 and said, as any other.
            raise FitError(
                f"{steps.source}: target.batched_s_per_token fits negative ({batched_slope:.3g} s per token, "
                f"{fall_s * 1e3:.3g} ms less over the steps' batched tokens, median step "
                f"{median_s * 1e3:.3g} ms): the step durations fall as the batch grows, which no engine's "
                f"do (check duration_s, and that the steps are of one engine); nothing written"
            )
    theta = u * scale
    pred = model(u)
    resid = y - pred
    dof = steps.n - int(free.sum())
    s2 = float(resid @ resid) / dof
    if not (np.isfinite(theta).all() and np.isfinite(s2)):  # never a profile of inf/NaN
        raise FitError(f"{steps.source}: the fit is not finite; check the steps' durations")
    cov = s2 * np.linalg.inv(J.T @ J)
    t = t_quantile(0.5 + level / 2.0, dof)
    params: list[Param] = []
    free_idx = [int(x) for x in np.flatnonzero(free)]
    for i, name in enumerate(PARAMS):
        if free[i]:
            j = free_idx.index(i)
            half = t * math.sqrt(max(float(cov[j, j]), 0.0)) * scale[i]
            params.append(
                Param(name, float(theta[i]), float(theta[i] - half), float(theta[i] + half), "fitted")
            )
        else:
            v = float(theta[i])
            params.append(Param(name, v, v, v, "fixed", notes.get(i, "")))
    return Fit(
        profile=profile_of(base, theta, draft_cost),
        params=tuple(params),
        draft_cost=draft_cost,
        level=level,
        measured_s=y,
        predicted_s=pred,
        batch=steps.batch,
        source=steps.source,
    )


def fit_best(steps: StepLog, *, draft_costs: Sequence[DraftCost], **kw: Any) -> Fit:
    """Fits each draft-cost model; the one with the smaller residual, with the others' residuals noted.
    A model the steps cannot support is left out (FitError only when none fits): one that failed
    failed the whole ``--draft-cost auto`` while the other fitted."""
    fits: list[Fit] = []
    errors: list[FitError] = []
    for dc in draft_costs:
        try:
            fits.append(fit_steps(steps, draft_cost=dc, **kw))
        except FitError as e:
            errors.append(e)
    if not fits:
        raise errors[0]
    best = min(fits, key=lambda x: x.rmse_s)
    if len(fits) > 1:
        best = dataclasses.replace(best, alternatives={x.draft_cost: x.rmse_s for x in fits})
    return best


def render_profile(
    fit: Fit, *, name: str, base: Profile, model: str | None = None, hardware: str | None = None
) -> str:
    """The fitted profile as YAML: the base profile's memory and prices, the fitted step-time model,
    and a ``fit`` block saying how it was fitted (the loader ignores it)."""
    v = {p.name: p.value for p in fit.params}
    fitted = [p.name for p in fit.params if p.status == "fitted"]
    fixed = [f"{p.name} ({p.note})" for p in fit.params if p.status == "fixed"]
    doc: dict[str, Any] = {
        "name": name,
        "description": f"fitted to {fit.source} ({len(fit.measured_s)} steps)",
        "model": model or base.model,
        "hardware": hardware or base.hardware,
        "derivation": (
            f"Fitted by `controllerctl profile fit` to {len(fit.measured_s)} recorded steps ({fit.source}): "
            f"least squares on the simulator's step-time model, draft cost {fit.draft_cost}; "
            f"residual RMS {fit.rmse_s * 1e3:.4g} ms, R² {fit.r2:.4f}. Fitted: {', '.join(fitted)}. "
            f"Fixed: {', '.join(fixed) or 'none'}. target.const_s includes the per-step overhead "
            f"(not separable in step timings), and so does the host's time per step (scheduling, the "
            f"controller plugin): no scheduling or plugin section. Memory and prices are the base profile's "
            f"({base.name}), not fitted."
        ),
        "sources": [f"controllerctl profile fit {fit.source}"],
        "target": {
            "kv_s_per_token": v[PARAMS[0]],
            "batched_s_per_token": v[PARAMS[1]],
            "const_s": v[PARAMS[2]],
        },
        "draft": {
            "eagle3": {
                "kv_s_per_token": v[PARAMS[3]],
                "spec_s_per_token": v[PARAMS[4]],
                "const_s": v[PARAMS[5]],
                "fit_k": 1,
                "cost": fit.draft_cost,
            },
            # Not fitted (recorded steps rarely vary P-EAGLE's K): the base profile's figure.
            "p_eagle": {"pass_forwards": v[PARAMS[6]], "slot_s": base.p_eagle_slot_s},
            "ngram": {"verify_fraction": v[PARAMS[7]]},
        },
        "overhead_s": 0.0,
        "memory": dataclasses.asdict(base.memory),
        "gpu_price": base.gpu_price_key,
        "api_price": base.api_price_key,
        "fit": fit.summary(),
    }
    # yamldoc's Dumper: a text such as --model 2e5 is quoted, so the file reads back as written
    return yaml.dump(doc, Dumper=yamldoc.Dumper, sort_keys=False, allow_unicode=True, width=100)


def residual_plot(fit: Fit, path: Path) -> None:
    """Measured vs predicted step time, and residuals against batch size (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms, pr = fit.measured_s * 1e3, fit.predicted_s * 1e3
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.scatter(pr, ms, s=6, alpha=0.5)
    lo, hi = float(min(ms.min(), pr.min())), float(max(ms.max(), pr.max()))
    a.plot([lo, hi], [lo, hi], color="black", lw=1)
    a.set_xlabel("predicted step time (ms)")
    a.set_ylabel("measured step time (ms)")
    a.set_title(f"{len(ms)} steps, R² {fit.r2:.4f}, draft cost {fit.draft_cost}")
    jitter = np.random.default_rng(0).uniform(-0.2, 0.2, len(ms))
    b.scatter(fit.batch + jitter, ms - pr, s=6, alpha=0.5)
    b.axhline(0.0, color="black", lw=1)
    b.set_xlabel("batch size (jittered)")
    b.set_ylabel("residual (ms)")
    b.set_title(f"residual RMS {fit.rmse_s * 1e3:.3g} ms")
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
