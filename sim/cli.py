"""``controllerctl sim ...``, ``profile fit`` and ``trace ...`` (registered into the controller's CLI).

Errors are one line on stderr (``FILE:LINE: field: message`` where there is a file) and no
traceback; exit 2 for usage and input errors (bad flags, an invalid trace, policy or profile), exit 1
for runtime errors (a run that fails, a server that cannot be reached), as in ``controllerctl``.
Nothing is written when the input is bad, and a run that needs matplotlib checks for it first. No
output may name a file the command reads, or another output of the same run: refused before the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.presets import resolve_policy as resolve_named_policy
from policies.prompt_lookup import DEFAULT_MAX_N, DEFAULT_MIN_N, MAX_NGRAM
from policies.spec import PolicyError, PolicySpec, static_policy
from policies.text import error_text, name_problem, one_line
from sim import cli_types
from sim.autoscale_cli import add_parser as add_autoscale_parser
from sim.costmodel import (
    DEFAULT_PROFILE,
    MAX_REPLAY_BATCH,
    PROFILE_SUFFIXES,
    Profile,
    ProfileError,
    load_profile,
    profile_names,
)
from sim.engines import ENGINES, EngineModel
from sim.files import output_problem, replace_file, same_file
from sim.trace import (
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    Trace,
    TraceError,
    read_trace,
    validate_trace,
    write_trace,
)
from sim.traffic import SCENARIOS, generate

if TYPE_CHECKING:
    from sim.compare import Comparison
    from sim.executor import ShippedPolicy
    from sim.prices import Prices
    from sim.progress import ProgressBar
    from sim.steplog import StepLog

EXIT_RUNTIME = 1
EXIT_USAGE = 2
#: Generated scenarios defined by their arrival rate (a closed-loop replay ignores it).
OPEN_LOOP_SCENARIOS = ("load-ramp",)
MAX_GENERATED_REQUESTS = cli_types.MAX_GENERATED_REQUESTS
#: Concurrency levels of one run: each replays the whole trace (1..4096 made hours of replays).
MAX_LEVELS = 64
#: ``sim tune``: output tokens replayed in all (every job replays a whole trace at one level), a few
#: hours of one CPU (about 200k tokens/s); a grid within MAX_GRID_POINTS on large traces ran for days.
MAX_TUNE_TOKENS = 2 * 10**9


class _UsageError(ValueError):
    pass


def _err(msg: str) -> None:
    print(one_line(msg), file=sys.stderr)


def resolve_policy(name_or_path: str) -> PolicySpec:
    """A policy file, a preset of ``policies/library``, or ``static:ARM`` (e.g. ``static:eagle3:3``).

    Its errors name the flag, ``--policy SOURCE[:LINE]: ...``, in every command that takes one: sim
    replay|compare|tune said ``static:eagle3:99: ...`` (the value alone) where sim autoscale said
    ``--policy static:eagle3:99: ...``."""
    if not name_or_path.strip():  # '' is the path '.', reported as ": not a regular file"
        raise PolicyError("not a policy file, preset name or static:ARM", source=f"--policy {name_or_path!r}")
    try:
        if name_or_path.startswith("static:"):
            try:
                return static_policy(name_or_path.removeprefix("static:"))
            except ValueError as e:
                raise PolicyError(str(e), source=name_or_path) from None
        return resolve_named_policy(name_or_path)
    except PolicyError as e:
        raise PolicyError(e.message, source=f"--policy {e.source}", line=e.line, field=e.field) from None


def load_named_profile(name: str, flag: str = "--profile") -> Profile:
    """``--profile NAME`` (or ``flag``): a profile of ``sim/profiles`` or a file; its errors name the flag."""
    if not name.strip():
        raise ProfileError(f"{flag} {name!r}: not a profile name or file")
    try:
        return load_profile(name)
    except ProfileError as e:
        # A profile file's errors read FILE:LINE: field: message; a name that is none reads bare.
        raise ProfileError(f"{flag}: {e}" if str(e).startswith("unknown profile") else str(e)) from None


def _concurrency(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _UsageError(f"--concurrency: expected integers such as 1,8,32, got {text!r}") from None
    if not levels or any(c < 1 or c > MAX_REPLAY_BATCH for c in levels):
        raise _UsageError(f"--concurrency: levels must be 1..{MAX_REPLAY_BATCH}, got {text!r}")
    if len(set(levels)) > MAX_LEVELS:
        raise _UsageError(
            f"--concurrency: {len(set(levels))} levels; at most {MAX_LEVELS} (each replays the trace)"
        )
    return sorted(set(levels))


def _check_output(flag: str, path: str | None, *, directory: bool = False, suffix: str = "") -> None:
    """Before any work: an output that cannot be written there (see ``output_problem``) is a usage
    error now, not a runtime error after the run."""
    problem = output_problem(flag, path, directory=directory, suffix=suffix)
    if problem is not None:
        raise _UsageError(problem)


def _input_files(*named: tuple[str, str | None]) -> list[tuple[str, str]]:
    """The ``(flag, path)`` of each input that is a file (a preset or profile name is none)."""
    return [(flag, path) for flag, path in named if path and os.path.isfile(path)]


def _check_not_input(flag: str, out: str | Path | None, inputs: Sequence[tuple[str, str]]) -> None:
    """Before any work: an output that names one of the files the command reads is refused. It was
    replaced by the result after the run (``--json`` naming the ``--trace``: the recorded trace lost)."""
    if not out:
        return
    for what, path in inputs:
        if same_file(out, path):
            raise _UsageError(f"{flag} {out}: is the {what} file it reads; name another output")


def _check_report_json(json_path: str | None, out: str | None, dirs: Sequence[Path]) -> None:
    """Before the run: ``--json`` must not be ``--out``'s directory, one above it, one of the report
    directories ``dirs`` (``--out`` itself, or one per comparison of a sweep) or a file a report writes
    there. The report was replaced by the JSON without a word (``--json DIR/report.md``), or the JSON
    failed after the run (``--json DIR``)."""
    from sim.report import REPORT_FILES

    if not json_path or not out:
        return
    j, o = Path(json_path).resolve(), Path(out).resolve()
    if j == o or j in o.parents:
        raise _UsageError(f"--json {json_path}: --out {out} is there (give them different paths)")
    for d in (x.resolve() for x in dirs):
        if j == d or (j.parent == d and j.name in REPORT_FILES):
            raise _UsageError(f"--json {json_path}: --out {out} writes there too (give another path)")


def _need_matplotlib(flag: str) -> None:
    """Before a long run whose report needs plots: fail now, not after the run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise _UsageError(
            f"{flag}: the report's plots need matplotlib (pip install 'speccontrol[sim]'), or use --json"
        ) from None


def _scenario(name: str, args: argparse.Namespace) -> Trace:
    if name not in SCENARIOS:
        raise _UsageError(f"--scenario: unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
    return generate(name, n_requests=args.requests, seed=args.seed)


def _scenarios(text: str, args: argparse.Namespace) -> list[Trace]:
    """``--scenario A,B``: each name known, and no more than MAX_GENERATED_REQUESTS in all, before any
    is generated."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in SCENARIOS:
            raise _UsageError(f"--scenario: unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
    total = sum(SCENARIOS[n].n_requests if args.requests is None else args.requests for n in names)
    if total > MAX_GENERATED_REQUESTS:
        raise _UsageError(
            f"--requests: {total} requests over {len(names)} scenarios; at most {MAX_GENERATED_REQUESTS} "
            "in all (each is held in memory)"
        )
    return [_scenario(n, args) for n in names]


def _load_traces(args: argparse.Namespace) -> list[Trace]:
    """``--trace`` (repeatable for compare) or ``--scenario A,B``, in the order given."""
    if args.trace is not None:  # (sim replay's --trace '' is a trace to read, not none)
        paths = args.trace if isinstance(args.trace, list) else [args.trace]
        return [read_trace(t, seed=args.seed) for t in paths]
    return _scenarios(args.scenario, args)


def _check_kv_room(trace: Trace, profiles: Sequence[Profile], given: str) -> None:
    """Before the run: the trace's longest request fits each profile's KV room (``kv_fit_problem``)."""
    from sim.sizing import kv_fit_problem

    names = [n.strip() for n in given.split(",") if n.strip()]
    for i, profile in enumerate(profiles):
        problem = kv_fit_problem(profile, trace)
        if problem is not None:
            raise _UsageError(f"--profile {names[i] if i < len(names) else profile.name}: {problem}")


def _check_methods(
    trace: Trace, names: Sequence[str], policies: Sequence[PolicySpec], engines: Sequence[EngineModel]
) -> None:
    """Before the run: every method the run would draft with has acceptance data in the trace (the
    replay would stop on the first step that needs it)."""
    from sim.compare import static_arm_of
    from sim.kernel import check_engine

    has = ", ".join(m.value for m in trace.acc) or "none"
    for name, spec in zip(names, policies, strict=True):
        arm = static_arm_of(spec)
        if arm is None:
            for eng in engines:
                try:
                    check_engine(trace, eng)
                except ValueError as e:
                    able = [
                        n for n, m in ENGINES.items() if m.methods and all(x in trace.acc for x in m.methods)
                    ]
                    hint = f"; engines that can replay it: {', '.join(able)}" if able else ""
                    raise _UsageError(f"--engine: {e} (it has: {has}){hint}") from None
        elif arm.speculates and arm.method not in trace.acc:
            raise _UsageError(f"--policy {name}: trace {trace.name!r} has no {arm.method.value} acceptance "
                              f"(it has: {has})")  # fmt: skip


def _engines(text: str) -> list[Any]:
    out = []
    for name in text.split(","):
        name = name.strip()
        if name not in ENGINES:
            raise _UsageError(f"--engine: unknown engine model {name!r} (known: {', '.join(ENGINES)})")
        out.append(ENGINES[name])
    return out


@dataclass(frozen=True, slots=True)
class _Cell:
    """One comparison of a sweep: everything a worker needs (picklable)."""

    trace: Trace
    profile: Profile
    prices: Prices
    policies: tuple[ShippedPolicy, ...]
    engines: tuple[EngineModel, ...]
    levels: tuple[int, ...]
    open_loop: bool
    oracle: bool
    baselines: tuple[str, ...] | None
    seed: int


def _compare_cell(cell: _Cell, progress: ProgressBar | None = None) -> Comparison:
    from sim.compare import run_comparison

    return run_comparison(
        cell.trace,
        cell.profile,
        cell.prices,
        policies=[p.spec() for p in cell.policies],
        engines=cell.engines,
        concurrency=cell.levels,
        open_loop=cell.open_loop,
        oracle=cell.oracle,
        baselines=cell.baselines,
        seed=cell.seed,
        progress=progress,
    )


def _run(args: argparse.Namespace, *, compare: bool) -> int:
    from sim.executor import ExecutorError, ExecutorUsageError, ShippedPolicy, make_executor
    from sim.prices import load_prices
    from sim.progress import ProgressBar
    from sim.report import json_text, write_json, write_report

    try:
        levels = _concurrency(args.concurrency)
        if not args.profile.strip(" ,"):
            raise _UsageError(f"--profile {args.profile!r}: not a profile name or file")
        profiles = [load_named_profile(n.strip()) for n in args.profile.split(",") if n.strip()]
        names = (args.policy or ["default", "epsilon-greedy"]) if compare else [args.policy]
        policies = [resolve_policy(n) for n in names]
        engines = _engines(args.engine)
        if args.trace and args.requests is not None:
            raise _UsageError("--requests: applies to --scenario (a --trace replays all its requests)")
        traces = _load_traces(args)
        if not compare and (len(traces) != 1 or len(profiles) != 1):
            raise _UsageError("sim replay: one trace or scenario and one profile (sim compare takes several)")
        if not profiles or not traces:
            raise _UsageError("give at least one --profile and one --trace or --scenario")
        # A sweep names each comparison (and its --out directory) TRACE--PROFILE: two alike overwrote.
        for flag, what, seen in (
            ("--trace" if args.trace is not None else "--scenario", "trace", [t.name for t in traces]),
            ("--profile", "profile", [p.name for p in profiles]),
        ):
            twice = next((n for i, n in enumerate(seen) if n in seen[:i]), None)
            if twice is not None:
                raise _UsageError(f"{flag}: two {what}s named {twice!r}: a sweep names its results by them")
        # A comparison labels its runs POLICY @ ENGINE: two policies of one name (a copy of a preset
        # under its name) gave two rows alike with different figures, and an engine or policy given
        # twice ran it twice.
        for what, seen in (("--policy", [p.name for p in policies]), ("--engine", [e.name for e in engines])):
            twice = next((n for i, n in enumerate(seen) if n in seen[:i]), None)
            if twice is not None:
                raise _UsageError(
                    f"{what}: {twice!r} twice: a comparison labels its runs by policy and engine name"
                )
        for trace in traces:
            _check_methods(trace, names, policies, engines)
            _check_kv_room(trace, profiles, args.profile)
            if args.open_loop and not trace.has_arrivals:
                raise _UsageError(
                    f"--open-loop: trace {trace.name!r} has no arrival_s (try --scenario load-ramp)"
                )
            if not args.open_loop and not args.trace and trace.name in OPEN_LOOP_SCENARIOS:
                # A closed loop ignores the arrival rate this scenario exists for: say so, then run.
                _err(
                    f"note: --scenario {trace.name} is replayed closed loop, its arrival times ignored "
                    "(add --open-loop to follow them)"
                )
        executor = make_executor(args.executor, jobs=args.jobs, address=args.address) if compare else None
        prices = load_prices()
        _check_output("--out", args.out, directory=True)
        if args.out:
            _need_matplotlib("--out")
        _check_output("--json", args.json)
        _check_outputs(args, traces, profiles, names)
    except (TraceError, PolicyError, ProfileError, _UsageError) as e:
        _err(str(e))
        return EXIT_USAGE
    except ExecutorError as e:
        _err(str(e))
        return EXIT_USAGE if isinstance(e, ExecutorUsageError) else EXIT_RUNTIME
    cells = [
        _Cell(
            trace=t,
            profile=p,
            prices=prices,
            policies=tuple(ShippedPolicy.of(p) for p in policies),
            engines=tuple(engines),
            levels=tuple(levels),
            open_loop=args.open_loop,
            oracle=not args.no_oracle and not args.open_loop,
            baselines=("eagle3:3", "ngram:4") if compare else None,
            seed=args.seed,
        )
        for t in traces
        for p in profiles
    ]
    try:
        if len(cells) == 1 and (executor is None or args.executor == "local"):
            # One comparison: in this process, with progress in output tokens replayed.
            adaptive = sum(1 for p in policies if p.algorithm != "static") * len(engines)
            bar = ProgressBar(
                total=traces[0].total_output_tokens * max(adaptive, 1) * len(levels),
                label="starting",
                enabled=args.progress,
            )
            try:
                cmps = [_compare_cell(cells[0], bar)]
            finally:
                bar.close()
        else:
            assert executor is not None
            bar = ProgressBar(total=len(cells), label=f"{len(cells)} comparisons", enabled=args.progress)

            def done(i: int, c: Comparison) -> None:
                bar.set_label(f"done: {c.trace.name} on {c.profile.name}")
                bar.advance()

            try:
                cmps = executor.map(_compare_cell, cells, done)
            finally:
                bar.close()
    except (ValueError, ExecutorError) as e:
        _err(str(e))
        return EXIT_RUNTIME
    hashseed = os.environ.get("PYTHONHASHSEED")
    command = (
        (f"PYTHONHASHSEED={hashseed} " if hashseed else "")
        + "controllerctl sim "
        + ("compare " if compare else "replay ")
        + " ".join(shlex.quote(a) for a in args.argv_tail)
    )
    many = len(cmps) > 1
    if args.out:
        try:
            for cmp in cmps:
                where = Path(args.out) / f"{cmp.trace.name}--{cmp.profile.name}" if many else Path(args.out)
                paths = write_report(cmp, where, command=command)
                print(f"wrote {', '.join(str(p) for p in paths)}")
        except ImportError as e:
            _err(f"--out: plots need matplotlib (pip install 'speccontrol[sim]'): {e}")
            return EXIT_USAGE
        except UnicodeEncodeError:  # a name from a file name that is not UTF-8 (the reader refuses the rest)
            _err(f"--out {where}: a name in the report is not valid Unicode text; nothing written there")
            return EXIT_RUNTIME
    if args.json:
        if many:
            replace_file(args.json, (json.dumps(_sweep_json(cmps), indent=2) + "\n").encode("utf-8"))
        else:
            write_json(cmps[0], Path(args.json))
        print(f"wrote {args.json}")
    if not args.out and not args.json:
        if many:
            print(json.dumps(_sweep_json(cmps), indent=2))
        else:
            # Exactly what --json writes: one run as its object; several (--engine a,b, or a
            # comparison) in the compare layout, {"runs": [...]}.
            sys.stdout.write(json_text(cmps[0]))
    return 0


def _check_outputs(
    args: argparse.Namespace, traces: Sequence[Trace], profiles: Sequence[Profile], names: Sequence[str]
) -> None:
    """``sim replay|compare``: ``--json`` and the report's files against each other and the inputs."""
    from sim.report import REPORT_FILES

    many = len(traces) * len(profiles) > 1
    out = Path(args.out) if args.out else None
    dirs = (
        []
        if out is None
        else [out / f"{t.name}--{p.name}" for t in traces for p in profiles]
        if many
        else [out]
    )
    _check_report_json(args.json, args.out, dirs)
    for d in dirs:  # found after the run, naming a temporary directory the user never gave
        if d.exists() and not d.is_dir():
            raise _UsageError(f"--out {args.out}: {d} is a file, not a directory for the report")
    paths = args.trace if isinstance(args.trace, list) else [args.trace]
    inputs = _input_files(
        *(("--trace", t) for t in paths),
        *(("--policy", n) for n in names),
        # A profile is read from a file only by a .yaml/.yml name (load_profile); else it is a name.
        *(("--profile", n.strip()) for n in args.profile.split(",") if n.strip().endswith(PROFILE_SUFFIXES)),
    )
    _check_not_input("--json", args.json, inputs)
    for d in dirs:
        for name in REPORT_FILES:
            _check_not_input("--out", d / name, inputs)


def _sweep_json(cmps: Sequence[Comparison]) -> dict[str, Any]:
    """Several comparisons: each in the layout of a single one, traces outer, profiles inner."""
    return {"comparisons": [c.to_json() for c in cmps]}


def cmd_replay(args: argparse.Namespace) -> int:
    return _run(args, compare=False)


def cmd_compare(args: argparse.Namespace) -> int:
    return _run(args, compare=True)


def cmd_tune(args: argparse.Namespace) -> int:
    from sim.executor import ExecutorError, ExecutorUsageError, make_executor, usable_cpus
    from sim.tune import parse_grid, table, tune, tune_jobs

    try:
        levels = _concurrency(args.concurrency)
        profile = load_named_profile(args.profile)
        spec = resolve_policy(args.policy)
        engines = _engines(args.engine)
        if len(engines) != 1:
            raise _UsageError("--engine: tune on one engine model at a time")
        grid = parse_grid(args.param or [])
        if not grid:
            raise _UsageError("--param: give at least one NAME=V1,V2 to search")
        if args.requests is not None and not (args.scenario or "").strip(" ,"):
            # As in sim replay|compare: it was ignored without a word.
            raise _UsageError("--requests: applies to --scenario (a --trace replays all its requests)")
        traces = [read_trace(t, seed=args.seed) for t in args.trace or []]
        traces += _scenarios(args.scenario or "", args)
        if not traces:
            raise _UsageError("give --trace FILE and/or --scenario A,B")
        points = math.prod(len(v) for v in grid.values())
        replayed = (1 + points) * len(levels) * sum(t.total_output_tokens for t in traces)
        if replayed > MAX_TUNE_TOKENS:
            raise _UsageError(
                f"--param: {points} grid points x {len(levels)} concurrency levels x {len(traces)} traces "
                f"replay {replayed:.3g} output tokens; at most {MAX_TUNE_TOKENS:.0e} per sweep "
                "(fewer points, levels or --requests)"
            )
        for tr in traces:  # before the baseline jobs run, not after
            _check_methods(tr, [args.policy], [spec], engines)
            _check_kv_room(tr, [profile], args.profile)
        _check_output("--out", args.out)
        # The policy and profile files too: `--policy mine.yaml --out mine.yaml` replaced the policy
        # being tuned with the winner (under another name), and the original was gone.
        _check_not_input(
            "--out",
            args.out,
            _input_files(
                *(("--trace", t) for t in args.trace or []),
                ("--policy", args.policy),
                ("--profile", args.profile),
            ),
        )
        from sim.tune import candidates

        points_made = candidates(spec, grid)  # every point validated before any job runs
        executor = make_executor(args.executor, jobs=args.jobs, address=args.address)
    except (TraceError, PolicyError, ProfileError, _UsageError, ValueError) as e:
        _err(str(e))
        return EXIT_USAGE
    except ExecutorError as e:
        _err(str(e))
        return EXIT_USAGE if isinstance(e, ExecutorUsageError) else EXIT_RUNTIME
    if not args.address and args.jobs is not None and args.jobs > usable_cpus():  # (a cluster: its CPUs)
        # Clamped as make -j is not: the jobs are CPU-bound, so workers beyond the CPUs only take
        # memory (--jobs 1024 on 2 cores started 1024 interpreters). Said, so the figure is not a puzzle.
        print(
            f"--jobs {args.jobs}: {usable_cpus()} CPUs usable here; running at most {usable_cpus()} workers",
            file=sys.stderr,
        )
    # On a terminal by default, a bar as sim compare's (a grid of 10^4 points printed 10^4 lines);
    # asked for elsewhere (a log file, where a bar's carriage returns read as one long line), a line
    # per finished job. A sweep runs for hours, silent unless asked.
    shown = args.progress if args.progress is not None else sys.stderr.isatty()
    progress: Callable[[str], None] | None = None
    bar = None
    if shown and sys.stderr.isatty():
        from sim.progress import ProgressBar

        bar = ProgressBar(total=tune_jobs(points_made, traces, levels), label="sim tune", enabled=True)

        def on_bar(line: str, bar: ProgressBar = bar) -> None:
            bar.label = line.split("] ", 1)[-1]
            bar.advance()

        progress = on_bar
    elif shown:
        progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        cands = tune(
            spec,
            grid,
            traces,
            profile,
            engines[0],
            levels,
            seed=args.seed,
            progress=progress,
            executor=executor,
            points=points_made,
        )
    except (ValueError, ExecutorError) as e:
        if bar is not None:
            bar.close()
        _err(str(e))
        return EXIT_RUNTIME
    if bar is not None:
        bar.close()
    print(table(cands))
    if args.out:
        from sim.tune import render_tuned

        replace_file(args.out, render_tuned(cands[0]).encode("utf-8"))
        print(f"wrote {args.out} (policy {cands[0].spec.name}-tuned)")
    return 0


def _one_engines_steps(steps: StepLog, engine_id: str | None, source: str) -> StepLog:
    """The steps ``--engine-id`` names (all when None). Steps of several engines are fitted as one,
    said in one line: pods of one model on one kind of GPU pool well, but a log of several sidecars'
    engines (another GPU, another model) was fitted as one without a word, a profile of neither."""
    import numpy as np

    counts: dict[str, int] = {}
    for e in steps.engine:
        counts[e] = counts.get(e, 0) + 1
    if engine_id is not None:
        if engine_id not in counts:
            names = ", ".join(sorted(counts)[:10]) + (", ..." if len(counts) > 10 else "")
            raise _UsageError(f"--engine-id {engine_id}: no steps of that engine in {source} ({names})")
        return steps.select(np.array([e == engine_id for e in steps.engine]))
    if len(counts) > 1:
        shown = ", ".join(f"{e or '(none)'}: {n}" for e, n in sorted(counts.items())[:10])
        _err(
            f"{source}: steps of {len(counts)} engines ({shown}{', ...' if len(counts) > 10 else ''}) fitted "
            f"as one; if they differ (GPU, model), give --engine-id to fit one"
        )
    return steps


def cmd_profile_fit(args: argparse.Namespace) -> int:
    """Fit a profile to recorded steps; writes the YAML (and the residual plot) only when the fit holds."""
    from sim.costmodel import DRAFT_COSTS, DraftCost, parse_profile_text
    from sim.fit import FitError, fit_best, render_profile, residual_plot
    from sim.steplog import StepLogError, read_steps

    try:
        _check_output("--out", args.out)
        _check_output("--plot", args.plot, suffix=".png")
        # The steps were replaced by the profile (--out naming the steps file), or the plot by it; so
        # was a --base profile file.
        inputs = _input_files(("steps", args.steps), ("--base", args.base))
        _check_not_input("--out", args.out, inputs)
        _check_not_input("--plot", args.plot, inputs)
        if args.plot and same_file(args.out, args.plot):
            raise _UsageError(f"--plot {args.plot}: --out writes the profile there (give another path)")
        if Path(args.out).suffix not in PROFILE_SUFFIXES:  # fitted, written, then read by no --profile
            raise _UsageError(f"--out {args.out}: must name a .yaml or .yml file (--profile reads no other)")
        name = args.name if args.name is not None else Path(args.out).stem
        bad_name = name_problem(name)
        if bad_name is not None:  # before the fit: a name that cannot load is not written
            flag = "--name" if args.name is not None else "--out (its stem names the profile: give --name)"
            raise _UsageError(f"{flag}: {bad_name}")
        if args.plot:
            _need_matplotlib("--plot")
        engines = _engines(args.engine)
        if len(engines) != 1:
            raise _UsageError("--engine: one engine model")
        base = load_named_profile(args.base, "--base")  # "unknown profile 'x'" did not say which flag
        # Said on a terminal: a recording of a million steps takes a minute to read and fit.
        tty = sys.stderr.isatty()
        if tty:
            _err(f"reading {args.steps} ...")
        steps = _one_engines_steps(read_steps(args.steps, warn=_err), args.engine_id, args.steps)
        costs: list[DraftCost] = list(DRAFT_COSTS) if args.draft_cost == "auto" else [args.draft_cost]
        if tty:
            _err(f"fitting {steps.n} steps ({', '.join(costs)}) ...")
        fit = fit_best(
            steps,
            draft_costs=costs,
            base=base,
            engine=engines[0],
            prompt_tokens=args.prompt_tokens,
            level=args.level,
        )
        text = render_profile(fit, name=name, base=base, model=args.model, hardware=args.hardware)
        try:  # what is written loads, read as load_profile reads it
            parse_profile_text(text, source=args.out)
        except ProfileError as e:
            # Said as the fit's figure, not as a line of an --out file that was never written.
            why = str(e).removeprefix(args.out).lstrip(":0123456789 ")
            raise FitError(
                f"{args.steps}: the fitted profile is outside the cost model's ranges ({why}); the steps' "
                f"durations do not follow the step-time model: nothing written to {args.out}"
            ) from None
    except (StepLogError, FitError, ProfileError, _UsageError) as e:
        _err(str(e))
        return EXIT_USAGE
    # The plot first: a profile is never left behind by a plot that failed.
    try:
        if args.plot:
            residual_plot(fit, Path(args.plot))
    except OSError as e:
        _err(f"{args.plot}: {error_text(e)}")
        return EXIT_RUNTIME
    try:
        replace_file(args.out, text.encode("utf-8"))
    except OSError as e:
        if args.plot:
            Path(args.plot).unlink(missing_ok=True)
        _err(f"{args.out}: {error_text(e)}")
        return EXIT_RUNTIME
    if args.json:
        print(json.dumps({"profile": args.out, **fit.summary()}, indent=2))
        return 0
    print(f"{steps.n} steps from {args.steps}; draft cost {fit.draft_cost}", end="")
    if fit.alternatives:
        alts = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in fit.alternatives.items())
        print(f" (residual RMS: {alts})", end="")
    print()
    print(f"{'parameter':34} {'value':>12}  {int(fit.level * 100)} % interval")
    for p in fit.params:
        ci = f"[{p.ci_low:.4g}, {p.ci_high:.4g}]" if p.status == "fitted" else f"fixed: {p.note}"
        print(f"{p.name:34} {p.value:12.5g}  {ci}")
    print(
        f"residual RMS {fit.rmse_s * 1e3:.4g} ms, R² {fit.r2:.4f}, "
        f"median |error| {fit.median_abs_rel_error * 100:.2f} %"
    )
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    print("scenarios:")
    for name, s in SCENARIOS.items():
        print(f"  {name:16} {s.description}")
    print("profiles:")
    for name in profile_names():
        print(f"  {name:28} {load_profile(name).description}")
    print("engines:")
    for name, e in ENGINES.items():
        print(f"  {name:20} {e.description}")
    return 0


def cmd_trace_validate(args: argparse.Namespace) -> int:
    bad = 0
    for f in args.files:
        errors = validate_trace(f)
        for e in errors:
            _err(str(e))
        if errors:
            bad += 1
        else:
            print(f"{one_line(str(f))}: ok")
    return EXIT_USAGE if bad else 0


def cmd_trace_generate(args: argparse.Namespace) -> int:
    if args.scenario not in SCENARIOS:
        _err(f"--scenario: unknown scenario {args.scenario!r} (known: {', '.join(SCENARIOS)})")
        return EXIT_USAGE
    problem = output_problem("--out", args.out)
    if problem is not None:
        _err(problem)
        return EXIT_USAGE
    tr = generate(args.scenario, n_requests=args.requests, seed=args.seed)
    write_trace(tr, args.out)
    print(f"wrote {args.out}: {tr.n} requests, {tr.total_output_tokens} output tokens")
    return 0


def cmd_trace_import(args: argparse.Namespace) -> int:
    from policies.arms import Method
    from sim.importer import import_token_ids, import_vllm_metrics

    if (args.file is None) == (args.tokens is None):
        _err("trace import: give a FILE of vLLM responses or --tokens FILE of token ids (one of them)")
        return EXIT_USAGE
    # The sizes given (unset: import_token_ids' own defaults, vLLM's matcher sizes).
    sizes = {
        k: v
        for k, v in (("min_n", args.min_n), ("max_n", args.max_n), ("max_k", args.max_k))
        if v is not None
    }
    if args.tokens is None and sizes:
        _err("--min-n/--max-n/--max-k: only with --tokens")
        return EXIT_USAGE
    if args.tokens is not None and args.method is not None:
        _err(
            "--method: only with a FILE of vLLM responses (--tokens computes acc.ngram from the token "
            "ids; other methods' counts go in each line's acc)"
        )
        return EXIT_USAGE
    problem = output_problem("--out", args.out)
    if problem is not None:
        _err(problem)
        return EXIT_USAGE
    try:  # `--out` naming the responses (or token ids) replaced them with the trace, the recording lost
        _check_not_input(
            "--out", args.out, _input_files(("vLLM responses", args.file), ("--tokens", args.tokens))
        )
    except _UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    try:
        if args.tokens is not None:
            tr = import_token_ids(args.tokens, **sizes)
        else:
            tr = import_vllm_metrics(args.file, method=Method(args.method or "eagle3"))
    except UnicodeDecodeError:  # before ValueError, which it is
        _err(f"{args.tokens or args.file}: not UTF-8 text (expected JSON Lines)")
        return EXIT_USAGE
    except ValueError as e:  # TraceError too: FILE:LINE: field: message
        _err(str(e))
        return EXIT_USAGE
    write_trace(tr, args.out)
    if args.tokens is not None:
        assert tr.ngram_proposal is not None
        matched = float((tr.ngram_proposal > 0).mean())
        ngram = tr.meta["ngram"]
        print(
            f"wrote {args.out}: {tr.n} requests, {tr.total_output_tokens} output tokens, max_k {tr.max_k}, "
            f"n-gram match at {matched:.1%} of positions (min_n {ngram['min_n']}, max_n {ngram['max_n']})"
        )
    else:
        print(
            f"wrote {args.out}: {tr.n} requests, {tr.total_output_tokens} output tokens, max_k {tr.max_k} "
            f"(counts censored at the recorded K)"
        )
    return 0


def cmd_trace_record(args: argparse.Namespace) -> int:
    from policies.arms import Method
    from sim.progress import ProgressBar
    from sim.record import RecordUsageError, read_prompts, record_trace, responses_file

    problem = output_problem("--out", args.out)
    if problem is not None:
        _err(problem)
        return EXIT_USAGE
    try:  # the prompts were replaced by the trace, or by the responses kept beside it, after every request
        prompts_file = _input_files(("--prompts", args.prompts))
        for out in (args.out, responses_file(Path(args.out))):
            _check_not_input("--out", out, prompts_file)
    except _UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    try:
        prompts = read_prompts(args.prompts, default_class=args.traffic_class, max_tokens=args.max_tokens)
    except TraceError as e:
        _err(str(e))
        return EXIT_USAGE
    if not 1 <= args.min_n <= args.max_n <= MAX_NGRAM:
        _err(f"--min-n/--max-n: need 1 <= min_n <= max_n <= {MAX_NGRAM}, got {args.min_n}, {args.max_n}")
        return EXIT_USAGE
    bar = ProgressBar(total=len(prompts), label="recording")
    warnings: list[str] = []  # said after the progress bar's last line, not inside it
    stopped: list[str] = []  # why the recording stopped before the last prompt (the server went away)
    try:
        tr, failures, responses = record_trace(
            base_url=args.url,
            model=args.model,
            prompts=prompts,
            out=Path(args.out),
            method=Method(args.method),
            concurrency=max(1, args.concurrency),
            on_done=lambda _: bar.advance(),
            ngram=(args.min_n, args.max_n),
            warn=warnings.append,
            timeout_s=args.timeout,
            stopped=stopped,
        )
    except RecordUsageError as e:  # --url, or the responses file: found before any request
        _err(str(e))
        return EXIT_USAGE
    except TraceError as e:
        _err(str(e))
        return EXIT_RUNTIME
    finally:
        bar.close()
    for w in warnings:
        _err(w)
    write_trace(tr, args.out)
    signal = (
        f"n-gram match at {float((tr.ngram_proposal > 0).mean()):.1%} of positions (min_n {args.min_n}, "
        f"max_n {args.max_n})"
        if tr.ngram_proposal is not None
        else "no n-gram proposals: responses without token ids"
    )
    print(
        f"wrote {args.out}: {tr.n} requests ({failures} failed), {tr.total_output_tokens} output tokens, "
        f"max_k {tr.max_k}; {signal}; responses kept in {responses} (counts censored at the recorded K)"
    )
    if stopped:  # a recording cut short by the server is not a whole one: said, and exit 1
        _err(f"{args.url}: {stopped[0]}; the trace holds the {tr.n} requests answered before")
        return EXIT_RUNTIME
    return 0 if tr.n else 1


def _executor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--executor",
        default="local",
        choices=["local", "ray"],
        help="where the sweep's jobs run: a local process pool, or Ray (pip install 'speccontrol[ray]')",
    )
    p.add_argument("--address", help="with --executor ray: an existing cluster (auto, ray://HOST:10001)")
    p.add_argument(
        "--jobs",
        type=cli_types.jobs,
        default=None,
        help="workers (default and at most: the usable CPU count)",
    )


#: ``--seed`` of the commands that replay policies. One seed for the whole run, so a run is repeated
#: from its command line alone; a policy's own ``seed`` applies where it runs live (the sidecar).
SEED_HELP = (
    "seeds the generated traffic (--scenario), the sampled acceptance of a trace's acc.*.alpha, and "
    "every policy replayed: it replaces each policy's own `seed` (default 0)"
)


def _replay_args(p: argparse.ArgumentParser, *, compare: bool) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    if compare:
        src.add_argument("--trace", action="append", help="a spectrace v1 file (repeatable)")
        src.add_argument("--scenario", help=f"generated scenarios, comma-separated ({', '.join(SCENARIOS)})")
    else:
        src.add_argument("--trace", help="a spectrace v1 file (.jsonl or .jsonl.gz)")
        src.add_argument("--scenario", help=f"a generated scenario ({', '.join(SCENARIOS)})")
    if compare:
        p.add_argument(
            "--policy",
            action="append",
            help="policy file, preset or static:ARM (repeatable; default: default and epsilon-greedy)",
        )
    else:
        p.add_argument("--policy", required=True, help="policy file, preset name, or static:ARM")
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"cost-model profile{'s, comma-separated' if compare else ''} ({', '.join(profile_names())})",
    )
    if compare:
        _executor_args(p)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument(
        "--engine",
        default="stock-vllm,composite" if compare else "composite",
        help=f"engine model(s), comma-separated ({', '.join(ENGINES)})",
    )
    p.add_argument(
        "--open-loop", action="store_true", help="use the trace's arrival times (concurrency = cap)"
    )
    p.add_argument(
        "--requests",
        type=cli_types.requests,
        default=None,
        help=f"requests to generate for --scenario (at most {MAX_GENERATED_REQUESTS} in all)",
    )
    p.add_argument("--seed", type=cli_types.seed, default=0, help=SEED_HELP)
    p.add_argument("--no-oracle", action="store_true", help="skip the hindsight oracles")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.add_argument("--out", help="directory for report.md, result.json and PNG plots")
    p.add_argument("--json", help="write the result JSON here")


def register(subparsers: Any) -> None:
    """Add ``sim`` and ``trace`` to ``controllerctl``'s sub-commands."""
    sim = subparsers.add_parser("sim", help="trace replay: policies vs static configurations and oracles")
    ss = sim.add_subparsers(dest="sim_command", required=True)
    p = ss.add_parser("replay", help="replay one policy")
    _replay_args(p, compare=False)
    p.set_defaults(func=_with_tail(cmd_replay))
    p = ss.add_parser("compare", help="several policies and static baselines side by side")
    _replay_args(p, compare=True)
    p.set_defaults(func=_with_tail(cmd_compare))
    add_autoscale_parser(ss, resolve_policy, load_named_profile)
    p = ss.add_parser("tune", help="grid search over a policy's parameters; writes the winning policy")
    p.add_argument("--policy", required=True, help="policy file or preset to tune")
    p.add_argument("--param", action="append", help="NAME=V1,V2 (algorithm parameter, or rule.NAME)")
    p.add_argument("--trace", action="append", help="a spectrace v1 file (repeatable)")
    p.add_argument("--scenario", help="comma-separated generated scenarios")
    p.add_argument(
        "--requests",
        type=cli_types.requests,
        default=None,
        help=f"requests to generate per scenario (at most {MAX_GENERATED_REQUESTS} in all)",
    )
    p.add_argument(
        "--profile", default=DEFAULT_PROFILE, help=f"cost-model profile ({', '.join(profile_names())})"
    )
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--engine", default="composite", help=f"one engine model ({', '.join(ENGINES)})")
    p.add_argument("--seed", type=cli_types.seed, default=0, help=SEED_HELP)
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress on stderr: a bar on a terminal, else a line per finished job (default: when stderr is a terminal)",
    )
    p.add_argument("--out", help="write the winning policy YAML here")
    _executor_args(p)
    p.set_defaults(func=cmd_tune)
    p = ss.add_parser("list", help="scenarios, profiles and engine models")
    p.set_defaults(func=cmd_list)

    prof = subparsers.add_parser("profile", help="cost-model profiles: fit one to recorded engine steps")
    ps = prof.add_subparsers(dest="profile_command", required=True)
    p = ps.add_parser("fit", help="least-squares step-time model from `serve --record-steps` telemetry")
    p.add_argument("steps", help="a speccontrol-steps/1 file (JSON Lines, from serve --record-steps)")
    p.add_argument("--out", required=True, help="the fitted profile YAML to write")
    p.add_argument("--name", help="profile name (default: the --out file's stem)")
    p.add_argument("--model", help="the model the steps ran (default: the base profile's)")
    p.add_argument("--hardware", help="the hardware the steps ran on (default: the base profile's)")
    p.add_argument(
        "--base",
        default=DEFAULT_PROFILE,
        help="profile giving memory, prices and any parameter the steps cannot inform",
    )
    p.add_argument(
        "--engine", default="stock-vllm", help=f"engine model the steps came from ({', '.join(ENGINES)})"
    )
    p.add_argument("--draft-cost", default="auto", choices=["auto", "per_forward", "per_draft"])
    p.add_argument(
        "--prompt-tokens",
        type=cli_types.float_in(0, MAX_PROMPT_TOKENS),
        default=0.0,
        help="mean prompt tokens per request, added to decoded tokens where steps lack kv_tokens",
    )
    p.add_argument(
        "--level",
        type=cli_types.float_in(0.5, 1, hi_open=True),
        default=0.95,
        help="confidence level of the intervals",
    )
    p.add_argument(
        "--engine-id",
        help="fit only the steps of this engine (the steps' `engine`; default: all, said when several)",
    )
    p.add_argument("--plot", help="residual plot to write (a .png file)")
    p.add_argument("--json", action="store_true", help="print the fit as JSON")
    p.set_defaults(func=cmd_profile_fit)

    tr = subparsers.add_parser("trace", help="spectrace v1 files")
    ts = tr.add_subparsers(dest="trace_command", required=True)
    p = ts.add_parser("validate", help="check trace files; errors as FILE:LINE: field: message")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=cmd_trace_validate)
    p = ts.add_parser("generate", help="write a generated scenario as a trace file")
    p.add_argument("--scenario", required=True)
    p.add_argument("--requests", type=cli_types.requests, default=None)
    p.add_argument("--seed", type=cli_types.seed, default=0, help="seed of the generated traffic (default 0)")
    p.add_argument("--out", required=True, help="output file (.jsonl, or .jsonl.gz for gzip)")
    p.set_defaults(func=cmd_trace_generate)
    p = ts.add_parser("import", help="a trace from vLLM responses with detailed per-request spec metrics")
    p.add_argument(
        "file", nargs="?", help="JSON Lines of vLLM responses (--per-request-spec-decode-metrics detailed)"
    )
    p.add_argument(
        "--method",
        choices=["eagle3", "p_eagle", "ngram"],
        help="the drafting method the engine ran (default eagle3; not with --tokens)",
    )
    p.add_argument(
        "--tokens",
        metavar="FILE",
        help="instead: JSON Lines {prompt_token_ids, output_token_ids[, acc]} of greedy requests; "
        "acc.ngram and ngram_proposal are computed exactly with vLLM's n-gram matcher",
    )
    p.add_argument("--min-n", type=int, help="with --tokens: shortest n-gram matched (default 4, as vLLM)")
    p.add_argument("--max-n", type=int, help="with --tokens: longest n-gram matched (default 5, as vLLM)")
    p.add_argument("--max-k", type=int, help="with --tokens: the trace's max_k (proposal cap; default 8)")
    p.add_argument("--out", required=True, help="output trace (.jsonl, or .jsonl.gz for gzip)")
    p.set_defaults(func=cmd_trace_import)
    p = ts.add_parser("record", help="record a trace from a running vLLM server (detailed spec metrics)")
    p.add_argument("--url", required=True, help="the vLLM OpenAI server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument(
        "--prompts", required=True, help="JSON Lines {prompt, class, max_tokens} or one prompt per line"
    )
    p.add_argument("--class", dest="traffic_class", default="default", help="class for prompts without one")
    p.add_argument(
        "--max-tokens",
        type=cli_types.int_in(2, MAX_OUTPUT_TOKENS),
        default=256,
        help="for prompts without their own",
    )
    p.add_argument(
        "--concurrency", type=cli_types.int_in(1, MAX_REPLAY_BATCH), default=4, help="requests in flight"
    )
    p.add_argument("--method", default="eagle3", choices=["eagle3", "p_eagle", "ngram"])
    p.add_argument(
        "--timeout",
        type=cli_types.float_in(0, 86400, lo_open=True),
        default=600.0,
        help="seconds one request may take, its whole answer read (default %(default)s; its connection must "
        "open within 30 s; 8 connections in a row that cannot, or 8 requests in a row timed out, stop the "
        "recording)",
    )
    p.add_argument(
        "--min-n", type=int, default=DEFAULT_MIN_N,
        help="shortest n-gram of the proposals (the engine's SPECCONTROL_NGRAM_MIN; plugin default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--max-n", type=int, default=DEFAULT_MAX_N,
        help="longest n-gram of the proposals (the engine's SPECCONTROL_NGRAM_MAX; plugin default %(default)s)",
    )  # fmt: skip
    p.add_argument("--out", required=True, help="output trace (.jsonl, or .jsonl.gz for gzip)")
    p.set_defaults(func=cmd_trace_record)


def _with_tail(fn: Any) -> Any:
    """Record the command line after ``sim replay|compare`` for the report header."""

    def run(args: argparse.Namespace) -> int:
        argv = sys.argv[1:]
        for verb in ("replay", "compare"):
            if verb in argv:
                argv = argv[argv.index(verb) + 1 :]
                break
        args.argv_tail = argv
        return int(fn(args))

    return run


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sim ...`` (the same commands without the controller)."""
    parser = cli_types.OneLineParser(prog="python -m sim")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))
