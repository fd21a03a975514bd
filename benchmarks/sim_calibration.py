"""The simulator's calibration tables (docs/simulator.md), from generated traces and the shipped profiles.

    python benchmarks/sim_calibration.py [--requests 300] [--seed 0] [--json FILE]

* ``acceptance``: per traffic class (its own scenario, ``--requests`` requests), the mean accepted
  draft tokens per step of static arms at concurrency 1 on the default profile (vLLM's "AL" is this
  + 1), beside the published anchor each class was calibrated to.
* ``p_eagle_depth``: the speedup over no speculation of every ``static:p_eagle:K`` on the ``chat``
  scenario, per profile and concurrency, and the best K: what ``controllerctl sim replay --scenario
  chat --policy static:p_eagle:K --no-oracle`` gives, without its report.

Every figure is a deterministic replay (static arms run vectorised, a few seconds in all); it prints a
line per row and asserts nothing. `make results` writes docs/results/sim-calibration.json, and
benchmarks/readme_results.py renders the doc's two tables from it. A mistaken flag or a ``--json`` that
cannot be written exits 2 before any replay; the file is replaced whole, once, at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from policies.arms import Arm
from policies.text import error_text
from sim import cli_types
from sim.compare import _static_spec, run_one
from sim.costmodel import DEFAULT_PROFILE, load_profile
from sim.engines import engine_for_arm
from sim.files import output_problem, replace_file
from sim.traffic import generate

CLASSES = ("chat", "code", "maths", "summarisation", "code-edit")
ARMS = ("eagle3:3", "eagle3:7", "p_eagle:3", "p_eagle:7", "ngram:4", "ngram:8")
#: What each class's acceptance was calibrated to (sim/traffic.py says how; not measured here).
ANCHORS = {
    "chat": "vLLM #20780 MT-bench EAGLE-3 AL 2.79 (K=3), 3.54 (K=7); PLD τ−1 0.63 (Vicuna, MT-bench)",
    "code": "EAGLE-3 τ HumanEval/MT-bench 6.74/6.13; PLD τ−1 0.93",
    "maths": "GSM8K ≈ MT-bench (6.23/6.13); PLD τ−1 0.73",
    "summarisation": "PLD τ−1 1.50 (CNN/DM)",
    "code-edit": "SpecDecode-Bench: n-gram spans 1.1–15 (p5–p95) on InstructCoder",
}
DEPTH_PROFILES = ("llama-3.1-8b-h100", "gpt-oss-120b-h100")
LEVELS = (1, 8, 32)
MAX_K = 8


def _run(trace: Any, profile: Any, arm: str, c: int) -> Any:
    a = Arm.parse(arm)
    return run_one(trace, profile, _static_spec(a), engine_for_arm(a), c)


def acceptance(requests: int, seed: int) -> list[dict[str, Any]]:
    profile = load_profile(DEFAULT_PROFILE)
    rows = []
    for cls in CLASSES:
        trace = generate(cls, n_requests=requests, seed=seed)
        per_arm = {}
        for arm in ARMS:
            r = _run(trace, profile, arm, 1)
            per_arm[arm] = round(r.accepted / r.request_steps, 3)
        rows.append({"class": cls, "accepted_per_step": per_arm, "anchor": ANCHORS[cls]})
    return rows


def p_eagle_depth(requests: int, seed: int) -> list[dict[str, Any]]:
    trace = generate("chat", n_requests=requests, seed=seed)
    rows = []
    for name in DEPTH_PROFILES:
        profile = load_profile(name)
        for c in LEVELS:
            off = _run(trace, profile, "off", c).throughput
            speedup = {
                str(k): round(_run(trace, profile, f"p_eagle:{k}", c).throughput / off, 3)
                for k in range(1, MAX_K + 1)
            }
            best = max(speedup, key=lambda k: speedup[k])
            rows.append({"profile": name, "c": c, "speedup_vs_no_spec": speedup, "best_k": int(best)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=cli_types.requests, default=300, help="requests per generated trace")
    ap.add_argument("--seed", type=cli_types.seed, default=0)
    ap.add_argument("--json", metavar="FILE", help="also write the tables as JSON here")
    a = ap.parse_args(argv)
    # Checked now, not after the replays: a bad --json ended the run in a traceback.
    problem = output_problem("--json", a.json)
    if problem:
        ap.error(problem)
    doc = {
        "command": "python benchmarks/sim_calibration.py"
        + (f" --requests {a.requests}" if a.requests != 300 else "")
        + (f" --seed {a.seed}" if a.seed else ""),
        "profile": DEFAULT_PROFILE,
        "requests": a.requests,
        "seed": a.seed,
        "acceptance": acceptance(a.requests, a.seed),
        "p_eagle_depth": p_eagle_depth(a.requests, a.seed),
    }
    for r in doc["acceptance"]:
        print(
            f"{r['class']}: accepted per step at c=1 "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["accepted_per_step"].items())
        )
    for r in doc["p_eagle_depth"]:
        print(
            f"{r['profile']} c={r['c']}: best p_eagle K {r['best_k']}, speedup {r['speedup_vs_no_spec'][str(r['best_k'])]:.2f}x"
        )
    if a.json:
        try:
            replace_file(a.json, (json.dumps(doc, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
        except OSError as e:
            print(f"sim_calibration: {a.json}: {error_text(e)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
