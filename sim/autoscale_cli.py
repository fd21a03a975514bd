"""``controllerctl sim autoscale``: the "load triples" scenario, warm vs cold replicas.

Its outputs (``--json``, and ``--out``'s directory of autoscale.md, .json and .png) are checked before
the run, one against the other and against the policy and profile files it reads too, and written
all or nothing: a write that fails removes what this run had written (and the directory it made), so
no half report is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from policies.text import error_text, one_line
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
from sim.costmodel import MAX_REPLAY_BATCH, ProfileError, profile_names
from sim.engines import ENGINES
from sim.files import output_problem, replace_file
from sim.progress import ProgressBar

DAY_S = 86_400.0
#: ``--requests`` per slot at least: the steady rate is taken over the middle half of a closed-loop
#: replay, and with fewer every slot is not busy through it (llama-3.1-8b-h100, concurrency 32: 6,392
#: tok/s steady at 1,200 requests, 6,318 at 240, 5,057 at 128, 4,014 at 64).
MIN_REQUESTS_PER_SLOT = 8
WEEK_S = 7 * DAY_S
#: The files ``--out`` writes in its directory.
OUT_FILES = ("autoscale.md", "autoscale.json", "autoscale.png")


def add_parser(ss: Any, resolve_policy: Any, load_profile: Any) -> None:
    p = ss.add_parser("autoscale", help="HPA on queue wait under 'load triples', warm vs cold replicas")
    p.add_argument("--policy", default="default", help="policy file or preset (default: default)")
    p.add_argument(
        "--profile", default="llama-3.1-8b-h100", help=f"cost model ({', '.join(profile_names())})"
    )
    p.add_argument("--engine", default="composite", help=f"engine model ({', '.join(ENGINES)})")
    p.add_argument(
        "--concurrency", type=int_in(1, MAX_REPLAY_BATCH), default=32, help="slots per replica (max_num_seqs)"
    )
    p.add_argument(
        "--requests",
        type=int_in(1, 1_000_000),
        default=1200,
        help="requests in each replay that measures the replica (fewer: faster, noisier; at least "
        f"{MIN_REQUESTS_PER_SLOT} per slot of --concurrency)",
    )
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
    p.set_defaults(func=lambda a: run(a, resolve_policy, load_profile))


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None


def _secs(curve: LearningCurve) -> str:
    t = curve.time_to(0.95)
    return f"{t:.0f} s" if np.isfinite(t) else f"not within the {float(curve.t_s[-1]):.0f} s measured"


def _clash(json_path: str | None, out: str | None) -> str | None:
    """``--json`` naming ``--out``'s directory, a file it writes, or a directory above it: one output
    overwrote the other, or the second failed after the run (``File exists``) with the first written."""
    if not json_path or not out:
        return None
    j, o = Path(json_path).resolve(), Path(out).resolve()
    if j == o or j in o.parents:
        return f"--json {json_path}: --out {out} is there (give them different paths)"
    if j.parent == o and j.name in OUT_FILES:
        return f"--json {json_path}: --out {out} writes that file too (give another path)"
    return None


def _overwrites_input(args: argparse.Namespace) -> str | None:
    """An output naming the ``--policy`` or ``--profile`` file read: replaced by the figures after
    the run, the file lost."""
    outs = [("--json", Path(args.json))] if args.json else []
    outs += [("--out", Path(args.out) / name) for name in OUT_FILES] if args.out else []
    for flag, src in (("--policy", args.policy), ("--profile", args.profile)):
        if not src or not os.path.isfile(src):
            continue  # a preset or a shipped profile's name
        for what, out in outs:
            same = os.path.samefile(out, src) if out.exists() else out.resolve() == Path(src).resolve()
            if same:
                return f"{what} {out}: is the {flag} file it reads; name another output"
    return None


def _write_all(files: list[tuple[Path, bytes]], out: Path | None) -> None:
    """Write each ``(path, bytes)``, making ``out`` (and its missing parents) first; on a failure remove
    the files written and the directories made, then raise the OSError."""
    made: list[Path] = []
    if out is not None:
        for d in (out.absolute(), *out.absolute().parents):
            if d.exists():
                break
            made.append(d)  # deepest first: the order to remove them in
        out.mkdir(parents=True, exist_ok=True)
    done: list[Path] = []
    try:
        for path, data in files:
            replace_file(path, data)
            done.append(path)
    except BaseException:  # Ctrl-C too: no half report
        for path in done:
            with contextlib.suppress(OSError):
                path.unlink()
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def _png(runs: dict[str, Any]) -> bytes:
    """The plot as bytes, drawn before anything is written (a plot that fails leaves no report)."""
    from sim.files import temporary_directory

    with temporary_directory(prefix="speccontrol-autoscale-") as tmp:
        path = Path(tmp) / "autoscale.png"
        plot(list(runs.items()), str(path))
        return path.read_bytes()


def run(args: argparse.Namespace, resolve_policy: Any, load_profile: Any) -> int:
    if args.engine not in ENGINES:
        print(
            f"--engine: unknown engine model {args.engine!r} (known: {', '.join(ENGINES)})", file=sys.stderr
        )
        return 2
    if args.requests < MIN_REQUESTS_PER_SLOT * args.concurrency:
        print(
            f"--requests {args.requests}: at least {MIN_REQUESTS_PER_SLOT} per slot, "
            f"{MIN_REQUESTS_PER_SLOT * args.concurrency} at --concurrency {args.concurrency} (fewer leave "
            "slots idle in the part of the replay the replica's steady rate is measured on)",
            file=sys.stderr,
        )
        return 2
    if args.triple_at >= args.duration:
        print(
            f"--triple-at {args.triple_at:g}: must be before the run ends (--duration {args.duration:g})",
            file=sys.stderr,
        )
        return 2
    # The fleet is sampled each whole second from 0: a load step after the last sample left no sample
    # to summarise (--duration 1.5 --triple-at 1.2 raised from numpy after the replays).
    last = float(np.arange(0.0, args.duration, 1.0)[-1])
    if args.triple_at > last:
        print(
            f"--triple-at {args.triple_at:g}: after the last second the run samples ({last:g} s of "
            f"--duration {args.duration:g}): nothing to measure after the load step",
            file=sys.stderr,
        )
        return 2
    problem = (
        output_problem("--json", args.json)
        or output_problem("--out", args.out, directory=True)
        or _clash(args.json, args.out)
        or _overwrites_input(args)
    )
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
    except (ValueError, OSError) as e:  # ProfileError and PolicyError name their flag
        msg = str(e) if isinstance(e, ProfileError) or str(e).startswith("--") else f"--policy {e}"
        print(one_line(msg), file=sys.stderr)
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
    if sys.stderr.isatty():  # progress for a person; a log file gets only errors
        print("measuring one replica: cold and warm replays of the policy ...", file=sys.stderr)
    replica = measure_replica(
        policy=policy,
        profile=profile,
        engine=ENGINES[args.engine],
        concurrency=args.concurrency,
        requests=args.requests,
    )
    rps = replica.steady_tok_s / replica.mean_output_tokens
    t = np.arange(0.0, args.duration, 1.0)
    arrivals = load_triples(t, base_rps=args.utilisation * 2 * rps, at_s=args.triple_at)
    # A bar on a terminal: a week of simulated seconds runs for a minute or more.
    bar = ProgressBar(total=2 * len(t), label="fleet: cold and warm starts")
    try:
        runs = {
            label: simulate_fleet(
                replica=replica, arrival_rps=arrivals, hpa=hpa, warm_start=warm, progress=bar.advance
            )
            for label, warm in (("cold", False), ("warm", True))
        }
    finally:
        bar.close()
    result: dict[str, Any] = {
        "policy": policy.name,
        "profile": args.profile,
        "engine": args.engine,
        "replica": {
            "measured_with_requests": args.requests,
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
    data = (json.dumps(result, indent=2) + "\n").encode("utf-8")
    files: list[tuple[Path, bytes]] = []
    if args.out:
        out = Path(args.out)
        argv = sys.argv[sys.argv.index("autoscale") + 1 :] if "autoscale" in sys.argv[1:] else []
        cmd = " ".join(["controllerctl sim autoscale", *(shlex.quote(a) for a in argv)])
        md = (
            "# Autoscaling: load triples\n\n"
            + f"Generated by `{cmd}`.\n\n"
            + "HPA ratio rule on `speccontrol_queue_wait_seconds` and slot utilisation (the larger wins; fluid queue model; see sim/autoscale.py), "
            f"policy `{policy.name}` on `{args.engine}` / `{args.profile}`, load triples at {args.triple_at:.0f} s, "
            f"pod start-up {hpa.startup_s:.0f} s.\n\n"
            + "\n".join(f"- {x}" for x in lines[:3])
            + "\n\n"
            + "\n".join(lines[4:])
            + "\n\n![autoscale](autoscale.png)\n"
        )
        files += [
            (out / "autoscale.png", _png(runs)),
            (out / "autoscale.json", data),
            (out / "autoscale.md", md.encode("utf-8")),
        ]
    if args.json:
        files.append((Path(args.json), data))
    try:
        _write_all(files, Path(args.out) if args.out else None)
    except OSError as e:
        where = e.filename or args.out or args.json
        print(one_line(f"{where}: {error_text(e)}; nothing left written"), file=sys.stderr)
        return 1
    return 0
