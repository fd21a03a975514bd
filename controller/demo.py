"""``controllerctl demo``: a sidecar and one simulated engine per policy over the real gRPC path.

Every engine is the composite drafter (EAGLE-3 and n-gram per request, as the vLLM plugin runs it)
stepping the simulator's own kernel and the Llama-3.1-8B / H100 profile (``sim.kernel``,
``sim/profiles``), so the demo's figures come from the same physics as the decision-quality tables.
All engines replay the same seeded workload (common random numbers) through one in-process sidecar
on ephemeral ports: ``adaptive`` runs the sidecar's default policy, the others are pinned through
the admin API (``SetPolicy`` with an ``engine_id``) to every static arm the engine can play,
no speculation included. The workload drifts as a user would recognise: chat alone, code editing
(copy-heavy) for a small team, maths under heavy load, then summarisation of long documents.
Goodput is tokens per virtual second of each engine, all measured in this run.

The demo compresses time twice. Its engines play ``DEMO_TIME_SCALE`` wall seconds per virtual second
(at most twice real time: 40 s of an H100's traffic; its 18 engines in one process take about 40 s
of wall time on a 2-core machine, where they cannot keep up with the pace), and a few virtual seconds stand for a
traffic phase that would last minutes. So that the default policy gets as many decision rounds per
phase as it would in production, its decision interval and dwell are shortened by ``DEMO_SPEEDUP``
(in virtual time; the sidecar's clock is wall time, so by ``DEMO_SPEEDUP / DEMO_TIME_SCALE`` on it)
and its discount is re-timed to keep the same memory in seconds (``discount ** (1 / speedup)`` per
round). Nothing else changes.

A phase an engine never stepped in (a run so short that one step spans it) has no goodput: null
in the result (``--json``) and "-" in the table, never a 0 that would read as a measurement, and
the per-phase ratios and best static arm skip it.

The demo ends at once, with one line and exit 1 (``controllerctl``), when an engine fails, when
its sidecar ends the decision stream (the engines would go on without it, and the figures would not
be the policies'), or when standard output goes away (``| head``); Ctrl-C ends it at any moment
with the sidecar stopped in order and its temporary state directory removed.

The live lines are one per phase and one per real change of the adaptive engine's arms (a context
of the batch size in play that had an arm before), at most one line per ``CHANGE_LINE_S`` of wall
time (changes in between are folded into the next line).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, TextIO

import grpc

from controller import _interrupt as interrupt
from controller.client import AdminClient
from controller.config import SidecarConfig
from controller.embedded.core import DEFAULT_ARMS, EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import Workload, demo_workload
from controller.server import SidecarServer
from policies.context import Context
from policies.presets import load_preset
from policies.spec import PolicySpec, render_policy, static_policy
from sim.files import replace_file, temporary_directory

ADAPTIVE = "adaptive"
#: Every arm the demo engine can play, no speculation first.
STATIC_ARMS: tuple[str, ...] = ("off", *(str(a) for a in DEFAULT_ARMS if a.speculates))
DEMO_SPEEDUP = 5.0
#: Wall seconds per virtual second of the engines (0.5: twice real time).
DEMO_TIME_SCALE = 0.5
#: Virtual seconds of traffic (at least DEFAULT_SECONDS * DEMO_TIME_SCALE of wall time).
DEFAULT_SECONDS = 40.0
#: Wall seconds between two live lines about arm changes.
CHANGE_LINE_S = 1.0


def demo_policy(base: PolicySpec | None = None, *, speedup: float = DEMO_SPEEDUP) -> PolicySpec:
    """The default policy re-timed for the demo's compressed clock (see the module docstring)."""
    spec = base or load_preset("default")
    params = dict(spec.params)
    if "discount" in params:
        params["discount"] = round(float(params["discount"]) ** (1.0 / speedup), 4)
    return replace(
        spec,
        decision_interval_s=spec.decision_interval_s / speedup,
        min_dwell_s=spec.min_dwell_s / speedup,
        params=params,
        source_yaml="",
    )


def engine_name(arm: str) -> str:
    return f"static-{arm.replace(':', '-')}"


@dataclass(frozen=True, slots=True)
class EngineRow:
    engine: str
    policy: str
    goodput_tok_s: float
    speedup_vs_no_spec: float
    acceptance_rate: float
    tokens: int
    virtual_s: float
    #: None for a phase the engine never stepped in (a run so short that one step spans a phase).
    phase_goodput_tok_s: tuple[float | None, ...]
    arm_steps: dict[str, int]
    directives: int
    fallbacks: int
    dropped_steps: int

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "policy": self.policy,
            "goodput_tok_s": round(self.goodput_tok_s, 2),
            "speedup_vs_no_spec": round(self.speedup_vs_no_spec, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens": self.tokens,
            "virtual_s": round(self.virtual_s, 3),
            "phase_goodput_tok_s": [None if g is None else round(g, 2) for g in self.phase_goodput_tok_s],
            "arm_steps": dict(sorted(self.arm_steps.items())),
            "directives": self.directives,
            "fallbacks": self.fallbacks,
            "dropped_steps": self.dropped_steps,
        }


def _phase_label(workload: Workload, i: int) -> str:
    p = workload.schedule.phases[i]
    return f"{p.name}, concurrency {p.concurrency}"


class _Printer:
    def __init__(self, out: TextIO | None) -> None:
        self.out = out

    def __call__(self, line: str) -> None:
        if self.out is not None:
            print(line, file=self.out, flush=True)


def _bucket_holds(label: str, batch: int) -> bool:
    """Whether a batch bucket label ("1", "2-4", "33+") covers ``batch``."""
    lo, _, hi = label.partition("-")
    if lo.endswith("+"):
        return batch >= int(lo[:-1])
    return int(lo) <= batch <= int(hi or lo)


async def _watch(admin: AdminClient, engine: EmbeddedEngine, say: _Printer) -> None:
    """One compact line per real change of the adaptive engine's arms (rate-limited, see module)."""
    current: dict[str, str] = {}
    pending: dict[str, tuple[str, str]] = {}
    last_line = -float("inf")
    loop = asyncio.get_running_loop()
    async for d in admin.watch_decisions(ADAPTIVE):
        core = engine.core
        batch = core.workload.schedule.phases[core.phase].concurrency
        for c in d.arms:
            arm = "off" if c.arm.method == "off" else f"{c.arm.method}:{c.arm.k}"
            before = current.get(c.context)
            current[c.context] = arm
            bucket = Context.parse(c.context).bucket
            if before is None or before == arm or c.goodput_tok_s <= 0 or not _bucket_holds(bucket, batch):
                continue
            first = pending.get(c.context, (before, arm))[0]
            if first == arm:
                pending.pop(c.context, None)  # back where it was since the last line: no change
            else:
                pending[c.context] = (first, arm)
        now = loop.time()
        if pending and now - last_line >= CHANGE_LINE_S:
            items = [f"{ctx} {a}→{b}" for ctx, (a, b) in sorted(pending.items())]
            more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
            say(f"  t={core.totals.virtual_s:5.1f}s  " + "; ".join(items[:3]) + more)
            pending.clear()
            last_line = now


async def _phases(engine: EmbeddedEngine, workload: Workload, say: _Printer) -> None:
    seen = -1
    while True:
        p = engine.core.phase
        if p != seen:
            seen = p
            say(f"── phase {p + 1}/{len(workload.schedule.phases)}: {_phase_label(workload, p)}")
        await asyncio.sleep(0.05)


async def run_demo(
    *,
    seconds: float = DEFAULT_SECONDS,
    seed: int = 0,
    out: TextIO | None = sys.stdout,
    time_scale: float = DEMO_TIME_SCALE,
) -> dict[str, Any]:
    """Run the demo; returns the result document (what ``--json`` prints). Live lines go to ``out``."""
    if seconds <= 0:
        raise ValueError(f"--seconds must be > 0, got {seconds}")
    say = _Printer(out)
    wall0 = time.monotonic()
    workload = demo_workload(seed=seed, duration_s=seconds)
    # The policy's clock is the sidecar's (wall time); its rounds are meant per virtual second.
    speedup = DEMO_SPEEDUP / time_scale if time_scale > 0 else DEMO_SPEEDUP
    adaptive_spec = demo_policy(speedup=speedup)
    with temporary_directory(prefix="speccontrol-demo-") as state_dir:
        config = SidecarConfig(
            engine_listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            metrics_listen="",
            state_dir=state_dir,
            snapshot_interval_s=3600.0,
            decision_tick_s=0.05,
            # One policy per engine is set up front, more than the default burst of changes.
            max_policy_changes_per_s=1000.0,
        )
        sidecar = SidecarServer(config=config)
        await _start(sidecar)
        try:
            async with AdminClient(target=sidecar.admin_target) as admin:
                await _set_policies(admin, adaptive_spec, speedup)
                names = [ADAPTIVE, *(engine_name(a) for a in STATIC_ARMS)]
                link = LinkSettings(time_scale=time_scale, await_directive_s=5.0)
                engines = {
                    n: EmbeddedEngine(
                        target=sidecar.engine_target,
                        settings=EngineSettings(engine_id=n, plain=n != ADAPTIVE),
                        workload=workload,
                        link=link,
                    )
                    for n in names
                }
                say(
                    f"speccontrol demo: sidecar {sidecar.engine_target}, {len(engines)} simulated engines, "
                    f"{seconds:g} s of traffic at {1 / time_scale if time_scale > 0 else 0:g}x real time (seed {seed}); "
                    f"live arms of the '{ADAPTIVE}' engine:"
                )
                side = [
                    asyncio.create_task(_watch(admin, engines[ADAPTIVE], say)),
                    asyncio.create_task(_phases(engines[ADAPTIVE], workload, say)),
                ]
                try:
                    for e in engines.values():
                        await e.start()
                    await _until_done(engines, side)
                finally:
                    for t in side:
                        t.cancel()
                    # (their failure, if any, is what _until_done raised: awaited here, it would
                    # replace that and leave the engines running)
                    await asyncio.gather(*side, return_exceptions=True)
                    for e in engines.values():
                        with contextlib.suppress(Exception):  # a failed engine: _until_done said so
                            await e.stop()
        finally:
            await _stop(sidecar)
    return _result(engines, workload, seconds=seconds, seed=seed, wall_s=time.monotonic() - wall0)


async def _start(sidecar: SidecarServer) -> None:
    """``sidecar.start()``, run to its end even when the demo is cancelled meanwhile (Ctrl-C in its
    first second): a gRPC server cancelled inside its own start cannot be shut down (its shutdown
    raises InvalidStateError, printed as "Task exception was never retrieved" or a traceback). So the
    start finishes (a fraction of a second), the sidecar is stopped, and the cancellation goes on."""
    task = asyncio.ensure_future(sidecar.start())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # a start that failed has cleaned up after itself
            await task
            await _stop(sidecar)
        raise


async def _stop(sidecar: SidecarServer) -> None:
    """Stop the sidecar, its snapshot writes included, before its temporary state directory goes.
    Stopping cancels its tick while a snapshot write it started (the acknowledgements wait for one)
    runs on a worker thread, which went on writing in the directory being removed: the removal failed
    ("Directory not empty", exit 1 in place of the result) and left the directory in /tmp. The final
    snapshot takes the store's lock after that write (a write queued behind it is older, and skipped)."""
    await sidecar.stop(snapshot=True)


async def _set_policies(admin: AdminClient, adaptive: PolicySpec, speedup: float) -> None:
    """The adaptive engine's policy (the sidecar's default) and one static policy per other engine.
    The sidecar writes each through to its state directory: where that cannot be written (a full
    /tmp) it refuses the change, which came out as a gRPC traceback; now a RuntimeError (exit 1)."""
    try:
        await admin.set_policy(render_policy(adaptive), source=f"demo: default x{speedup:g}")
        for arm in STATIC_ARMS:
            spec = static_policy(arm)
            await admin.set_policy(render_policy(spec), source=spec.name, engine_id=engine_name(arm))
    except grpc.aio.AioRpcError as e:
        if e.code() in _GONE:  # not a refusal: the sidecar stopped (or its link broke) meanwhile
            raise RuntimeError(f"the sidecar stopped before it took the demo's policies: {_why(e)}") from None
        raise RuntimeError(f"the demo's sidecar refused its policies: {_why(e)}") from None


# The codes of a call the sidecar never answered: it stopped during the call (CANCELLED) or before
# it (UNAVAILABLE). Any other code is the sidecar's answer.
_GONE = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE})


def _why(e: BaseException) -> str:
    """An exception in one line: a gRPC status and its details, else its type and first line."""
    if isinstance(e, grpc.aio.AioRpcError):
        details = (e.details() or "").strip().splitlines()
        return f"{e.code().name}: {details[0]}" if details else e.code().name
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


async def _until_done(engines: dict[str, EmbeddedEngine], side: list[asyncio.Task[None]]) -> None:
    """Until every engine has played its schedule. The first engine or live-line task that fails ends
    the demo at once (not after the other engines' whole run), as a RuntimeError naming it (exit 1),
    or the OSError of an output that went away (a closed pipe, a full disk)."""
    runs = {asyncio.ensure_future(e.wait()): name for name, e in engines.items()}
    watched: set[asyncio.Future[None]] = {*runs, *side}
    try:
        while not all(r.done() for r in runs):
            done, watched = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                e = None if t.cancelled() else t.exception()
                if e is None:
                    if t in runs or all(r.done() for r in runs):
                        continue
                    # The sidecar ends the decision stream only when it stops: the engines would go
                    # on without it, on their last directives, and the figures would not be the
                    # policies'.
                    raise RuntimeError("the sidecar ended its decision stream mid-run")
                if t in runs:
                    raise RuntimeError(f"engine {runs[t]} failed: {_why(e)}") from e
                if isinstance(e, OSError):
                    raise e
                raise RuntimeError(f"the sidecar's decision stream failed: {_why(e)}") from e
    finally:
        for r in runs:
            r.cancel()
            if r.done() and not r.cancelled():
                r.exception()  # (retrieved: a second failure at once is not "never retrieved")


def _result(
    engines: dict[str, EmbeddedEngine], workload: Workload, *, seconds: float, seed: int, wall_s: float
) -> dict[str, Any]:
    n_phases = len(workload.schedule.phases)
    off = engines[engine_name("off")].totals.goodput
    rows = []
    for name, e in engines.items():
        t = e.totals
        rows.append(
            EngineRow(
                engine=name,
                policy="default (adaptive)" if name == ADAPTIVE else f"static {name.removeprefix('static-')}",
                goodput_tok_s=t.goodput,
                speedup_vs_no_spec=t.goodput / off if off > 0 else 0.0,
                acceptance_rate=t.acceptance_rate,
                tokens=t.tokens,
                virtual_s=t.virtual_s,
                phase_goodput_tok_s=tuple(
                    t.phase_goodput(i) if t.phase_s.get(i, 0.0) > 0 else None for i in range(n_phases)
                ),
                arm_steps=dict(t.arm_steps),
                directives=t.directives,
                fallbacks=t.fallbacks,
                dropped_steps=e.stats.dropped_steps,
            )
        )
    statics = [r for r in rows if r.engine != ADAPTIVE]
    best = max(statics, key=lambda r: r.goodput_tok_s)
    worst = min(statics, key=lambda r: r.goodput_tok_s)
    adaptive = next(r for r in rows if r.engine == ADAPTIVE)
    phase_best = [_phase_best(statics, i) for i in range(n_phases)]
    return {
        "seconds": seconds,
        "seed": seed,
        "wall_s": round(wall_s, 2),
        "profile": engines[ADAPTIVE].core.profile.name,
        "phases": [_phase_label(workload, i) for i in range(n_phases)],
        "phase_starts_s": [round(t, 3) for t in workload.schedule.starts()],
        "engines": [r.to_json() for r in rows],
        "goodput_over_time": {
            name: [[round(t, 3), round(g, 1)] for t, g in e.totals.goodput_over_time()]
            for name, e in engines.items()
        },
        "phase_best_static": [None if r is None else r.engine for r in phase_best],
        "adaptive_vs_best_static_per_phase": [
            _phase_ratio(adaptive.phase_goodput_tok_s[i], None if r is None else r.phase_goodput_tok_s[i])
            for i, r in enumerate(phase_best)
        ],
        "best_static": best.engine,
        "worst_static": worst.engine,
        "adaptive_vs_best_static": round(adaptive.goodput_tok_s / best.goodput_tok_s, 4)
        if best.goodput_tok_s
        else 0.0,
        "adaptive_vs_worst_static": round(adaptive.goodput_tok_s / worst.goodput_tok_s, 4)
        if worst.goodput_tok_s
        else 0.0,
    }


def _phase_best(statics: list[EngineRow], i: int) -> EngineRow | None:
    """The static engine with the most goodput in phase ``i``, of those that stepped in it."""
    played = [r for r in statics if r.phase_goodput_tok_s[i] is not None]
    return max(played, key=lambda r: r.phase_goodput_tok_s[i] or 0.0) if played else None


def _phase_ratio(adaptive: float | None, best: float | None) -> float | None:
    """Adaptive over the phase's best static arm; None (not 0) when either was not measured."""
    return round(adaptive / best, 4) if adaptive is not None and best else None


def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(result: dict[str, Any]) -> str:
    n_phases = len(result["phases"])
    head = [
        "engine",
        "policy",
        "goodput tok/s",
        "vs off",
        "vs best static",
        "accept",
        *(f"phase {i + 1}" for i in range(n_phases)),
    ]
    by_name = {r["engine"]: r for r in result["engines"]}
    best_g = by_name[result["best_static"]]["goodput_tok_s"]
    body = []
    for r in result["engines"]:
        body.append(
            [
                r["engine"],
                r["policy"],
                f"{r['goodput_tok_s']:.0f}",
                f"{r['speedup_vs_no_spec']:.2f}x",
                f"{r['goodput_tok_s'] / best_g:.3f}" if best_g else "-",
                f"{r['acceptance_rate']:.2f}",
                *(_cell(g, ".0f") for g in r["phase_goodput_tok_s"]),
            ]
        )
    ratios = result["adaptive_vs_best_static_per_phase"]
    body.append(
        [
            "adaptive / best",
            "per phase: best static's",
            "",
            "",
            f"{result['adaptive_vs_best_static']:.3f}",
            "",
            *(_cell(x, ".3f") for x in ratios),
        ]
    )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        "  ".join(
            str(x).ljust(w) if i < 2 else str(x).rjust(w)
            for i, (x, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [head, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    lines.append("")
    lines.extend(
        f"phase {i + 1}: {p}; best static {b.removeprefix('static-') if b else '- (no step in it)'}"
        for i, (p, b) in enumerate(zip(result["phases"], result["phase_best_static"], strict=True))
    )
    lines.append(f"goodput = tokens per virtual second; wall time {result['wall_s']:.1f} s")
    measured = [x for x in ratios if x is not None]
    lines.append(
        f"adaptive vs best static: {result['adaptive_vs_best_static']:.3f} ({result['best_static']}); "
        f"worst phase: {_cell(min(measured) if measured else None, '.3f')}"
    )
    lines.append(
        f"adaptive vs worst static: {result['adaptive_vs_worst_static']:.2f} ({result['worst_static']})"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Goodput over virtual time per engine, with the phase boundaries, as an image at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install 'speccontrol[sim]')") from None
    fig, ax = plt.subplots(figsize=(11, 5.5))
    for name, series in result["goodput_over_time"].items():
        if not series:
            continue
        t = [x[0] for x in series]
        g = [x[1] for x in series]
        if name == ADAPTIVE:
            ax.plot(t, g, color="black", linewidth=2.4, label="adaptive (default policy)", zorder=5)
        elif name == engine_name("off"):
            ax.plot(t, g, color="grey", linestyle="--", linewidth=1.2, label="no speculation")
        else:
            ax.plot(t, g, linewidth=0.9, alpha=0.75, label=name.removeprefix("static-").replace("-", ":"))
    top = ax.get_ylim()[1]
    for i, (start, label) in enumerate(zip(result["phase_starts_s"], result["phases"], strict=True)):
        if i:
            ax.axvline(start, color="grey", linewidth=0.8)
        ax.text(start + 0.1, top * 0.97, f"{i + 1}: {label}", fontsize=8, va="top")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("goodput (tokens / s)")
    ax.set_title(
        f"speccontrol demo, {result['profile']}: adaptive {result['adaptive_vs_best_static']:.2f}x "
        f"the best static arm ({result['best_static'].removeprefix('static-')})"
    )
    ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)  # drawn first: a failure leaves an old image as it was
    finally:
        plt.close(fig)
    with _sigint_held():
        replace_file(path, buf.getvalue())


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Ctrl-C waits for the block's end, then acts as it would have: ``replace_file`` interrupted
    between writing ``FILE.tmp`` and renaming it over ``FILE`` left the ``.tmp`` in the user's
    directory. (A Python handler, not a signal mask: gRPC's threads would take a masked SIGINT.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if pressed:
        if callable(old):
            old(signal.SIGINT, None)  # Python's own: KeyboardInterrupt
        elif old == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)  # after a first Ctrl-C: the second ends the process


def main(
    *,
    seconds: float = DEFAULT_SECONDS,
    as_json: bool = False,
    seed: int = 0,
    out: TextIO | None = None,
    plot_path: str | None = None,
) -> int:
    stream = out if out is not None else sys.stdout
    result = interrupt.run(run_demo(seconds=seconds, seed=seed, out=None if as_json else stream))
    if plot_path:
        plot(result, plot_path)
    if as_json:
        print(json.dumps(result, indent=2), file=stream)
    else:
        print("", file=stream)
        print(format_table(result), file=stream)
    return 0
