"""benchmarks/plugin_ab.py: each tree's own benchmark runs in its own process, one step at a time and
never two at once, and the figures are each tree's; a tree whose benchmark cannot be gated is refused.

Fake trees stand in for checkouts (a benchmark that logs when each step starts and ends); one run on
this checkout against itself checks the real benchmark goes through (figures, not their values)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "plugin_ab.py"

_FAKE_BENCH = """
import os

class HookClock:
    def __init__(self):
        self.on = False
        self.cpu, self.calls, self.overhead_cpu = [], [], 0.0

    def install(self):
        self.on = True
        self.on = False


def _scripted(batch, history, steps, mode):
    clock = HookClock()
    clock.install()
    tag = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.environ["PLUGIN_AB_TEST_LOG"], "a") as log:
        for step in range(steps + 10):
            if GATED:
                clock.on = step >= 10
            log.write(f"{tag} start\\n")
            log.flush()
            log.write(f"{tag} end\\n")
            log.flush()
            if step >= 10:
                clock.cpu.append(COST * batch * 1e-6)
                clock.calls.append(0)
    clock.on = False
    return {"cpu_median": COST * batch, "cpu_us_by_hook": {"after_update": COST * batch}}
"""


def _fake_tree(root: Path, name: str, cost: float, gated: bool = True) -> Path:
    tree = root / name
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "controller" / "vllm").mkdir(parents=True)
    for f in ("controller/__init__.py", "controller/vllm/__init__.py", "controller/vllm/engine_hooks.py"):
        (tree / f).write_text("")
    (tree / "benchmarks" / "plugin_overhead.py").write_text(f"GATED = {gated}\nCOST = {cost}\n{_FAKE_BENCH}")
    return tree


def _run(*args: str, log: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PLUGIN_AB_TEST_LOG": str(log or os.devnull)}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )


def test_the_trees_take_turns_a_whole_step_each_and_report_their_own_figures(tmp_path: Path) -> None:
    before, after = _fake_tree(tmp_path, "before", 2.0), _fake_tree(tmp_path, "after", 1.0)
    log = tmp_path / "steps.log"
    out = tmp_path / "ab.json"
    proc = _run(str(before), str(after), "--batches", "2,4", "--steps", "30", "--rounds", "2",
                "--json", str(out), log=log)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().split()
    pairs = list(zip(lines[0::2], lines[1::2], strict=True))
    # A step starts and ends before any other starts (never two at once) ...
    events = list(zip(pairs[0::2], pairs[1::2], strict=False))
    assert all(a[0] == b[0] and a[1] == "start" and b[1] == "end" for a, b in events)
    steps = [a[0] for a, _ in events]
    # ... every step of both trees ran (2 batches x 2 rounds x (30 + 10 warm-up) steps) ...
    assert steps.count("before") == steps.count("after") == 2 * 2 * 40
    # ... and once both are going, they take turns: neither runs more than twice in a row (the
    # order flips every FLIP_EVERY steps).
    assert max(len(list(run)) for _, run in itertools.groupby(steps)) <= 2
    doc = json.loads(out.read_text())
    for b in (2, 4):
        r = doc["batches"][str(b)]
        assert r["before_us"] == 2.0 * b and r["after_us"] == 1.0 * b
        assert r["ratio"] == 0.5 and r["paired_step_ratio"] == 0.5
        assert r["before_rounds_us"] == [2.0 * b] * 2
    assert "x0.5" in proc.stdout


def test_a_tree_whose_steps_cannot_be_gated_is_refused(tmp_path: Path) -> None:
    good, bad = _fake_tree(tmp_path, "good", 1.0), _fake_tree(tmp_path, "bad", 1.0, gated=False)
    proc = _run(str(good), str(bad), "--batches", "2", "--steps", "5", "--rounds", "1")
    assert proc.returncode == 1
    assert "does not set clock.on each step" in proc.stderr


def test_this_checkout_against_itself(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    proc = _run(str(ROOT), str(ROOT), "--batches", "2", "--steps", "12", "--rounds", "1", "--history", "40",
                "--mode", "composite-sync", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["batches"]["2"]
    assert r["before_us"] > 0 and r["after_us"] > 0
    assert set(r["after_by_hook"]) >= {"after_update", "choose_drafts"}


def test_cold_caches_need_a_benchmark_that_can_evict_them(tmp_path: Path) -> None:
    a, b = _fake_tree(tmp_path, "a", 1.0), _fake_tree(tmp_path, "b", 1.0)
    proc = _run(str(a), str(b), "--batches", "2", "--steps", "5", "--rounds", "1", "--cold-mb", "1")
    assert proc.returncode == 1
    assert "has no cold_mb" in proc.stderr
