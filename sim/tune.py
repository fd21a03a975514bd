"""``controllerctl sim tune``: grid search over a policy's parameters on traces and scenarios.

Each candidate replays every (trace, concurrency) on the engine model; its score is the geometric mean
of its throughput over the best static arm that engine can play on the same trace and concurrency.
The table goes to stdout; the winning policy is written as YAML (``--out``) under a new name
(``<name>-tuned``) with the values it won with in its description, integers written as integers.

Every (candidate or static baseline, trace, concurrency) replay is one job on an executor
(``sim.executor``: a local process pool or Ray); jobs are seeded and pure, so the result is the same on
either and with any number of workers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from policies.algorithms import REGISTRY
from policies.directive import RequestRule
from policies.params import resolve
from policies.rules import RULES
from policies.spec import PolicySpec, parse_policy, render_policy
from sim.costmodel import Profile
from sim.engines import EngineModel
from sim.executor import Executor, LocalExecutor, ShippedPolicy
from sim.oracle import run_static_arms
from sim.replay import Replayer
from sim.trace import Trace

#: The most grid points one sweep runs (each is a replay per trace and concurrency level).
MAX_GRID_POINTS = 10_000


def parse_grid(items: Sequence[str]) -> dict[str, list[float]]:
    """``["explore=0,0.3", "rule.min_run=2,3"]`` -> {"explore": [0.0, 0.3], "rule.min_run": [2.0, 3.0]}.

    A value given twice counts once; a name given twice, or a grid of more than ``MAX_GRID_POINTS``
    points, raises ValueError (the second ``--param explore=...`` used to replace the first silently,
    and a long list ran for hours)."""
    out: dict[str, list[float]] = {}
    for it in items:
        name, sep, vals = it.partition("=")
        name = name.strip()
        if not sep or not name or not vals:
            raise ValueError(f"--param {it!r}: expected NAME=V1,V2 (e.g. explore=0,0.3 or rule.min_run=2,3)")
        if name in out:
            raise ValueError(f"--param {name}: given twice (list every value once: {name}=V1,V2)")
        try:
            # (+ 0.0: "-0,0" is one value, printed 0, not a point named "-0")
            out[name] = list(dict.fromkeys(float(v) + 0.0 for v in vals.split(",") if v.strip()))
        except ValueError:
            raise ValueError(f"--param {it!r}: values must be numbers") from None
        if not out[name]:  # "explore= ," made a grid of no points: "no candidates", then a traceback
            raise ValueError(f"--param {it!r}: no values (expected NAME=V1,V2)")
    points = math.prod(len(v) for v in out.values())
    if points > MAX_GRID_POINTS:
        raise ValueError(f"--param: {points} grid points; at most {MAX_GRID_POINTS} per sweep")
    return out


def with_params(spec: PolicySpec, values: dict[str, float]) -> PolicySpec:
    """``spec`` with algorithm (``name``) and rule (``rule.name``) parameters replaced, validated."""
    algo = {k: v for k, v in values.items() if not k.startswith("rule.")}
    rule = {k.removeprefix("rule."): v for k, v in values.items() if k.startswith("rule.")}
    try:
        params = resolve(REGISTRY[spec.algorithm].PARAMS, {**spec.params, **_typed(algo)}, "--param")
    except ValueError as e:  # "--param.explore: ..." as "--param explore: ...", as rule.NAME reads
        msg = str(e)
        raise ValueError(
            "--param " + msg.removeprefix("--param.") if msg.startswith("--param.") else msg
        ) from None
    rp = resolve(RULES[spec.rule.kind], {**spec.rule.params, **_typed(rule)}, "--param rule")
    out = replace(spec, params=params, rule=RequestRule(spec.rule.kind, rp))
    return parse_policy(render_policy(out), source=f"<tuned {spec.name}>")


def _typed(d: dict[str, float]) -> dict[str, Any]:
    return {k: int(v) if float(v).is_integer() else v for k, v in d.items()}


@dataclass(slots=True)
class Candidate:
    values: dict[str, float]
    spec: PolicySpec
    ratios: list[float]

    @property
    def score(self) -> float:
        return float(np.exp(np.mean(np.log(self.ratios)))) if self.ratios else 0.0


def _best_static(job: tuple[Trace, Profile, int, frozenset[str]]) -> float:
    tr, profile, c, arms_ok = job
    st = run_static_arms(tr, profile, c)
    return max(r.throughput for a, r in st.items() if a in arms_ok)


def _replay(job: tuple[Trace, Profile, EngineModel, ShippedPolicy, int, int]) -> float:
    tr, profile, engine, policy, c, seed = job
    return (
        Replayer(trace=tr, profile=profile, engine=engine, policy=policy.spec(), concurrency=c, seed=seed)
        .run()
        .throughput
    )


def candidates(spec: PolicySpec, grid: dict[str, list[float]]) -> list[Candidate]:
    """Every grid point as a validated policy, in grid order (ValueError on the first that is not)."""
    names = list(grid)
    return [
        Candidate(values, with_params(spec, values), [])
        for values in (
            dict(zip(names, combo, strict=True)) for combo in itertools.product(*(grid[n] for n in names))
        )
    ]


def tune_jobs(points: Sequence[Candidate], traces: Sequence[Trace], concurrency: Sequence[int]) -> int:
    """How many jobs ``tune`` runs (``progress`` is called once for each): the best static arm and every
    point, on every trace at every concurrency."""
    return len(traces) * len(concurrency) * (1 + len(points))


def tune(
    spec: PolicySpec,
    grid: dict[str, list[float]],
    traces: Sequence[Trace],
    profile: Profile,
    engine: EngineModel,
    concurrency: Sequence[int],
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    executor: Executor | None = None,
    points: Sequence[Candidate] | None = None,
) -> list[Candidate]:
    """Every grid point, best first. ``progress`` gets one line per finished job of the whole sweep.
    ``points``: ``candidates(spec, grid)`` made already (the command line validates them before it
    starts; made twice, 10^4 points took minutes before the first job)."""
    ex = executor or LocalExecutor()
    arms_ok = frozenset(str(a) for a in engine.arms(max(t.max_k for t in traces)))
    cells = [(ti, c) for ti in range(len(traces)) for c in concurrency]
    cands = (
        [Candidate(dict(c.values), c.spec, []) for c in points]
        if points is not None
        else candidates(spec, grid)
    )
    total = tune_jobs(cands, traces, concurrency)
    done = 0

    def tick(what: Callable[[int], str]) -> Callable[[int, float], None]:
        def on_done(i: int, thr: float) -> None:
            nonlocal done
            done += 1
            if progress:
                progress(f"[{done}/{total}] {what(i)}: {thr:.1f} tok/s")

        return on_done

    best_jobs = [(traces[ti], profile, c, arms_ok) for ti, c in cells]
    best_list = ex.map(_best_static, best_jobs, tick(lambda i: f"best static, {_cell(traces, cells[i])}"))
    best = dict(zip(cells, best_list, strict=True))
    jobs = [
        (traces[ti], profile, engine, ShippedPolicy.of(cand.spec), c, seed)
        for cand in cands
        for ti, c in cells
    ]
    n = len(cells)
    thr = ex.map(_replay, jobs, tick(lambda i: f"{cands[i // n].values}, {_cell(traces, cells[i % n])}"))
    for j, cand in enumerate(cands):
        cand.ratios = [thr[j * n + x] / best[cells[x]] for x in range(n)]
    return sorted(cands, key=lambda x: -x.score)


def _cell(traces: Sequence[Trace], cell: tuple[int, int]) -> str:
    return f"{traces[cell[0]].name} at concurrency {cell[1]}"


def render_tuned(cand: Candidate) -> str:
    """The candidate as a policy document: renamed ``<name>-tuned``, its grid values in the description,
    integral numbers written as integers (``min_run: 3``, not ``3.0``). It parses back to the same policy."""
    import yaml

    spec = cand.spec
    chosen = ", ".join(f"{k}={v:g}" for k, v in cand.values.items())
    name = f"{spec.name[:122]}-tuned"
    described = f"{spec.description} Tuned by controllerctl sim tune: {chosen}.".strip()
    doc = yaml.safe_load(render_policy(replace(spec, name=name, description=described)))
    text: str = yaml.safe_dump(_integral(doc), sort_keys=False)
    return text


def _integral(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _integral(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_integral(v) for v in doc]
    if isinstance(doc, float) and doc.is_integer() and abs(doc) < 2**53:
        return int(doc)
    return doc


def table(cands: Sequence[Candidate]) -> str:
    if not cands:
        return "no candidates"
    names = list(cands[0].values)
    head = " | ".join([*names, "score (geo-mean x best static)", "min", "max"])
    lines = [head, "-" * len(head)]
    for c in cands:
        vals = [f"{c.values[n]:g}" for n in names]
        lines.append(" | ".join([*vals, f"{c.score:.4f}", f"{min(c.ratios):.3f}", f"{max(c.ratios):.3f}"]))
    return "\n".join(lines)
