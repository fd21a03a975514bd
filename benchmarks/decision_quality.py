"""Decision quality: every algorithm and every static arm on the built-in scenarios, both engine models.

    python benchmarks/decision_quality.py [--requests 120] [--jobs 2] [--ngram-signal on|off] [--out FILE]
        [--executor local|ray] [--address ADDRESS]

For each scenario, concurrency and engine model it prints each policy's throughput as a ratio to the
best single static arm *that engine can play* (stock vLLM: eagle3:1..8 and off; composite drafter:
eagle3:1..8, ngram:1..8 and off; P-EAGLE needs other draft weights, so it is shown apart), to the
per-phase oracle and to the per-step oracle (both on the composite drafter; closed loop only), and
its p99 TPOT. The load ramp (1 -> 32 -> 1) is an open-loop trace whose arrival rate rises and falls,
capped at 32 running requests: there are no oracles there, and the static arms are replayed stepwise.
``--ngram-signal off`` replays as if the engine did not report the n-gram proposer's match (the
generated traces carry it; the policies see it only where the engine drafts n-gram per request).
Every replay is one job on ``--executor`` (a local process pool, or Ray: ``--address`` joins an
existing cluster); jobs are seeded, so both give the same tables. Progress goes to stderr. Prints
figures; asserts nothing. ``--out`` writes the whole file (make results writes docs/decision-quality.md
so): notes that no run regenerates belong in docs/decision-quality-history.md, which the header links.
Unknown scenario or policy names and an ``--out`` that cannot be written exit 2 before any replay.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from policies.arms import Arm  # noqa: E402
from policies.spec import PolicySpec, parse_policy, static_policy  # noqa: E402
from policies.text import error_text  # noqa: E402
from sim import cli_types  # noqa: E402
from sim.costmodel import DEFAULT_PROFILE, load_profile  # noqa: E402
from sim.engines import ENGINES, engine_for_arm  # noqa: E402
from sim.executor import ExecutorError, make_executor  # noqa: E402
from sim.files import output_problem, replace_file  # noqa: E402
from sim.oracle import compute_oracles, latent_oracle, per_step_oracle  # noqa: E402
from sim.replay import Replayer  # noqa: E402
from sim.run import RunResult  # noqa: E402
from sim.trace import Trace  # noqa: E402
from sim.traffic import SCENARIOS, generate, generate_with_latent  # noqa: E402

LIBRARY = Path(__file__).resolve().parent.parent / "policies" / "library"
#: Before/after measurements at named commits: hand-written, linked from every generated header.
HISTORY = Path(__file__).resolve().parent.parent / "docs" / "decision-quality-history.md"
POLICIES = (
    "default",
    "vllm-schedule",
    "trtllm-gate",
    "ngram-fallback",
    "epsilon-greedy",
    "ucb1",
    "sw-ucb",
    "ucbspec",
    "exp3spec",
    "thompson-plain",
    "thompson",
    "hedge",
)
ENGINE_NAMES = ("stock-vllm", "composite")
CLOSED = ("chat", "code", "maths", "drift", "mixed")
ADAPTIVE_SCENARIOS = ("drift", "mixed", "load-ramp")
LEVELS = (1, 8, 32)


def engine_arms(engine: str, max_k: int) -> list[Arm]:
    """The static arms an engine model can play (what "best single static arm" ranges over)."""
    return [a for a in ENGINES[engine].arms(max_k)]


def policy(name: str) -> PolicySpec:
    p = LIBRARY / f"{name}.yaml"
    return parse_policy(p.read_text(encoding="utf-8"), source=str(p))


def ramp_trace(n: int, seed: int) -> Trace:
    """An even mix whose arrival rate rises from 2 to 60 requests/s and falls back (load 1 -> 32 -> 1)."""
    tr = generate("mixed", n_requests=n, seed=seed)
    x = np.linspace(0.0, 1.0, n)
    rate = 2.0 + 58.0 * (1.0 - np.abs(2.0 * x - 1.0))
    arrival = np.cumsum(np.random.default_rng(seed + 1).exponential(1.0 / rate))
    return dataclasses.replace(tr, arrival_s=arrival - arrival[0], name="load-ramp")


def requests_at(requests: int, c: int) -> int:
    """Requests for a closed-loop run at concurrency ``c``.

    At least 30 per slot: a run at c = 32 with the c = 1 count would last a few seconds of engine time,
    all of it a learner's warm-up; this keeps the number of decision rounds similar across levels.
    """
    return max(requests, 30 * c)


def trace_for(scenario: str, n: int, seed: int) -> Trace:
    return ramp_trace(2 * n, seed) if scenario == "load-ramp" else generate(scenario, n_requests=n, seed=seed)


def p99_tpot_ms(r: RunResult) -> float:
    t = r.latency()["tpot"]
    return float(np.percentile(t, 99) * 1e3) if len(t) else float("nan")


def _job(args: tuple[str, int, int, int, str, str, bool]) -> dict[str, Any]:
    scenario, c, n, seed, pname, engine, signal = args
    tr = trace_for(scenario, n, seed)
    prof = load_profile(DEFAULT_PROFILE)
    open_loop = scenario == "load-ramp"
    t0 = time.perf_counter()
    if pname.startswith("static:"):
        arm = Arm.parse(pname.removeprefix("static:"))
        spec, eng = static_policy(arm), engine_for_arm(arm)
    elif pname.startswith("rule:"):
        # One fixed arm between copy spans plus the default's per-request rule inside them.
        spec = dataclasses.replace(static_policy(pname.removeprefix("rule:")), rule=policy("default").rule)
        eng = ENGINES[engine]
    else:
        spec, eng = policy(pname), ENGINES[engine]
    r = Replayer(
        trace=tr,
        profile=prof,
        engine=eng,
        policy=spec,
        concurrency=c,
        open_loop=open_loop,
        seed=seed,
        ngram_signal=signal,
    ).run()
    return {
        "scenario": scenario,
        "c": c,
        "policy": pname,
        "engine": engine,
        "thr": r.throughput,
        "p99": p99_tpot_ms(r),
        "sw1k": 1000.0 * r.switches / r.steps if r.steps else 0.0,
        "wall": time.perf_counter() - t0,
    }


def _oracle_job(args: tuple[str, int, int, int]) -> dict[str, Any]:
    scenario, c, n, seed = args
    tr, latent = generate_with_latent(scenario, n_requests=n, seed=seed)
    prof = load_profile(DEFAULT_PROFILE)
    o = compute_oracles(tr, prof, c, per_step=False)
    # The composite drafter hosts EAGLE-3 and n-gram (P-EAGLE needs other draft weights) and runs the
    # EAGLE-3 head every step: its oracles have its drafters and its step prices.
    comp = ENGINES["composite"]
    methods = tuple(m for m in comp.methods if m in tr.acc)
    odds = {
        k: latent_oracle(tr, latent, prof, c, methods=methods, engine=comp, eagle_k=k).throughput
        for k in range(1, tr.max_k + 1)
    }
    best_k = max(odds, key=lambda k: odds[k])
    return {
        "scenario": scenario,
        "c": c,
        "static": {k: (v.throughput, p99_tpot_ms(v)) for k, v in o.static.items()},
        "per_phase": o.per_phase.throughput if o.per_phase else float("nan"),
        "per_step": per_step_oracle(tr, prof, c, methods=methods, engine=comp).throughput,
        "per_step_all": per_step_oracle(tr, prof, c).throughput,
        "latent": odds[best_k],
        "latent_k": best_k,
        "per_phase_arms": o.per_phase_arms,
    }


def _any_job(item: tuple[str, tuple[Any, ...]]) -> dict[str, Any]:
    kind, args = item
    return _oracle_job(args) if kind == "oracle" else _job(args)  # type: ignore[arg-type]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--requests", type=cli_types.requests, default=120, help="requests per closed-loop scenario"
    )
    ap.add_argument("--seed", type=cli_types.seed, default=0)
    ap.add_argument("--jobs", type=cli_types.jobs, default=min(os.cpu_count() or 1, 1024))
    ap.add_argument("--scenarios", default=",".join((*CLOSED, "load-ramp")))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", help="also write the tables as markdown here")
    ap.add_argument(
        "--no-hindsight",
        action="store_true",
        help="skip the best-fixed-K + rule hindsight runs (8 extra replays per scenario and level)",
    )
    ap.add_argument(
        "--ngram-signal",
        choices=("on", "off"),
        default="on",
        help="show policies the n-gram proposer's match (default on)",
    )
    ap.add_argument("--executor", default="local", choices=["local", "ray"], help="where the jobs run")
    ap.add_argument("--address", help="with --executor ray: an existing cluster (auto, ray://HOST:10001)")
    return ap


def generated_by(a: argparse.Namespace) -> str:
    """The command that writes these tables again, every option that changes them named."""
    return (
        "python benchmarks/decision_quality.py "
        + f"--requests {a.requests} --seed {a.seed} --jobs {a.jobs} --ngram-signal {a.ngram_signal}"
        + (f" --scenarios {a.scenarios}" if a.scenarios != ",".join((*CLOSED, "load-ramp")) else "")
        + (f" --policies {a.policies}" if a.policies != ",".join(POLICIES) else "")
        + (" --no-hindsight" if a.no_hindsight else "")
    )


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    # Checked before the run (10-25 minutes): a bad name failed in a worker, a bad --out after the run.
    scenarios = [s for s in a.scenarios.split(",") if s]
    pols = [p for p in a.policies.split(",") if p]
    known_scenarios = (*SCENARIOS, "load-ramp")
    known_policies = sorted(f.stem for f in LIBRARY.glob("*.yaml"))
    bad = [s for s in scenarios if s not in known_scenarios]
    if bad or not scenarios:
        ap.error(
            f"--scenarios: unknown {', '.join(map(repr, bad)) or 'none given'} (known: {', '.join(known_scenarios)})"
        )
    bad = [p for p in pols if p not in known_policies]
    if bad or not pols:
        ap.error(
            f"--policies: unknown {', '.join(map(repr, bad)) or 'none given'} (known: {', '.join(known_policies)})"
        )
    problem = output_problem("--out", a.out)
    if problem:
        ap.error(problem)
    try:
        executor = make_executor(a.executor, jobs=a.jobs, address=a.address)
    except ExecutorError as e:
        print(e, file=sys.stderr)
        return 2
    max_k = 8
    signal = a.ngram_signal == "on"
    jobs: list[tuple[str, int, int, int, str, str, bool]] = []
    ojobs: list[tuple[str, int, int, int]] = []
    for s in scenarios:
        for c in LEVELS:
            if s == "load-ramp":
                if c != 32:
                    continue
                for arm in engine_arms("composite", max_k):
                    jobs.append((s, c, requests_at(a.requests, c), a.seed, f"static:{arm}", "stock", signal))
            else:
                ojobs.append((s, c, requests_at(a.requests, c), a.seed))
            for p in pols:
                for e in ENGINE_NAMES:
                    jobs.append((s, c, requests_at(a.requests, c), a.seed, p, e, signal))
            if "default" in pols and not a.no_hindsight:
                for k in range(1, max_k + 1):
                    jobs.append(
                        (s, c, requests_at(a.requests, c), a.seed, f"rule:eagle3:{k}", "composite", signal)
                    )
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    oracles: dict[tuple[str, int], dict[str, Any]] = {}
    total = len(jobs) + len(ojobs)
    done = 0

    def progress(_: int, r: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        print(f"[{done}/{total}] {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    items: list[tuple[str, tuple[Any, ...]]] = [("oracle", j) for j in ojobs] + [("run", j) for j in jobs]
    try:
        out = executor.map(_any_job, items, progress)
    except ExecutorError as e:
        print(e, file=sys.stderr)
        return 1
    for r in out:
        if "static" in r:
            oracles[(r["scenario"], r["c"])] = r
        else:
            results.append(r)
    lines = render(scenarios, pols, results, oracles, max_k, a)
    text = "\n".join(lines)
    print(text)
    if a.out:
        try:
            replace_file(a.out, (text + "\n").encode("utf-8"))
        except OSError as e:
            print(f"decision_quality: {a.out}: {error_text(e)}", file=sys.stderr)
            return 1
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


def _history_link(out: str | None) -> str:
    """The history doc's path relative to the written file (to the repository root on stdout)."""
    base = Path(out).resolve().parent if out else HISTORY.parents[1]
    return os.path.relpath(HISTORY, base)


def _fmt(x: float, d: int = 3) -> str:
    return "n/a" if x != x else f"{x:.{d}f}"


def render(
    scenarios: list[str],
    pols: list[str],
    results: list[dict[str, Any]],
    oracles: dict[tuple[str, int], dict[str, Any]],
    max_k: int,
    a: argparse.Namespace,
) -> list[str]:
    out = [
        "| scenario | c | policy @ engine | tok/s | × best static (arm) | × per-phase | × per-step | "
        "× per-step, all drafters | × no spec | p99 TPOT ms | switches /1k steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    goals: list[str] = []
    for s in scenarios:
        for c in LEVELS:
            rows = [r for r in results if r["scenario"] == s and r["c"] == c]
            if not rows:
                continue
            if s == "load-ramp":
                static = {
                    r["policy"].removeprefix("static:"): (r["thr"], r["p99"])
                    for r in rows
                    if r["policy"].startswith("static:")
                }
                phase = step = step_all = float("nan")
            else:
                o = oracles[(s, c)]
                static, phase, step = o["static"], o["per_phase"], o["per_step"]
                step_all = o["per_step_all"]
            no_spec = static["off"][0]
            best: dict[str, tuple[str, float]] = {}
            for e in ENGINE_NAMES:
                ok = {str(x) for x in engine_arms(e, max_k)}
                lbl = max((k for k in static if k in ok), key=lambda k: static[k][0])
                best[e] = (lbl, static[lbl][0])
            pe = static.get(f"p_eagle:{max_k}")
            for e in ENGINE_NAMES:
                lbl, thr = best[e]
                out.append(
                    f"| {s} | {c} | best static @ {e}: {lbl} | {thr:.0f} | 1.000 | {_fmt(thr / phase)} | "
                    f"{_fmt(thr / step)} | {_fmt(thr / step_all)} | {thr / no_spec:.3f} | {static[lbl][1]:.2f} | 0 |"
                )
            if pe is not None:
                out.append(
                    f"| {s} | {c} | (p_eagle:{max_k}, other weights) | {pe[0]:.0f} | – | {_fmt(pe[0] / phase)} | "
                    f"{_fmt(pe[0] / step)} | {_fmt(pe[0] / step_all)} | {pe[0] / no_spec:.3f} | {pe[1]:.2f} | 0 |"
                )
            latent = float("nan") if s == "load-ramp" else oracles[(s, c)]["latent"]
            if latent == latent:
                lk = oracles[(s, c)]["latent_k"]
                out.append(
                    f"| {s} | {c} | (latent odds, eagle3:{lk} + n-gram per step) @ composite | {latent:.0f} | "
                    f"{latent / best['composite'][1]:.3f} | {_fmt(latent / phase)} | {_fmt(latent / step)} | "
                    f"{_fmt(latent / step_all)} | {latent / no_spec:.3f} | – | – |"
                )
            ruled = [x for x in rows if x["policy"].startswith("rule:")]
            hindsight = max(ruled, key=lambda x: x["thr"]) if ruled else None
            if hindsight is not None:
                h = hindsight["thr"]
                out.append(
                    f"| {s} | {c} | (hindsight: {hindsight['policy'].removeprefix('rule:')} + the default's rule) "
                    f"@ composite | {h:.0f} | {h / best['composite'][1]:.3f} | {_fmt(h / phase)} | "
                    f"{_fmt(h / step)} | {_fmt(h / step_all)} | {h / no_spec:.3f} | {hindsight['p99']:.2f} | {hindsight['sw1k']:.2f} |"
                )
            for p in pols:
                for e in ENGINE_NAMES:
                    r = next((x for x in rows if x["policy"] == p and x["engine"] == e), None)
                    if r is None:
                        continue
                    ratio = r["thr"] / best[e][1]
                    out.append(
                        f"| {s} | {c} | {p} @ {e} | {r['thr']:.0f} | {ratio:.3f} | {_fmt(r['thr'] / phase)} | "
                        f"{_fmt(r['thr'] / step)} | {_fmt(r['thr'] / step_all)} | {r['thr'] / no_spec:.3f} | {r['p99']:.2f} | {r['sw1k']:.2f} |"
                    )
            d = next((x for x in rows if x["policy"] == "default" and x["engine"] == "composite"), None)
            if d is not None:
                others = {
                    x["policy"]: x["thr"]
                    for x in rows
                    if x["engine"] == "composite"
                    and x["policy"]
                    in ("ucbspec", "exp3spec", "vllm-schedule", "trtllm-gate", "ngram-fallback")
                }
                r_best = d["thr"] / best["composite"][1]
                target = 1.30 if s in ADAPTIVE_SCENARIOS else 1.00
                checks = [
                    f"×best static {r_best:.3f} ({'met' if r_best >= target else 'not met'}, goal {target:.2f})",
                    f"×no spec {d['thr'] / no_spec:.3f} ({'met' if d['thr'] >= 0.98 * no_spec else 'not met'}, goal ≥ 0.98)",
                ]
                if s in ADAPTIVE_SCENARIOS and phase == phase:
                    checks.append(
                        f"×per-phase {d['thr'] / phase:.3f} ({'met' if d['thr'] >= phase else 'not met'}, goal 1.00)"
                    )
                    checks.append(
                        f"×per-step {d['thr'] / step:.3f} ({'met' if d['thr'] >= 0.88 * step else 'not met'}, goal 0.88)"
                    )
                if hindsight is not None:
                    checks.append(f"×(best fixed arm + rule, hindsight) {d['thr'] / hindsight['thr']:.3f}")
                if latent == latent:
                    checks.append(
                        f"×latent-odds oracle {d['thr'] / latent:.3f} (which is {latent / best['composite'][1]:.3f}"
                        " × best static)"
                    )
                checks.append(f"switches {d['sw1k']:.2f} per 1,000 steps")
                behind = [k for k, v in others.items() if v >= d["thr"]]
                checks.append(
                    "ahead of baselines: " + ("yes" if not behind else "no (" + ", ".join(behind) + ")")
                )
                goals.append(f"| {s} | {c} | " + "; ".join(checks) + " |")
    head = [
        "# Decision quality",
        "",
        f"Generated by `{generated_by(a)}` "
        + f"(profile {DEFAULT_PROFILE}). A closed-loop "
        + f"run at concurrency c replays max({a.requests}, 30·c) requests (so c = 32 is not all warm-up); the "
        + f"load ramp replays {2 * requests_at(a.requests, 32)}. Ratios are throughput ratios.",
        "",
        "* `best static` ranges over the arms the engine model can play (stock vLLM: eagle3:1..8, off; "
        "composite drafter: eagle3:1..8, ngram:1..8, off). P-EAGLE needs other draft weights: shown apart.",
        "* `per phase`: one arm per quarter of the trace, chosen in hindsight, on the composite drafter.",
        "* `per step`: clairvoyant. Knowing how many tokens every draft would get accepted, each request picks "
        "the method and K of every step by dynamic programming, with the composite drafter's methods "
        "(EAGLE-3, n-gram); `all drafters` adds P-EAGLE. No causal policy can know a draft's accepted "
        "length before verifying it, so these are bounds, not targets a policy can reach exactly.",
        "* `latent odds`: a plan that knows the generator's odds but not its draws: where every copy span "
        "runs (so n-gram's count inside one) and each token's chance of being accepted by EAGLE-3. It picks "
        "n-gram, EAGLE-3 or off at every step to minimise the expected time to finish, with one EAGLE-3 K "
        "for the run (the best K in hindsight; K free per row misprices a batch's shared draft passes). "
        "A causal policy sees a span start only through the n-gram proposer's match (with the signal; "
        "without it, from its first scored step) and never where it ends, so this is an upper estimate "
        "of what the per-request rule could reach on these traces, not a bound.",
        "* `signal`: whether the replay hands policies the n-gram proposer's match (`ngram_proposal`, "
        "what the engine knows before drafting) on engines that draft n-gram per request.",
        "* `hindsight: eagle3:K + the default's rule`: the best single EAGLE-3 K, chosen knowing the "
        "results, plus the default's per-request n-gram rule: what the default's slow loop would reach "
        "if it guessed K perfectly from the first step.",
        "* Oracles exist for closed-loop scenarios only (the load ramp is open loop).",
        "* `switches /1k steps`: the slow loop's arm changes (any context, after its first assignment) per "
        "1,000 engine steps; static arms and oracles do not switch.",
        "",
        "Before/after measurements at named commits (the n-gram proposer's match, value hysteresis), which "
        f"this command does not rerun: [decision-quality-history.md]({_history_link(a.out)}).",
        "",
        "The composite drafter here is the `composite` engine model: vLLM's async path as the plugin "
        "runs it, each request's draft within its placeholders (the K table, or max K where the rule "
        "drafts n-gram) and EAGLE-3 proposing for every row at the longest K a row drafting it has "
        '(docs/simulator.md, "Engine models"; until 2026-12-05 the model had neither limit).',
        "",
        "## Goals for the default policy on the composite drafter",
        "",
        "| scenario | c | result |",
        "|---|---|---|",
        *goals,
        "",
        "## All runs",
        "",
    ]
    return head + out


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
