"""``controllerctl demo``: a sidecar and several embedded engines over the real gRPC path.

All engines replay the same seeded traffic (common random numbers) through one in-process sidecar on
ephemeral ports: ``adaptive`` runs the sidecar's default policy, the others are pinned to static
arms through the admin API (``SetPolicy`` with an ``engine_id``). The traffic drifts (chat at batch 2,
code at batch 8, then a large batch of text that drafts badly), so the best arm changes over time.
Goodput is tokens per virtual second of each engine, all measured in this run.

The demo compresses time: a few virtual seconds stand for a traffic phase that would last minutes.
So that the default policy gets as many decision rounds per phase as it would in production, its
decision interval and dwell are shortened by ``DEMO_SPEEDUP`` and its discount is re-timed to keep
the same memory in seconds (``discount ** (1 / DEMO_SPEEDUP)`` per round). Nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, TextIO

from controller.client import AdminClient
from controller.config import SidecarConfig
from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import Workload, demo_workload
from controller.presets import load_preset
from controller.sidecar import Sidecar
from policies.spec import PolicySpec, render_policy, static_policy

ADAPTIVE = "adaptive"
STATIC_ARMS: tuple[str, ...] = ("off", "eagle3:1", "eagle3:2", "eagle3:3", "eagle3:4", "ngram:2", "ngram:4")
DEMO_SPEEDUP = 5.0
DEFAULT_SECONDS = 20.0


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
    phase_goodput_tok_s: tuple[float, ...]
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
            "phase_goodput_tok_s": [round(g, 2) for g in self.phase_goodput_tok_s],
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


async def _watch(admin: AdminClient, engine: EmbeddedEngine, say: _Printer) -> None:
    """One compact line per change of the adaptive engine's arms, in contexts with data."""
    current: dict[str, str] = {}
    last_acc = last_drafted = 0
    async for d in admin.watch_decisions(ADAPTIVE):
        changed = []
        for c in d.arms:
            arm = "off" if c.arm.method == "off" else f"{c.arm.method}:{c.arm.k}"
            if current.get(c.context) != arm and c.goodput_tok_s > 0:
                changed.append(
                    f"{c.context} {current.get(c.context, '-')}→{arm} ({c.goodput_tok_s:.0f} tok/s)"
                )
            current[c.context] = arm
        t = engine.totals
        if changed:
            drafted, acc = t.drafted - last_drafted, t.accepted - last_acc
            rate = f"{acc / drafted:.2f}" if drafted else "-"
            say(
                f"  t={t.virtual_s:5.1f}s v{d.directive.version:<4} accept {rate:>4}  "
                + "; ".join(changed[:3])
            )
            last_drafted, last_acc = t.drafted, t.accepted


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
    time_scale: float = 1.0,
) -> dict[str, Any]:
    """Run the demo; returns the result document (what ``--json`` prints). Live lines go to ``out``."""
    if seconds <= 0:
        raise ValueError(f"--seconds must be > 0, got {seconds}")
    say = _Printer(out)
    wall0 = time.monotonic()
    workload = demo_workload(seed=seed, duration_s=seconds)
    adaptive_spec = demo_policy()
    with tempfile.TemporaryDirectory(prefix="speccontrol-demo-") as state_dir:
        config = SidecarConfig(
            engine_listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            metrics_listen="",
            state_dir=state_dir,
            snapshot_interval_s=3600.0,
            decision_tick_s=0.05,
        )
        sidecar = Sidecar(config=config)
        await sidecar.start()
        try:
            async with AdminClient(target=sidecar.admin_target) as admin:
                await admin.set_policy(
                    render_policy(adaptive_spec), source=f"demo: default x{DEMO_SPEEDUP:g}"
                )
                for arm in STATIC_ARMS:
                    spec = static_policy(arm)
                    await admin.set_policy(render_policy(spec), source=spec.name, engine_id=engine_name(arm))
                names = [ADAPTIVE, *(engine_name(a) for a in STATIC_ARMS)]
                link = LinkSettings(time_scale=time_scale, await_directive_s=5.0)
                engines = {
                    n: EmbeddedEngine(
                        target=sidecar.engine_target,
                        settings=EngineSettings(engine_id=n),
                        workload=workload,
                        link=link,
                    )
                    for n in names
                }
                say(
                    f"speccontrol demo: sidecar {sidecar.engine_target}, {len(engines)} simulated engines, "
                    f"{seconds:g} s of traffic (seed {seed}); live arms of the '{ADAPTIVE}' engine:"
                )
                side = [
                    asyncio.create_task(_watch(admin, engines[ADAPTIVE], say)),
                    asyncio.create_task(_phases(engines[ADAPTIVE], workload, say)),
                ]
                try:
                    for e in engines.values():
                        await e.start()
                    for e in engines.values():
                        await e.wait()
                finally:
                    for t in side:
                        t.cancel()
                    for t in side:
                        with contextlib.suppress(asyncio.CancelledError):
                            await t
                    for e in engines.values():
                        await e.stop()
        finally:
            await sidecar.stop(snapshot=False)
    return _result(engines, workload, seconds=seconds, seed=seed, wall_s=time.monotonic() - wall0)


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
                phase_goodput_tok_s=tuple(t.phase_goodput(i) for i in range(n_phases)),
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
    return {
        "seconds": seconds,
        "seed": seed,
        "wall_s": round(wall_s, 2),
        "phases": [_phase_label(workload, i) for i in range(n_phases)],
        "engines": [r.to_json() for r in rows],
        "best_static": best.engine,
        "worst_static": worst.engine,
        "adaptive_vs_best_static": round(adaptive.goodput_tok_s / best.goodput_tok_s, 4)
        if best.goodput_tok_s
        else 0.0,
        "adaptive_vs_worst_static": round(adaptive.goodput_tok_s / worst.goodput_tok_s, 4)
        if worst.goodput_tok_s
        else 0.0,
    }


def format_table(result: dict[str, Any]) -> str:
    n_phases = len(result["phases"])
    head = [
        "engine",
        "policy",
        "goodput tok/s",
        "vs off",
        "accept",
        *(f"phase {i + 1}" for i in range(n_phases)),
    ]
    body = []
    for r in result["engines"]:
        body.append(
            [
                r["engine"],
                r["policy"],
                f"{r['goodput_tok_s']:.0f}",
                f"{r['speedup_vs_no_spec']:.2f}x",
                f"{r['acceptance_rate']:.2f}",
                *(f"{g:.0f}" for g in r["phase_goodput_tok_s"]),
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
    lines.append("")
    lines.extend(f"phase {i + 1}: {p}" for i, p in enumerate(result["phases"]))
    lines.append(f"goodput = tokens per virtual second; wall time {result['wall_s']:.1f} s")
    lines.append(
        f"adaptive vs best static: {result['adaptive_vs_best_static']:.2f} ({result['best_static']})"
    )
    lines.append(
        f"adaptive vs worst static: {result['adaptive_vs_worst_static']:.2f} ({result['worst_static']})"
    )
    return "\n".join(lines)


def main(
    *, seconds: float = DEFAULT_SECONDS, as_json: bool = False, seed: int = 0, out: TextIO | None = None
) -> int:
    stream = out if out is not None else sys.stdout
    result = asyncio.run(run_demo(seconds=seconds, seed=seed, out=None if as_json else stream))
    if as_json:
        print(json.dumps(result, indent=2), file=stream)
    else:
        print("", file=stream)
        print(format_table(result), file=stream)
    return 0
