"""Paired A/B of the plugin's per-step cost between two source trees, stepped alternately.

On a shared machine one run's figure drifts by up to 2x over the day, so two separate runs of
``plugin_overhead.py --scripted`` cannot tell a 5 % change. This runs each tree's own scripted
benchmark (``benchmarks/plugin_overhead.py``: the hooks on a scripted scheduler, no engine) in its
own process, imported from that tree as it is, and lets the two take turns a step at a time, both
on one CPU: whatever slows the machine slows both alike, and the other process waits while one
steps.

    .venv-vllm/bin/python benchmarks/plugin_ab.py BEFORE_TREE AFTER_TREE [--batches 8,32]
        [--steps 400] [--rounds 3] [--history 2000] [--mode composite-async] [--cold-mb 4] [--json FILE]

(e.g. a worktree of main and yours; the same tree twice shows the noise floor.) Per batch it prints
each tree's figure (the CPU time in the hooks per step: the median over a round's steps, then the
median over the rounds, as ``plugin_overhead.py`` reports it), the ratio after / before, the median
of the per-step ratios (step i of one tree against step i of the other: same batch, same scripted
tokens), the CPU time by hook, and the load average. The figures themselves run 1.5-2.5x above
``plugin_overhead.py``'s on this machine: each step finds the caches as the other process left them
(closer to an engine, where the model runs between the hooks); compare the ratios, not the figures.
Run against itself, a tree showed ratios within 2 % of 1.

How the turns are taken, without changing either tree: the child process replaces the tree's
``HookClock`` by a subclass whose ``on`` attribute, which the benchmark sets at the start of each
step (outside the timed hooks), waits for the parent's go first. A tree whose benchmark does not
set it each step is refused (no step was gated).

What must hold: each tree's figures are exactly what its own benchmark measures (its code, its
clock); the two never run a step at the same time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

MODES = ("k-table", "composite-sync", "composite-async")
#: Child -> parent lines: a step is about to start and waits for "go"; the result, as JSON.
_READY, _RESULT = "ready", "result "


def _child(
    tree: Path, batches: list[int], history: int, steps: int, rounds: int, mode: str, cpu: int, cold_mb: int
) -> int:
    """Run ``tree``'s scripted benchmark, each step gated on a "go" line from stdin, on CPU ``cpu``."""
    # Ctrl-C is the parent's (it kills this process; with the parent gone, stdin's end stops it too).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol keeps the real stdout
    os.dup2(2, 1)  # whatever else is written there goes to stderr
    sys.stdout = sys.stderr
    sys.path.insert(0, str(tree))
    import benchmarks.plugin_overhead as bench  # the tree's own (sys.path[0])
    import controller.vllm.engine_hooks as hooks

    for mod in (bench, hooks):
        if not Path(mod.__file__ or "").resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"plugin_ab: imported {mod.__file__}, not {tree}'s")
    if cold_mb and "cold_mb" not in inspect.signature(bench._scripted).parameters:
        raise SystemExit(f"plugin_ab: {tree}'s benchmark has no cold_mb (plugin_overhead.py --cold-mb)")
    base = bench.HookClock

    class GatedClock(base):  # type: ignore[misc,valid-type]
        """The tree's clock; each step's ``on = ...`` first waits for the parent's go."""

        gate = False
        gated_steps = 0
        last: Any = None  # the latest round's clock

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "on" and GatedClock.gate:
                GatedClock.gated_steps += 1
                proto.write(_READY + "\n")
                if sys.stdin.readline().strip() != "go":
                    raise SystemExit(0)  # the parent stopped
            object.__setattr__(self, name, value)

        def install(self) -> None:
            GatedClock.gate = False  # install's own probe sets ``on`` too
            super().install()
            GatedClock.gate = True
            GatedClock.last = self

    bench.HookClock = GatedClock
    out: dict[str, list[dict[str, Any]]] = {}
    for b in batches:
        for _ in range(rounds):
            before = GatedClock.gated_steps
            r = (
                bench._scripted(b, history, steps, mode, cold_mb)
                if cold_mb
                else bench._scripted(b, history, steps, mode)
            )
            GatedClock.gate = False
            if GatedClock.gated_steps - before < steps:
                raise SystemExit(f"plugin_ab: {tree}'s benchmark does not set clock.on each step")
            clock = GatedClock.last
            calls = getattr(clock, "calls", [])  # each step's hook calls: the clock's own cost, as per_step
            calls = calls if len(calls) == len(clock.cpu) else [0] * len(clock.cpu)
            r["per_step_cpu_us"] = [
                (x - c * clock.overhead_cpu) * 1e6 for x, c in zip(clock.cpu, calls, strict=True)
            ]
            out.setdefault(str(b), []).append(r)
    proto.write(_RESULT + json.dumps(out) + "\n")
    return 0


def _default_cpu() -> int:
    """The last CPU this process may run on (-1 where affinity cannot be set)."""
    if not hasattr(os, "sched_getaffinity"):
        return -1
    return max(os.sched_getaffinity(0))


def _cpus() -> str:
    """The CPUs this process may run on, as "0-3, 6"."""
    cpus, spans = sorted(os.sched_getaffinity(0)), []
    for c in cpus:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


class _Tree:
    """One child process and its pipes."""

    def __init__(self, tree: Path, args: argparse.Namespace) -> None:
        self.tree = tree
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(tree), "--batches", args.batches, "--history",
             str(args.history), "--steps", str(args.steps), "--rounds", str(args.rounds), "--mode", args.mode,
             "--cpu", str(args.cpu), "--cold-mb", str(args.cold_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)},
        )  # fmt: skip
        self.result: dict[str, list[dict[str, Any]]] | None = None

    def next_line(self) -> str:
        out: IO[str] = self.proc.stdout  # type: ignore[assignment]
        line = out.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"{self.tree}: the benchmark ended (exit {code}) before its result")
        return line.rstrip("\n")

    def wait(self) -> bool:
        """Wait until the tree is at its next step (True) or has sent its result (False)."""
        line = self.next_line()
        if line.startswith(_RESULT):
            self.result = json.loads(line[len(_RESULT) :])
            self.proc.wait()
            return False
        if line != _READY:
            raise RuntimeError(f"{self.tree}: unexpected line {line!r}")
        return True

    def step(self) -> bool:
        """Run the tree's next step, and wait until it is done (False: the tree has finished)."""
        stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
        stdin.write("go\n")
        stdin.flush()
        return self.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


#: Steps between flips of the order the trees take their turns in.
FLIP_EVERY = 50


def _turns(trees: list[_Tree]) -> None:
    """Step the trees in turn until each has sent its result. Only the tree just sent "go" runs;
    every other one waits at the start of its next step. Each step of each tree follows a step of
    the other (flipping the order every step made one tree's step follow its own every other time,
    which biased the per-step ratios), and the order flips every ``FLIP_EVERY`` steps (the tree
    that went second was up to 3 % cheaper)."""
    live = [t for t in trees if t.wait()]  # each at its first step (after its start-up)
    k = 0
    while live:
        for t in live if (k // FLIP_EVERY) % 2 == 0 else live[::-1]:
            if not t.step():
                live.remove(t)
        k += 1


def _summary(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    med_b = statistics.median(r["cpu_median"] for r in before)
    med_a = statistics.median(r["cpu_median"] for r in after)
    ratios = [
        y / x
        for rb, ra in zip(before, after, strict=True)
        for x, y in zip(rb["per_step_cpu_us"], ra["per_step_cpu_us"], strict=False)
        if x > 0
    ]
    return {
        "before_us": round(med_b, 1),
        "after_us": round(med_a, 1),
        "ratio": round(med_a / med_b, 3) if med_b > 0 else None,
        "paired_step_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "before_rounds_us": [round(r["cpu_median"], 1) for r in before],
        "after_rounds_us": [round(r["cpu_median"], 1) for r in after],
        "before_by_hook": before[len(before) // 2]["cpu_us_by_hook"],
        "after_by_hook": after[len(after) // 2]["cpu_us_by_hook"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="*", help="BEFORE_TREE AFTER_TREE (each a checkout of this repo)")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--steps", type=int, default=400, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per batch (fresh hooks each)")
    ap.add_argument("--history", type=int, default=2000, help="tokens per request's history")
    ap.add_argument("--mode", choices=MODES, default="composite-async")
    ap.add_argument(
        "--cpu",
        type=int,
        default=_default_cpu(),
        help="the CPU both trees run on (-1: wherever the OS puts them)",
    )
    ap.add_argument(
        "--cold-mb",
        type=int,
        default=0,
        help="MB written before every hook call, outside its clock (plugin_overhead.py --cold-mb: cold caches, "
        "as in an engine); 0: off",
    )
    ap.add_argument("--json", metavar="FILE", help="write the figures here")
    ap.add_argument("--child", metavar="TREE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if args.steps < 1 or args.rounds < 1 or args.history < 1 or not all(0 < b <= 32 for b in batches):
        ap.error("need --steps, --rounds, --history >= 1 and batches in 1..32")
    if not 0 <= args.cold_mb <= 4096:
        ap.error(f"--cold-mb: 0..4096, got {args.cold_mb}")
    if args.cpu != -1 and hasattr(os, "sched_getaffinity") and args.cpu not in os.sched_getaffinity(0):
        # (each child failed to pin itself, a traceback, then "the benchmark ended (exit 1)")
        ap.error(f"--cpu: one of the CPUs this process may run on ({_cpus()}) or -1, got {args.cpu}")
    if args.child:
        return _child(Path(args.child), batches, args.history, args.steps, args.rounds, args.mode, args.cpu,
                      args.cold_mb)  # fmt: skip
    if len(args.trees) != 2:
        ap.error("give two trees: BEFORE_TREE AFTER_TREE")
    paths = [Path(t).resolve() for t in args.trees]
    for p in paths:
        if not (p / "benchmarks" / "plugin_overhead.py").exists():
            ap.error(f"{p}: no benchmarks/plugin_overhead.py there")
    # This checkout's, imported here only: the child imports each tree's own modules.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sim.files import output_problem, replace_file

    problem = output_problem("--json", args.json)  # now, not after the run (a traceback then)
    if problem:
        ap.error(problem)
    load = os.getloadavg()[0]
    trees = [_Tree(p, args) for p in paths]
    try:
        _turns(trees)
    except RuntimeError as e:
        print(f"plugin_ab: {e}", file=sys.stderr)
        return 1
    finally:
        for t in trees:
            t.stop()
    load_after = os.getloadavg()[0]
    before, after = (t.result or {} for t in trees)
    res = {str(b): _summary(before[str(b)], after[str(b)]) for b in batches}
    cold = f", {args.cold_mb} MB written before each hook call" if args.cold_mb else ""
    print(f"{args.mode}{cold}, {args.history}-token histories, {args.steps} steps x {args.rounds} rounds, stepped "
          f"alternately; load average {load:.2f} -> {load_after:.2f} on {os.cpu_count()} cores")  # fmt: skip
    print(f"  before: {paths[0]}\n  after:  {paths[1]}")
    for b in batches:
        r = res[str(b)]
        print(f"batch {b:>2}: {r['before_us']:7.1f} -> {r['after_us']:7.1f} us per step (x{r['ratio']}; paired "
              f"per-step ratio x{r['paired_step_ratio']}; rounds {r['before_rounds_us']} / {r['after_rounds_us']})")  # fmt: skip
        print(f"  by hook, before: {r['before_by_hook']}\n  by hook, after:  {r['after_by_hook']}")
    if args.json:
        doc = {"mode": args.mode, "cold_mb": args.cold_mb, "history_tokens": args.history, "steps": args.steps, "rounds": args.rounds,
               "trees": [str(p) for p in paths], "load_average_1min": [round(load, 2), round(load_after, 2)],
               "batches": res}  # fmt: skip
        try:
            replace_file(args.json, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
        except OSError as e:
            print(f"plugin_ab: {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
