"""Headroom of the demo's phases: what a causal policy could reach there, against what the default does.

    python benchmarks/demo_headroom.py [--requests 200] [--seed 1] [--json FILE]

For each phase of the demo's schedule (its traffic class at its concurrency, closed loop, a fresh
trace of that class alone) it replays, in the simulator the demo engine runs on: every static arm on a
plain vLLM (the baseline, as in the demo), the default policy on the composite drafter, the hindsight
rule (the best single EAGLE-3 K chosen knowing the results, plus the default's per-request n-gram
rule: what a causal policy with a perfect slow loop would reach) and the clairvoyant per-step oracle
(a bound no causal policy can reach). Ratios are to the phase's best static arm, measured in the same
run; engines a controller drives pay the plugin's cost per step (the profile's ``plugin`` section).
Prints figures; asserts nothing. A mistaken flag or a ``--json`` that cannot be written exits 2 before
any replay; the file is replaced whole, once, at the end.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from controller.embedded.workload import DEMO_SCHEDULE  # noqa: E402
from policies.arms import Arm, Method  # noqa: E402
from policies.presets import load_preset  # noqa: E402
from policies.spec import static_policy  # noqa: E402
from policies.text import error_text  # noqa: E402
from sim import cli_types  # noqa: E402
from sim.costmodel import DEFAULT_PROFILE, load_profile  # noqa: E402
from sim.engines import ENGINES, engine_for_arm  # noqa: E402
from sim.files import output_problem, replace_file  # noqa: E402
from sim.oracle import per_step_oracle  # noqa: E402
from sim.replay import Replayer  # noqa: E402
from sim.traffic import CLASSES, Scenario, generate  # noqa: E402

MAX_K = 8


def _phase(cls: str, concurrency: int, n: int, seed: int) -> dict[str, Any]:
    w = np.array([1.0 if c == cls else 0.0 for c in CLASSES])
    sc = Scenario(cls, cls, lambda x: np.broadcast_to(w, (len(x), len(w))), n_requests=n)
    comp = ENGINES["composite"]
    tr = generate(sc, seed=seed, max_k=MAX_K, methods=comp.methods)
    prof = load_profile(DEFAULT_PROFILE)

    def run(spec: Any, engine: Any) -> float:
        return (
            Replayer(trace=tr, profile=prof, engine=engine, policy=spec, concurrency=concurrency, seed=0)
            .run()
            .throughput
        )

    static = {str(a): run(static_policy(a), engine_for_arm(a)) for a in comp.arms(MAX_K)}
    best_arm = max(static, key=lambda a: static[a])
    best = static[best_arm]
    default = load_preset("default")
    rule = {
        k: run(dataclasses.replace(static_policy(Arm(Method.EAGLE3, k)), rule=default.rule), comp)
        for k in range(1, MAX_K + 1)
    }
    k_best = max(rule, key=lambda k: rule[k])
    oracle = per_step_oracle(tr, prof, concurrency, methods=comp.methods, engine=comp).throughput
    return {
        "class": cls,
        "concurrency": concurrency,
        "best_static": best_arm,
        "best_static_tok_s": round(best, 1),
        "default_vs_best_static": round(run(default, comp) / best, 4),
        "hindsight_rule_vs_best_static": round(rule[k_best] / best, 4),
        "hindsight_rule_k": k_best,
        "per_step_oracle_vs_best_static": round(oracle / best, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=cli_types.requests, default=200, help="requests per phase")
    ap.add_argument("--seed", type=cli_types.seed, default=1)
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    # Checked now, not after the replays (minutes): a bad --json ended the run in a traceback.
    problem = output_problem("--json", a.json)
    if problem:
        ap.error(problem)
    rows = []
    for i, p in enumerate(DEMO_SCHEDULE.phases):
        cls = next(iter(p.mix))
        print(f"[{i + 1}/{len(DEMO_SCHEDULE.phases)}] {cls} at concurrency {p.concurrency}", file=sys.stderr)
        rows.append(_phase(cls, p.concurrency, a.requests, a.seed))
    print("| phase | c | best static | default | hindsight rule (K) | per-step oracle |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['class']} | {r['concurrency']} | {r['best_static']} ({r['best_static_tok_s']:.0f} tok/s) | "
            f"{r['default_vs_best_static']:.3f} | {r['hindsight_rule_vs_best_static']:.3f} "
            f"(eagle3:{r['hindsight_rule_k']}) | {r['per_step_oracle_vs_best_static']:.3f} |"
        )
    if a.json:
        doc = {"requests": a.requests, "seed": a.seed, "phases": rows}
        try:
            replace_file(a.json, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
        except OSError as e:
            print(f"demo_headroom: {a.json}: {error_text(e)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
