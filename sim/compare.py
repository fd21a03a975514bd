"""Runs policies, static baselines and the oracles on one trace and collects the result JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.arms import Arm, Method
from policies.spec import PolicySpec
from sim.costmodel import Profile
from sim.engines import ENGINES, EngineModel, engine_for_arm
from sim.oracle import Oracles, compute_oracles, static_arms
from sim.prices import Prices
from sim.progress import ProgressBar
from sim.replay import Replayer, needs_plugin
from sim.run import RunResult, metrics_block
from sim.trace import Trace
from sim.vectorised import replay_static


def static_arm_of(spec: PolicySpec) -> Arm | None:
    """The arm of a static policy without a per-request rule (a plain vLLM configured once, replayed
    vectorised on the engine that plays the arm), else None. A static arm with a rule is driven by the
    plugin, so it runs stepwise on the engines asked for and pays the plugin's cost."""
    if needs_plugin(spec):
        return None
    return Arm.parse(str(spec.params["arm"]))


@dataclass(slots=True)
class Entry:
    label: str
    policy: str
    engine: str
    kind: str  # "policy", "static" or "oracle"
    runs: dict[int, RunResult] = field(default_factory=dict)


@dataclass(slots=True)
class Comparison:
    trace: Trace
    profile: Profile
    prices: Prices
    concurrency: list[int]
    open_loop: bool
    entries: list[Entry] = field(default_factory=list)
    oracles: dict[int, Oracles] = field(default_factory=dict)
    no_spec: dict[int, RunResult] = field(default_factory=dict)

    def cost_per_1m(self, run: RunResult) -> float:
        return self.prices.gpu_cost_per_1m(
            self.profile.gpu_price_key, self.profile.memory.num_gpus, run.throughput
        )

    def block(self, run: RunResult, c: int) -> dict[str, Any]:
        o = self.oracles.get(c)
        b = metrics_block(
            run,
            no_spec_throughput=self.no_spec[c].throughput,
            cost_usd_per_1m=self.cost_per_1m(run),
            oracle_throughput=o.throughput if o is not None else None,
        )
        b["engine"] = run.engine
        best = self.best_static_of_engine(run.engine, c)
        if best is not None:
            arm, thr = best[0], best[1].throughput
            b["best_static_of_engine"] = {
                "arm": arm,
                "throughput_tok_s": round(thr, 3),
                "ratio": round(run.throughput / thr, 4) if thr > 0 else None,
            }
        if o is not None:
            by_kind: dict[str, Any] = {}
            for kind, thr in o.throughputs().items():
                by_kind[kind] = {"throughput_tok_s": round(thr, 3), "ratio": round(run.throughput / thr, 4)}
            by_kind["best_static"]["arm"] = o.best_static[0]
            b["oracle"]["by_kind"] = by_kind
        return b

    def best_static_of_engine(self, engine: str, c: int) -> tuple[str, RunResult] | None:
        """The best single static arm the engine model ``engine`` can play, at concurrency ``c``.

        The baseline of the README and docs/decision-quality.md: the arms that engine loads
        (``EngineModel.arms``), not every arm of the trace (the oracles' best static arm may be one the
        engine cannot play, e.g. P-EAGLE for the composite drafter). None in open loop (no static arm
        replays there) and for the oracles' own entries.
        """
        o, model = self.oracles.get(c), ENGINES.get(engine)
        if o is None or model is None:
            return None
        return best_static_among(o.static, model.arms(self.trace.max_k))

    def result(self, e: Entry) -> dict[str, Any]:
        """One run in the fixed layout of docs/simulator.md (result JSON)."""
        return {
            "policy": e.policy,
            "profile": self.profile.name,
            "trace": self.trace.name,
            "engine": e.engine,
            "kind": e.kind,
            "open_loop": self.open_loop,
            "concurrency": {str(c): self.block(r, c) for c, r in sorted(e.runs.items())},
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": self.trace.name,
            "profile": self.profile.name,
            "requests": self.trace.n,
            "output_tokens": self.trace.total_output_tokens,
            "open_loop": self.open_loop,
            "runs": [self.result(e) for e in self.entries],
        }


def best_static_among(static: dict[str, RunResult], arms: Sequence[Arm]) -> tuple[str, RunResult] | None:
    """The highest-throughput run of ``static`` (arm label -> run) among ``arms``; None if none ran."""
    playable = {str(a) for a in arms}
    runs = {label: r for label, r in static.items() if label in playable}
    if not runs:
        return None
    label = max(runs, key=lambda k: runs[k].throughput)
    return label, runs[label]


def _policy_label(spec: PolicySpec, engine: EngineModel) -> str:
    return f"{spec.name} @ {engine.name}"


def run_comparison(
    trace: Trace,
    profile: Profile,
    prices: Prices,
    *,
    policies: Sequence[PolicySpec],
    engines: Sequence[EngineModel] = (ENGINES["stock-vllm"], ENGINES["composite"]),
    concurrency: Sequence[int] = (1, 8, 32),
    open_loop: bool = False,
    oracle: bool = True,
    baselines: Sequence[str] | None = ("eagle3:3", "ngram:4"),
    seed: int = 0,
    progress: ProgressBar | None = None,
) -> Comparison:
    """Every policy under every engine model, plus static baselines and oracles, at each concurrency."""
    cmp = Comparison(trace, profile, prices, list(concurrency), open_loop)
    arms_ok = {str(a) for a in static_arms(trace)}
    for c in concurrency:
        if progress:
            progress.set_label(f"baselines and oracles at concurrency {c}")
        if open_loop:
            cmp.no_spec[c] = Replayer(
                trace=trace,
                profile=profile,
                engine=ENGINES["no-spec"],
                policy=_static_spec("off"),
                concurrency=c,
                open_loop=True,
                label="static off",
            ).run()
        elif oracle:
            cmp.oracles[c] = compute_oracles(trace, profile, c)
            cmp.no_spec[c] = cmp.oracles[c].static["off"]
        else:
            cmp.no_spec[c] = replay_static(
                trace,
                method=Method.OFF,
                k=0,
                concurrency=c,
                profile=profile,
                engine=ENGINES["no-spec"],
                label="static off",
            )
    # Static baselines: the fixed ones asked for, the best static arm at each level, and off
    # (none at all when ``baselines`` is None: a single replay).
    wanted = [b for b in baselines or () if b in arms_ok]
    if baselines is not None:
        for c in concurrency:
            if c in cmp.oracles:
                best = cmp.oracles[c].best_static[0]
                if best not in wanted:
                    wanted.append(best)
        # Open loop has no oracle to name the best static arm: add P-EAGLE at max K, usually it.
        pe = f"{Method.P_EAGLE.value}:{trace.max_k}"
        if not cmp.oracles and pe in arms_ok and pe not in wanted:
            wanted.append(pe)
        if "off" not in wanted:
            wanted.append("off")
    for arm_s in wanted:
        arm = Arm.parse(arm_s)
        eng = engine_for_arm(arm)
        e = Entry(f"static {arm}", f"static-{str(arm).replace(':', '-')}", eng.name, "static")
        for c in concurrency:
            if c in cmp.oracles:
                e.runs[c] = cmp.oracles[c].static[str(arm)]
            else:
                e.runs[c] = run_one(
                    trace, profile, _static_spec(arm_s), eng, c, open_loop=open_loop, seed=seed
                )
        cmp.entries.append(e)
    for spec in policies:
        sarm = static_arm_of(spec)
        for eng in engines if sarm is None else [engine_for_arm(sarm)]:
            e = Entry(_policy_label(spec, eng), spec.name, eng.name, "policy")
            for c in concurrency:
                if progress:
                    progress.set_label(f"{e.label} at concurrency {c}")
                e.runs[c] = run_one(
                    trace, profile, spec, eng, c, open_loop=open_loop, seed=seed, progress=progress
                )
            cmp.entries.append(e)
    for c, o in cmp.oracles.items():
        if baselines is None:
            break
        for kind in ("per_class", "per_phase", "per_step"):
            r = getattr(o, kind)
            if r is None:
                continue
            label = f"oracle {kind.replace('_', ' ')}"
            oe = next((x for x in cmp.entries if x.label == label), None)
            if oe is None:
                oe = Entry(label, label, r.engine, "oracle")
                cmp.entries.append(oe)
            oe.runs[c] = r
    if progress:
        progress.close()
    return cmp


def _static_spec(arm: str | Arm) -> PolicySpec:
    from policies.spec import static_policy

    return static_policy(arm)


def run_one(
    trace: Trace,
    profile: Profile,
    spec: PolicySpec,
    engine: EngineModel,
    concurrency: int,
    *,
    open_loop: bool = False,
    seed: int = 0,
    progress: ProgressBar | None = None,
) -> RunResult:
    """One policy at one concurrency: vectorised for a static arm in closed loop, stepwise otherwise."""
    arm = static_arm_of(spec)
    if arm is not None and not open_loop:
        eng = engine_for_arm(arm)
        if arm.method is not Method.OFF and arm.method not in trace.acc:
            raise ValueError(
                f"policy {spec.name!r}: trace {trace.name!r} has no {arm.method.value} acceptance data"
            )
        r = replay_static(
            trace,
            method=arm.method,
            # As the engine would: K capped at the trace's max_k (P-EAGLE too: every depth is aligned
            # with the plugin's depth fix, and a P-EAGLE deployment at K is aligned in any vLLM).
            k=min(arm.k, trace.max_k),
            concurrency=concurrency,
            profile=profile,
            engine=eng,
            label=spec.name,
        )
        if progress:
            progress.advance(trace.total_output_tokens)
        return r
    rp = Replayer(
        trace=trace,
        profile=profile,
        engine=engine,
        policy=spec,
        concurrency=concurrency,
        open_loop=open_loop,
        seed=seed,
        label=spec.name,
        progress=progress.advance if progress else None,
    )
    return rp.run()


def summary_rows(cmp: Comparison, c: int) -> list[tuple[str, dict[str, Any]]]:
    """(label, metrics block) for every entry at concurrency ``c``, in report order."""
    out = []
    for e in cmp.entries:
        r = e.runs.get(c)
        if r is not None:
            out.append((e.label, cmp.block(r, c)))
    return out


def arm_share(run: RunResult) -> dict[str, float]:
    """Share of decode steps per arm (for the report)."""
    from sim.run import arm_of_code

    arms = run.timeline.arm[run.timeline.arm >= 0]
    if not len(arms):
        return {}
    codes, counts = np.unique(arms, return_counts=True)
    return {str(arm_of_code(int(c))): float(n / counts.sum()) for c, n in zip(codes, counts, strict=True)}
