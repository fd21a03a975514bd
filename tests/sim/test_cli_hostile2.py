"""Hostile and careless input to the simulator's commands (``sim replay|compare|tune|autoscale``,
``profile fit``) and to profile files: each is refused in one line before any work, or runs to the
right figures, and never replaces a file the command reads.

What must hold: an output naming an input (``--json`` the ``--trace``, ``--out`` the steps) is refused
and the input kept; ``--json`` never lands on the report's files; two runs of one comparison never
share a label; a profile path that is no regular file is refused without reading it; a profile whose
steps outlast an hour is refused naming its field, and an empty optional text is the field left out;
``sim autoscale``'s fleet is the element-by-element loop's to the bit (an hour's run at thousands of
replicas is seconds now), says its progress and takes any target; ``profile fit --draft-cost auto``
keeps the model that fits and says why one cannot; long work says so on a terminal.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from sim.autoscale import HpaSettings, LearningCurve, ReplicaMeasure, load_triples, simulate_fleet
from sim.cli import main
from sim.costmodel import ProfileError, _profile_dir, load_profile, parse_profile
from sim.engines import ENGINES
from sim.steplog import write_steps
from tests.sim.test_fit import ENGINE, TRUE, synthetic, with_durations

LIBRARY = Path(__file__).resolve().parents[2] / "policies" / "library"
QUICK = ["--scenario", "chat", "--requests", "6", "--concurrency", "1", "--no-oracle"]


def _one_line_usage(capsys: pytest.CaptureFixture[str], says: str) -> None:
    err = capsys.readouterr().err
    assert says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


# -- outputs that name an input --------------------------------------------------------------------


def test_replay_json_naming_its_trace_is_refused_and_the_trace_kept(
    tmp_path: Path, hand_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The trace was replaced by the result JSON: "wrote hand.jsonl", exit 0, the recording lost.
    before = hand_trace.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(hand_trace)
    for out in (str(hand_trace), str(link), f"{tmp_path}/../{tmp_path.name}/hand.jsonl"):
        argv = ["sim", "replay", "--trace", str(hand_trace), "--policy", "default", "--json", out]
        assert main(argv) == 2
        _one_line_usage(capsys, f"--json {out}: is the --trace file it reads")
        assert hand_trace.read_bytes() == before


def test_compare_json_naming_a_policy_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pol = tmp_path / "mine.yaml"
    pol.write_text(
        (LIBRARY / "epsilon-greedy.yaml").read_text().replace("name: epsilon-greedy", "name: mine", 1)
    )
    before = pol.read_bytes()
    assert main(["sim", "compare", *QUICK, "--policy", str(pol), "--json", str(pol)]) == 2
    _one_line_usage(capsys, "is the --policy file it reads")
    assert pol.read_bytes() == before


def test_a_report_file_naming_the_trace_is_refused(
    tmp_path: Path, hand_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rep"
    out.mkdir()
    trace = out / "result.json"
    trace.write_bytes(hand_trace.read_bytes())
    argv = ["sim", "replay", "--trace", str(trace), "--policy", "default", "--out", str(out)]
    assert main(argv) == 2
    _one_line_usage(capsys, f"--out {trace}: is the --trace file it reads")
    assert trace.read_bytes() == hand_trace.read_bytes()


def test_tune_out_naming_a_trace_is_refused(hand_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = hand_trace.read_bytes()
    argv = ["sim", "tune", "--policy", "epsilon-greedy", "--param", "epsilon=0.1", "--trace", str(hand_trace)]
    assert main([*argv, "--concurrency", "1", "--jobs", "1", "--out", str(hand_trace)]) == 2
    _one_line_usage(capsys, f"--out {hand_trace}: is the --trace file it reads")
    assert hand_trace.read_bytes() == before


def _steps(tmp_path: Path) -> Path:
    with_durations(tmp_path, synthetic(200, 1), TRUE, noise_s=2e-4, seed=2, cost="per_forward")
    return tmp_path / "steps.jsonl"


def test_profile_fit_out_naming_the_steps_is_refused_and_the_steps_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The recorded steps were replaced by the fitted profile ("wrote steps.jsonl", exit 0).
    steps = _steps(tmp_path)
    before = steps.read_bytes()
    assert main(["profile", "fit", str(steps), "--out", str(steps), "--engine", ENGINE.name]) == 2
    _one_line_usage(capsys, f"--out {steps}: is the steps file it reads")
    assert steps.read_bytes() == before


def test_profile_fit_out_naming_the_base_profile_is_refused_and_the_base_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The base profile was replaced by the fitted one ("wrote mine.yaml", exit 0), its memory, prices
    # and hand-set parameters lost. (--plot cannot name it: a .png is no profile.)
    steps = _steps(tmp_path)
    base = tmp_path / "mine.yaml"
    base.write_text((_profile_dir() / "llama-3.1-8b-h100.yaml").read_text().replace(
        "name: llama-3.1-8b-h100", "name: mine", 1))  # fmt: skip
    before = base.read_bytes()
    argv = ["profile", "fit", str(steps), "--base", str(base), "--out", str(base), "--engine", ENGINE.name]
    assert main(argv) == 2
    _one_line_usage(capsys, f"--out {base}: is the --base file it reads")
    assert base.read_bytes() == before


@pytest.mark.parametrize("name", ["mine.txt", "mine", "Mine.YAML"])
def test_profile_fit_out_that_no_profile_flag_can_read_is_refused(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The profile was fitted and written ("wrote mine.txt", exit 0), but --profile reads a file only by
    # a .yaml or .yml name (any other is a profile name): "unknown profile '.../mine.txt'".
    steps = _steps(tmp_path)
    out = tmp_path / name
    assert main(["profile", "fit", str(steps), "--out", str(out), "--engine", ENGINE.name]) == 2
    _one_line_usage(capsys, f"--out {out}: must name a .yaml or .yml file")
    assert not out.exists()


def test_profile_fit_plot_and_out_on_one_path_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The plot was written, then replaced by the YAML: "wrote p.png and p.png".
    steps = _steps(tmp_path)
    out = tmp_path / "p.png"
    argv = ["profile", "fit", str(steps), "--out", str(out), "--plot", f"{tmp_path}/./p.png"]
    assert main([*argv, "--engine", ENGINE.name]) == 2
    _one_line_usage(capsys, "--out writes the profile there")
    assert not out.exists()


def test_a_fit_outside_the_ranges_names_the_steps_not_an_unwritten_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Durations with no relation to the steps: P-EAGLE's pass fits at 10^5 forwards. The error read
    # "OUT.yaml:29: draft.p_eagle.pass_forwards: ...", a line of a file that was never written.
    recs = synthetic(300, 0)
    rng = np.random.default_rng(0)
    for r in recs:
        r["duration_s"] = float(rng.uniform(1e-6, 3600.0))
    steps = tmp_path / "random.jsonl"
    write_steps(steps, recs)
    out = tmp_path / "r.yaml"
    assert main(["profile", "fit", str(steps), "--out", str(out), "--draft-cost", "per_forward"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{steps}: the fitted profile is outside the cost model's ranges (draft.p_eagle")
    assert f"{out}:" not in err and f"nothing written to {out}" in err and err.count("\n") == 1
    assert not out.exists()


# -- --json against the report ------------------------------------------------------------------


@pytest.mark.parametrize("where", ["DIR/report.md", "DIR/latency_cdf.png"])
def test_json_on_the_reports_files_is_refused_before_the_run(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --json DIR/report.md replaced the report with the JSON without a word (exit 0).
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("old report\n")
    json_path = where.replace("DIR", str(out))
    argv = ["sim", "replay", *QUICK, "--policy", "default", "--out", str(out), "--json", json_path]
    assert main(argv) == 2
    _one_line_usage(capsys, f"--json {json_path}: --out {out} writes there too")
    assert (out / "report.md").read_text() == "old report\n"


def test_json_on_the_out_directory_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --json DIR (made by the report) failed after the run, exit 1, the report written and no JSON.
    out = tmp_path / "rep"
    json_path = str(out)
    argv = ["sim", "replay", *QUICK, "--policy", "default", "--out", str(out), "--json", json_path]
    assert main(argv) == 2
    _one_line_usage(capsys, f"--json {json_path}: --out {out} is there")
    assert not out.exists()


def test_json_on_a_sweeps_report_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    out.mkdir()
    json_path = out / "chat--llama-3.1-8b-h100"
    argv = ["sim", "compare", *QUICK, "--profile", "llama-3.1-8b-h100,llama-3.3-70b-fp8-h200"]
    assert main([*argv, "--out", str(out), "--json", str(json_path), "--jobs", "1"]) == 2
    _one_line_usage(capsys, f"--json {json_path}: --out {out} writes there too")
    assert not any(out.iterdir())


# -- labels -----------------------------------------------------------------------------------------


def test_a_scenario_given_twice_is_named_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # "--trace: two traces named 'chat'" named a flag the command line did not hold.
    argv = ["sim", "compare", "--scenario", "chat,chat", "--requests", "4", "--concurrency", "1"]
    assert main(argv) == 2
    _one_line_usage(capsys, "--scenario: two traces named 'chat': a sweep names its results by them")


def test_two_policies_of_one_name_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A copy of a preset under its own name: two rows "epsilon-greedy @ composite", different figures.
    pol = tmp_path / "eg.yaml"
    text = (LIBRARY / "epsilon-greedy.yaml").read_text()
    pol.write_text(text.replace("epsilon: 0.1", "epsilon: 0.9"))
    argv = ["sim", "compare", *QUICK, "--engine", "composite", "--policy", "epsilon-greedy"]
    assert main([*argv, "--policy", str(pol)]) == 2
    _one_line_usage(capsys, "--policy: 'epsilon-greedy' twice")


def test_an_engine_given_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "compare", *QUICK, "--engine", "composite,composite"]) == 2
    _one_line_usage(capsys, "--engine: 'composite' twice")


# -- profile files ------------------------------------------------------------------------------------


def _shipped(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((_profile_dir() / f"{name}.yaml").read_text())
    return doc


def _unblock(fifo: Path) -> None:
    with contextlib.suppress(OSError):  # ENXIO: nobody reads it (the loader never opened it)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_profile_path_that_is_no_regular_file_is_refused_unread(tmp_path: Path, kind: str) -> None:
    # A FIFO blocked the command forever; a link to /dev/zero was read until memory ran out.
    p = tmp_path / "p.yaml"
    timer = None
    if kind == "fifo":
        os.mkfifo(p)
        # Should the loader open it again, a writer that comes and goes later ends its wait with an
        # empty read (another error, so the test fails), rather than the test hanging.
        timer = threading.Timer(10.0, _unblock, args=(p,))
        timer.daemon = True
        timer.start()
    else:
        p.symlink_to("/dev/zero")
    try:
        with pytest.raises(ProfileError, match=r"p\.yaml: not a regular file"):
            load_profile(str(p))
    finally:
        # (a timer left running was seen by a later test in this worker that asserts no
        # deadline timer outlives its request: tests/sim/test_record_hostile.py)
        if timer is not None:
            timer.cancel()
            timer.join()


def test_a_profile_directory_is_still_named_as_one(tmp_path: Path) -> None:
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(ProfileError, match=r"d\.yaml: cannot read: Is a directory"):
        load_profile(str(tmp_path / "d.yaml"))


@pytest.mark.parametrize(
    ("name", "change", "says"),
    [
        # each figure in its range, together a step of 1e18 s: 0 tok/s and $6e19 per 1M tokens
        (
            "qwen3-coder-30b-a3b-h200",
            lambda d: d["moe"].update(expert_bytes_per_gpu=1e15, bandwidth_bytes_per_s=1.0, efficiency=1e-3),
            r"moe\.bandwidth_bytes_per_s: reading every expert takes 1e\+18 s .* at most 3600 s",
        ),
        (
            "llama-3.1-8b-h100",
            lambda d: (d["target"].update(const_s=3600.0), d.update(overhead_s=3600.0)),
            r"target\.const_s: a step of one request takes 7200 s .* at most 3600 s",
        ),
    ],
)
def test_a_profile_whose_steps_outlast_an_hour_is_refused(name: str, change: Any, says: str) -> None:
    doc = _shipped(name)
    change(doc)
    with pytest.raises(ProfileError, match=says):
        parse_profile(doc, source="p.yaml")


# -- sim autoscale -----------------------------------------------------------------------------------


def test_autoscale_with_no_sample_after_the_load_step_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The fleet is sampled at whole seconds 0 and 1: nothing after 1.2 s, and summarise raised
    # numpy's "zero-size array to reduction operation maximum" after the replays.
    assert main(["sim", "autoscale", "--duration", "1.5", "--triple-at", "1.2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("--triple-at 1.2: after the last second the run samples (1 s of --duration 1.5)")
    assert err.count("\n") == 1 and "measuring" not in err


def _reference_fleet(
    replica: ReplicaMeasure, arrival_rps: np.ndarray, hpa: HpaSettings, warm: bool
) -> dict[str, np.ndarray]:
    """The fleet as an element-by-element loop (how sim.autoscale computed it before arrays)."""
    from collections import deque

    from sim.autoscale import Hpa

    curve = replica.warm if warm else replica.cold
    rps = replica.steady_tok_s / replica.mean_output_tokens
    control = Hpa(hpa)
    control.decide(-hpa.sync_period_s, 2, hpa.target_queue_wait_s, hpa.target_utilisation)
    starts, queue = [-1e9] * 2, 0.0
    waits: deque[float] = deque()
    busy: deque[float] = deque()
    e2e: deque[float] = deque(maxlen=60)
    out: dict[str, list[float]] = {k: [] for k in ("replicas", "ready", "queue", "wait", "p99")}
    for i, arrival in enumerate(arrival_rps):
        now = float(i)
        ages = [now - s - hpa.startup_s for s in starts]
        capacity = sum(rps * curve.at(a) for a in ages if a >= 0) * 1.0
        queue += float(arrival)
        served = min(queue, capacity)
        queue -= served
        wait = queue / capacity if capacity > 0 else queue / max(float(arrival), 1e-9)
        waits.append(wait)
        busy.append(served / capacity if capacity > 0 else 1.0)
        ready = [a for a in ages if a >= 0]
        mean_eff = float(np.mean([curve.at(a) for a in ready])) if ready else 1.0
        e2e.append(wait + replica.service_s / max(mean_eff, 1e-3))
        if i > 0 and now % hpa.sync_period_s < 1.0:
            want = control.decide(now, len(starts), float(np.mean(waits)), float(np.mean(busy)))
            waits.clear()
            busy.clear()
            if want > len(starts):
                starts.extend([now] * (want - len(starts)))
            elif want < len(starts):
                starts = sorted(starts)[:want]
        for k, v in zip(
            out, (len(starts), len(ready), queue, wait, np.percentile(np.asarray(e2e), 99)), strict=True
        ):
            out[k].append(float(v))
    return {k: np.array(v) for k, v in out.items()}


def _learning(rng: np.random.Generator) -> LearningCurve:
    t = np.arange(5.0, 305.0, 5.0)
    eff = np.minimum(1.5, np.linspace(rng.uniform(0.1, 0.9), 1.0, len(t)) + rng.normal(0, 0.05, len(t)))
    return LearningCurve(t_s=t, efficiency=eff, steady_tok_s=1000.0)


@pytest.mark.parametrize(
    ("util", "max_replicas", "startup", "window", "target_util", "seed"),
    [
        (0.6, 16, 120.0, 600.0, 0.8, 0),
        (30.0, 500, 60.0, 300.0, None, 1),
        (100.0, 2000, 10.0, 86400.0, 0.8, 2),
    ],
)
def test_the_fleet_is_the_element_by_element_loop_to_the_bit(
    util: float, max_replicas: int, startup: float, window: float, target_util: float | None, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    rep = ReplicaMeasure(1000.0, 100.0, 2.0, cold=_learning(rng), warm=_learning(rng))
    arrivals = load_triples(np.arange(0.0, 1200.0, 1.0), base_rps=util * 2 * 10.0, at_s=300.0)
    hpa = HpaSettings(
        startup_s=startup,
        scale_down_window_s=window,
        target_utilisation=target_util,
        min_replicas=2,
        max_replicas=max_replicas,
    )
    for warm in (False, True):
        want = _reference_fleet(rep, arrivals, hpa, warm)
        got = simulate_fleet(replica=rep, arrival_rps=arrivals, hpa=hpa, warm_start=warm)
        assert got.replicas.max() > 2  # the fleet scaled: the sums ran over many pods
        for field, key in (("replicas", "replicas"), ("ready", "ready"), ("queue", "queue"),
                           ("queue_wait_s", "wait"), ("p99_e2e_s", "p99")):  # fmt: skip
            assert np.array_equal(getattr(got, field), want[key]), field


def test_the_fleet_reports_progress_over_every_step() -> None:
    rep = ReplicaMeasure(
        1000.0, 100.0, 2.0, cold=_learning(np.random.default_rng(0)), warm=_learning(np.random.default_rng(1))
    )
    arrivals = load_triples(np.arange(0.0, 2500.0, 1.0), base_rps=12.0, at_s=300.0)
    calls: list[int] = []
    simulate_fleet(
        replica=rep, arrival_rps=arrivals, hpa=HpaSettings(), warm_start=False, progress=calls.append
    )
    assert sum(calls) == 2500 and len(calls) == 3


def test_a_top_level_figure_out_of_range_names_its_line(tmp_path: Path) -> None:
    # "p.yaml: profile.overhead_s: ..." had no line, where every other field has one.
    text = (_profile_dir() / "llama-3.1-8b-h100.yaml").read_text()
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s.startswith("overhead_s:"))
    p = tmp_path / "p.yaml"
    p.write_text(text.replace("\noverhead_s: ", "\noverhead_s: .nan #", 1))
    with pytest.raises(
        ProfileError, match=rf"p\.yaml:{line}: profile\.overhead_s: expected a number 0\.\.3600, got nan"
    ):
        load_profile(str(p))


# -- flags ------------------------------------------------------------------------------------------


def test_profile_fit_names_base_when_it_is_no_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "unknown profile 'nope' (known: ...)" did not say which flag.
    steps = _steps(tmp_path)
    assert main(["profile", "fit", str(steps), "--out", str(tmp_path / "o.yaml"), "--base", "nope"]) == 2
    _one_line_usage(capsys, "--base: unknown profile 'nope' (known: ")


def test_tune_requests_without_a_scenario_is_a_usage_error(
    hand_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It was ignored without a word (sim replay|compare refuse it).
    argv = ["sim", "tune", "--policy", "epsilon-greedy", "--param", "epsilon=0.1", "--trace", str(hand_trace)]
    assert main([*argv, "--requests", "5", "--concurrency", "1", "--jobs", "1"]) == 2
    _one_line_usage(capsys, "--requests: applies to --scenario")


def _flat_steps(tmp_path: Path) -> Path:
    """Steps of 32 batch sizes, every method and K, all lasting as long (0.3 ms, flat whatever the
    batch: a fit from them still steps 4096 requests above the sidecar's 50 ns a request)."""
    recs = synthetic(300, 0)
    for r in recs:
        r["duration_s"] = 3e-4
    path = tmp_path / "flat.jsonl"
    write_steps(path, recs)
    return path


def test_steps_that_do_not_grow_with_their_work_are_said_so(tmp_path: Path) -> None:
    # It read "the columns are collinear: record steps at varied batch sizes, with speculative
    # decoding on" of steps at 32 batch sizes, every one drafting.
    from sim.fit import FitError, fit_steps
    from sim.steplog import read_steps

    steps = read_steps(_flat_steps(tmp_path))
    base = load_profile("llama-3.1-8b-h100")
    with pytest.raises(
        FitError, match=r"fits negative \(fixed at 0\) in the per_draft model: the durations do not grow"
    ):
        fit_steps(steps, base=base, engine=ENGINES["stock-vllm"], draft_cost="per_draft")


def test_auto_keeps_the_draft_cost_model_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # per_draft cannot be fitted to these steps, per_forward can: --draft-cost auto (the default)
    # failed as a whole with per_draft's error.
    out = tmp_path / "flat.yaml"
    assert main(["profile", "fit", str(_flat_steps(tmp_path)), "--out", str(out)]) == 0
    assert "draft cost per_forward" in capsys.readouterr().out
    assert load_profile(str(out)).eagle3_cost == "per_forward"


def test_autoscale_json_naming_its_policy_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The policy file was replaced by the figures after the run.
    pol = tmp_path / "mine.yaml"
    pol.write_text((LIBRARY / "default.yaml").read_text())
    before = pol.read_bytes()
    assert main(["sim", "autoscale", "--policy", str(pol), "--json", str(pol)]) == 2
    err = capsys.readouterr().err
    assert err == f"--json {pol}: is the --policy file it reads; name another output\n"
    assert pol.read_bytes() == before


def test_a_file_in_place_of_a_sweeps_report_directory_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found after the run, exit 1, naming "sweep/.chat--llama-3.1-8b-h100.XXXX.tmp/report.md".
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "chat--llama-3.1-8b-h100").write_text("mine")
    argv = ["sim", "compare", *QUICK, "--profile", "llama-3.1-8b-h100,llama-3.3-70b-fp8-h200", "--jobs", "1"]
    assert main([*argv, "--out", str(out)]) == 2
    _one_line_usage(capsys, f"--out {out}: {out / 'chat--llama-3.1-8b-h100'} is a file, not a directory")
    assert sorted(p.name for p in out.iterdir()) == ["chat--llama-3.1-8b-h100"]


@pytest.mark.parametrize("flag", ["--target-wait", "--target-utilisation"])
def test_a_target_of_the_smallest_number_scales_to_the_cap(flag: str) -> None:
    # Any load over a 5e-324 target is an infinite ratio: ceil(inf) raised OverflowError after the
    # replica's 7 s measurement, a traceback.
    from sim.autoscale import Hpa

    settings = {"target_queue_wait_s": 5e-324} if flag == "--target-wait" else {"target_utilisation": 5e-324}
    hpa = Hpa(HpaSettings(**settings, max_replicas=16))  # type: ignore[arg-type]
    assert hpa.decide(0.0, 4, 1.0, 0.5) == 8  # the scale-up limit: 4 + 4 pods
    assert hpa.decide(15.0, 8, 1.0, 0.5) == 16  # then the cap


class _Terminal:
    """stderr as a terminal: what it was written is kept."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


def test_tune_shows_its_progress_on_a_terminal_by_default(
    hand_trace: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A sweep of hours said nothing until it ended, unless --progress was given.
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    argv = [
        "sim",
        "tune",
        "--policy",
        "epsilon-greedy",
        "--param",
        "epsilon=0.1,0.2",
        "--trace",
        str(hand_trace),
    ]
    assert main([*argv, "--concurrency", "1", "--jobs", "1"]) == 0
    assert "100.0%" in term.text and "\r" in term.text  # a bar (a line per job only off a terminal)
    term.text = ""
    assert main([*argv, "--concurrency", "1", "--jobs", "1", "--no-progress"]) == 0
    assert term.text == ""


@pytest.mark.parametrize("key", ["description", "derivation", "api_price"])
def test_an_empty_optional_text_is_the_field_left_out(key: str) -> None:
    # "description:" with no text read "missing field 'description'": there, and optional.
    doc = _shipped("llama-3.1-8b-h100")
    doc[key] = None
    left_out = _shipped("llama-3.1-8b-h100")
    del left_out[key]
    assert parse_profile(doc, source="p.yaml") == parse_profile(left_out, source="p.yaml")


def test_profile_fit_says_what_it_does_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Hundreds of thousands of steps were read and fitted for half a minute without a word.
    steps = _steps(tmp_path)
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert (
        main(["profile", "fit", str(steps), "--out", str(tmp_path / "p.yaml"), "--engine", ENGINE.name]) == 0
    )
    assert term.text == f"reading {steps} ...\nfitting 200 steps (per_forward, per_draft) ...\n"


def test_report_files_names_every_file_a_report_writes(tmp_path: Path) -> None:
    # The --json checks read REPORT_FILES: a plot added to the report and not there would be missed.
    from sim.report import REPORT_FILES

    out = tmp_path / "rep"
    argv = ["sim", "replay", "--scenario", "chat", "--requests", "6", "--concurrency", "1,2"]
    assert main([*argv, "--policy", "default", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(REPORT_FILES)
