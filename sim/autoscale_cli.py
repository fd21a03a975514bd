"""``controllerctl sim autoscale``: the "load triples" scenario, warm vs cold replicas."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from policies.text import one_line
from sim.autoscale import (
    HpaSettings,
    LearningCurve,
    load_triples,
    measure_replica,
    plot,
    simulate_fleet,
    summarise,
)
from sim.cli_types import float_in, int_in
from sim.costmodel import load_profile, profile_names
from sim.engines import ENGINES
from sim.files import output_problem

DAY_S = 86_400.0
WEEK_S = 7 * DAY_S


def add_parser(ss: Any, resolve_policy: Any) -> None:
    p = ss.add_parser("autoscale", help="HPA on queue wait under 'load triples', warm vs cold replicas")
    p.add_argument("--policy", default="default", help="policy file or preset (default: default)")
    p.add_argument(
        "--profile", default="llama-3.1-8b-h100", help=f"cost model ({', '.join(profile_names())})"
    )
    p.add_argument("--engine", default="composite", help=f"engine model ({', '.join(ENGINES)})")
    p.add_argument("--concurrency", type=int_in(1, 4096), default=32, help="slots per replica (max_num_seqs)")
    p.add_argument("--duration", type=float_in(1, WEEK_S), default=1800.0, help="simulated seconds")
    p.add_argument("--triple-at", type=float_in(0, WEEK_S), default=300.0, help="when the load triples (s)")
    p.add_argument(
        "--utilisation",
        type=float_in(0, 100, lo_open=True),
        default=0.6,
        help="initial load per initial replica",
    )
    p.add_argument("--startup", type=float_in(0, DAY_S), default=120.0, help="pod start-up delay (s)")
    p.add_argument(
        "--target-wait", type=float_in(0, DAY_S, lo_open=True), default=0.5, help="HPA target queue wait (s)"
    )
    p.add_argument(
        "--scale-down-window", type=float_in(0, DAY_S), default=600.0, help="scale-down stabilisation (s)"
    )
    p.add_argument(
        "--target-utilisation",
        type=float_in(0, 1),
        default=0.8,
        help="second HPA metric, busy slots share (0: queue wait only)",
    )
    p.add_argument(
        "--max-replicas", type=int_in(2, 10_000), default=16, help="at least the 2 replicas it starts with"
    )
    p.add_argument("--out", help="directory for autoscale.md, autoscale.json and autoscale.png")
    p.add_argument("--json", help="write the figures as JSON to this file")
    p.set_defaults(func=lambda a: run(a, resolve_policy))


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None


def _secs(curve: LearningCurve) -> str:
    t = curve.time_to(0.95)
    return f"{t:.0f} s" if np.isfinite(t) else f"not within the {float(curve.t_s[-1]):.0f} s measured"


def run(args: argparse.Namespace, resolve_policy: Any) -> int:
    if args.engine not in ENGINES:
        print(
            f"--engine: unknown engine model {args.engine!r} (known: {', '.join(ENGINES)})", file=sys.stderr
        )
        return 2
    if args.triple_at >= args.duration:
        print(
            f"--triple-at {args.triple_at:g}: must be before the run ends (--duration {args.duration:g})",
            file=sys.stderr,
        )
        return 2
    problem = output_problem("--json", args.json) or output_problem("--out", args.out, directory=True)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        hpa = HpaSettings(
            target_queue_wait_s=args.target_wait,
            startup_s=args.startup,
            scale_down_window_s=args.scale_down_window,
            target_utilisation=args.target_utilisation or None,
            min_replicas=2,
            max_replicas=args.max_replicas,
        )
        policy = resolve_policy(args.policy)
        profile = load_profile(args.profile)
    except (ValueError, OSError) as e:
        print(one_line(str(e)), file=sys.stderr)
        return 2
    if args.out:
        try:
            import matplotlib  # noqa: F401  (checked before the run, not after it)
        except ImportError:
            print(
                "--out: the plot needs matplotlib (pip install 'speccontrol[sim]'), or use --json",
                file=sys.stderr,
            )
            return 2
    print("measuring one replica: cold and warm replays of the policy ...", file=sys.stderr)
    replica = measure_replica(
        policy=policy, profile=profile, engine=ENGINES[args.engine], concurrency=args.concurrency
    )
    rps = replica.steady_tok_s / replica.mean_output_tokens
    t = np.arange(0.0, args.duration, 1.0)
    arrivals = load_triples(t, base_rps=args.utilisation * 2 * rps, at_s=args.triple_at)
    runs = {
        label: simulate_fleet(replica=replica, arrival_rps=arrivals, hpa=hpa, warm_start=warm)
        for label, warm in (("cold", False), ("warm", True))
    }
    result: dict[str, Any] = {
        "policy": policy.name,
        "profile": args.profile,
        "engine": args.engine,
        "replica": {
            "steady_tok_s": round(replica.steady_tok_s, 1),
            "requests_per_s": round(rps, 2),
            # null: not reached within the measured run
            "time_to_95pct_s": {
                "cold": _finite(replica.cold.time_to(0.95)),
                "warm": _finite(replica.warm.time_to(0.95)),
            },
            "first_60s_efficiency": {
                "cold": round(float(np.mean([replica.cold.at(a) for a in range(60)])), 3),
                "warm": round(float(np.mean([replica.warm.at(a) for a in range(60)])), 3),
            },
        },
        "hpa": {
            "target_queue_wait_s": hpa.target_queue_wait_s,
            "startup_s": hpa.startup_s,
            "scale_down_window_s": hpa.scale_down_window_s,
            "target_utilisation": hpa.target_utilisation,
        },
        "after_load_step": {
            k: {m: round(v, 2) for m, v in summarise(s, args.triple_at).items()} for k, s in runs.items()
        },
    }
    r = result["replica"]
    lines = [
        f"replica: {r['steady_tok_s']:.0f} tok/s steady ({r['requests_per_s']:.1f} req/s at concurrency {args.concurrency})",
        f"time to 95% of steady goodput: cold {_secs(replica.cold)}, warm {_secs(replica.warm)}",
        f"mean efficiency over a new replica's first 60 s: cold {r['first_60s_efficiency']['cold']:.2f}, "
        f"warm {r['first_60s_efficiency']['warm']:.2f}",
        "",
        "| start | max replicas | max queue wait (s) | queue wait integral (s·s) | max p99 e2e (s) |",
        "|---|---|---|---|---|",
    ]
    for k, v in result["after_load_step"].items():
        lines.append(
            f"| {k} | {v['max_replicas']:.0f} | {v['max_queue_wait_s']:.1f} | {v['queue_wait_s_integral']:.0f} "
            f"| {v['max_p99_e2e_s']:.1f} |"
        )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot(list(runs.items()), str(out / "autoscale.png"))
        (out / "autoscale.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        cmd = "controllerctl sim autoscale " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else ""
        (out / "autoscale.md").write_text(
            "# Autoscaling: load triples\n\n"
            + (f"Generated by `{cmd.strip()}`.\n\n" if cmd else "")
            + "HPA ratio rule on `speccontrol_queue_wait_seconds` and slot utilisation (the larger wins; fluid queue model; see sim/autoscale.py), "
            f"policy `{policy.name}` on `{args.engine}` / `{args.profile}`, load triples at {args.triple_at:.0f} s, "
            f"pod start-up {hpa.startup_s:.0f} s.\n\n"
            + "\n".join(f"- {x}" for x in lines[:3])
            + "\n\n"
            + "\n".join(lines[4:])
            + "\n\n![autoscale](autoscale.png)\n",
            encoding="utf-8",
        )
    return 0
