"""Replay speed: request-steps per second for a 32-concurrency replay of >= 200k output tokens.

    python benchmarks/sim_speed.py [--tokens 200000] [--concurrency 32] [--repeat 3] [--json FILE]

Prints figures; asserts nothing (timing targets live here, not in tests). Single-threaded: the
thread pools of numerical libraries are pinned to one thread before numpy is imported. A mistaken
flag or an unwritable ``--json`` exits 2 before the run.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

from policies.arms import Method  # noqa: E402
from policies.spec import parse_policy, static_policy  # noqa: E402
from policies.text import error_text  # noqa: E402
from sim import cli_types  # noqa: E402
from sim.costmodel import load_profile  # noqa: E402
from sim.engines import ENGINES  # noqa: E402
from sim.files import output_problem, replace_file  # noqa: E402
from sim.replay import Replayer  # noqa: E402
from sim.run import RunResult  # noqa: E402
from sim.trace import Trace  # noqa: E402
from sim.traffic import generate  # noqa: E402

LIB = Path(__file__).resolve().parents[1] / "policies" / "library"


def _trace(tokens: int, seed: int) -> Trace:
    n = 200
    while True:
        t = generate("mixed", n_requests=n, seed=seed)
        if t.total_output_tokens >= tokens:
            return t
        n = int(n * tokens / t.total_output_tokens * 1.05) + 1


def _best(fn: Callable[[], RunResult], repeat: int) -> tuple[float, RunResult]:
    best = float("inf")
    r: RunResult | None = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = fn()
        best = min(best, time.perf_counter() - t0)
    assert r is not None
    return best, r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Range-checked: --repeat 0 and --concurrency 0 ended in tracebacks inside the run.
    ap.add_argument("--tokens", type=cli_types.int_in(1, 100_000_000), default=200_000)
    ap.add_argument("--concurrency", type=cli_types.int_in(1, 4096), default=32)
    ap.add_argument("--repeat", type=cli_types.int_in(1, 100), default=3)
    ap.add_argument("--seed", type=cli_types.seed, default=0)
    ap.add_argument(
        "--json", metavar="FILE", help="also write the figures here (make results: docs/results/)"
    )
    args = ap.parse_args(argv)
    problem = output_problem("--json", args.json)  # now, not after the run
    if problem:
        ap.error(problem)
    load_before = os.getloadavg()[0]
    prof = load_profile("llama-3.1-8b-h100")
    t0 = time.perf_counter()
    trace = _trace(args.tokens, args.seed)
    gen_s = time.perf_counter() - t0
    c = args.concurrency
    default = parse_policy((LIB / "default.yaml").read_text(), source="default")
    print(
        f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, "
        f"load average {os.getloadavg()[0]:.2f}; python {platform.python_version()}"
    )
    print(
        f"trace: mixed, {trace.n} requests, {trace.total_output_tokens:,} output tokens "
        f"(generated in {gen_s:.2f}s); concurrency {c}; best of {args.repeat}"
    )
    from sim.vectorised import replay_static

    runs: list[tuple[str, Callable[[], RunResult], int]] = [
        (
            "static eagle3:3, vectorised",
            lambda: replay_static(
                trace, method=Method.EAGLE3, k=3, concurrency=c, profile=prof, engine=ENGINES["stock-vllm"]
            ),
            args.repeat,
        ),
        (
            "static off, vectorised",
            lambda: replay_static(
                trace, method=Method.OFF, k=0, concurrency=c, profile=prof, engine=ENGINES["no-spec"]
            ),
            args.repeat,
        ),
        (
            "static eagle3:3, stepwise ControlLoop",
            lambda: Replayer(
                trace=trace,
                profile=prof,
                engine=ENGINES["stock-vllm"],
                policy=static_policy("eagle3:3"),
                concurrency=c,
            ).run(),
            1,
        ),
        (
            "default policy @ stock-vllm, stepwise",
            lambda: Replayer(
                trace=trace, profile=prof, engine=ENGINES["stock-vllm"], policy=default, concurrency=c
            ).run(),
            1,
        ),
        (
            "default policy @ composite, stepwise",
            lambda: Replayer(
                trace=trace, profile=prof, engine=ENGINES["composite"], policy=default, concurrency=c
            ).run(),
            1,
        ),
    ]
    rows: list[dict[str, object]] = []
    print(f"{'run':42} {'request-steps':>13} {'seconds':>8} {'req-steps/s':>12} {'us/step':>8}")
    for label, fn, rep in runs:
        secs, r = _best(fn, rep)
        rate = r.request_steps / secs
        per_step = secs / r.steps * 1e6
        rows.append(
            {"run": label, "request_steps": r.request_steps, "steps": r.steps, "seconds": round(secs, 4),
             "request_steps_per_s": round(rate), "us_per_step": round(per_step, 1)}
        )  # fmt: skip
        print(f"{label:42} {r.request_steps:13,} {secs:8.3f} {rate:12,.0f} {per_step:8.1f}")
    print("target: >= 1,000,000 request-steps/s for the vectorised static arm on one core")
    if args.json:
        doc = {
            "command": "python benchmarks/sim_speed.py",
            "tokens": trace.total_output_tokens,
            "concurrency": c,
            "repeat": args.repeat,
            "cores": os.cpu_count(),
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "runs": rows,
        }
        try:
            replace_file(args.json, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
        except OSError as e:
            print(f"sim_speed: {args.json}: {error_text(e)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
