"""``controllerctl sim tune``: grid search over a policy's parameters on traces and scenarios.

Each candidate replays every (trace, concurrency) on the engine model; its score is the geometric mean
of its throughput over the best static arm that engine can play on the same trace and concurrency.
The table goes to stdout; the winning policy is written as YAML (``--out``) under a new name
(``<name>-tuned``) with the values it won with in its description, integers written as integers.
"""

from __future__ import annotations

import itertools
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
from sim.oracle import run_static_arms
from sim.replay import Replayer
from sim.trace import Trace


def parse_grid(items: Sequence[str]) -> dict[str, list[float]]:
    """``["explore=0,0.3", "rule.min_run=2,3"]`` -> {"explore": [0.0, 0.3], "rule.min_run": [2.0, 3.0]}."""
    out: dict[str, list[float]] = {}
    for it in items:
        name, sep, vals = it.partition("=")
        if not sep or not name or not vals:
            raise ValueError(f"--param {it!r}: expected NAME=V1,V2 (e.g. explore=0,0.3 or rule.min_run=2,3)")
        try:
            out[name.strip()] = [float(v) for v in vals.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--param {it!r}: values must be numbers") from None
    return out


def with_params(spec: PolicySpec, values: dict[str, float]) -> PolicySpec:
    """``spec`` with algorithm (``name``) and rule (``rule.name``) parameters replaced, validated."""
    algo = {k: v for k, v in values.items() if not k.startswith("rule.")}
    rule = {k.removeprefix("rule."): v for k, v in values.items() if k.startswith("rule.")}
    params = resolve(REGISTRY[spec.algorithm].PARAMS, {**spec.params, **_typed(algo)}, "--param")
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
) -> list[Candidate]:
    """Every grid point, best first."""
    arms_ok = {str(a) for a in engine.arms(max(t.max_k for t in traces))}
    best: dict[tuple[int, int], float] = {}
    for ti, tr in enumerate(traces):
        for c in concurrency:
            st = run_static_arms(tr, profile, c)
            best[(ti, c)] = max(r.throughput for a, r in st.items() if a in arms_ok)
    names = list(grid)
    out: list[Candidate] = []
    for combo in itertools.product(*(grid[n] for n in names)):
        values = dict(zip(names, combo, strict=True))
        cand = Candidate(values, with_params(spec, values), [])
        for ti, tr in enumerate(traces):
            for c in concurrency:
                r = Replayer(
                    trace=tr, profile=profile, engine=engine, policy=cand.spec, concurrency=c, seed=seed
                ).run()
                cand.ratios.append(r.throughput / best[(ti, c)])
        if progress:
            progress(f"{values}: {cand.score:.4f}")
        out.append(cand)
    return sorted(out, key=lambda x: -x.score)


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
