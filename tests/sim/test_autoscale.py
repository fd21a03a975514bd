"""The HPA model and the fleet's fluid queue (synthetic replicas; the measured ones are slow)."""

from pathlib import Path

import numpy as np
import pytest

from sim.autoscale import (
    Hpa,
    HpaSettings,
    LearningCurve,
    ReplicaMeasure,
    load_triples,
    simulate_fleet,
    summarise,
)


def flat(eff: float, until: float = 0.0) -> LearningCurve:
    """Efficiency ``eff`` for the first ``until`` seconds, then 1."""
    t = np.array([0.0, until, until + 1e-6, until + 1.0]) if until else np.array([0.0, 1.0])
    e = np.array([eff, eff, 1.0, 1.0]) if until else np.array([1.0, 1.0])
    return LearningCurve(t_s=t, efficiency=e, steady_tok_s=1000.0)


def replica(cold_eff: float = 0.5, learn_s: float = 60.0) -> ReplicaMeasure:
    # 1000 tok/s, 100 tokens per request: 10 requests/s per replica.
    return ReplicaMeasure(1000.0, 100.0, 2.0, cold=flat(cold_eff, learn_s), warm=flat(1.0))


def test_ratio_rule_with_tolerance() -> None:
    hpa = Hpa(HpaSettings(target_queue_wait_s=0.5, target_utilisation=None))
    assert hpa.decide(0.0, 4, 1.0) == 8
    assert hpa.decide(15.0, 4, 0.52) == 4  # within 10 %


def test_scale_up_is_rate_limited() -> None:
    hpa = Hpa(HpaSettings(target_queue_wait_s=0.5, target_utilisation=None, max_replicas=100))
    assert hpa.decide(0.0, 2, 50.0) == 6  # max(2 + 4 pods, 2 x 200 %)
    assert hpa.decide(15.0, 10, 50.0) == 20


def test_scale_down_waits_for_the_stabilisation_window() -> None:
    hpa = Hpa(HpaSettings(target_queue_wait_s=0.5, target_utilisation=None, scale_down_window_s=300.0))
    assert hpa.decide(0.0, 4, 1.0) == 8
    assert hpa.decide(100.0, 8, 0.0) == 8  # the window still holds the recommendation of 8
    assert hpa.decide(301.0, 8, 0.0) == 1


def test_scale_down_never_rises_above_the_current_count() -> None:
    # The window holds the raw recommendation of 16 that the scale-up limit cut to 6; a later scale-down
    # recommendation returned that 16, a scale-up past the limit.
    hpa = Hpa(HpaSettings(target_queue_wait_s=0.5, target_utilisation=None, scale_down_window_s=300.0))
    assert hpa.decide(0.0, 2, 4.0) == 6  # ceil(2 x 8) = 16, limited to max(2 + 4, 2 x 200 %)
    assert hpa.decide(15.0, 6, 0.3) == 6  # recommends ceil(6 x 0.6) = 4; stabilised at 6, not 16
    assert hpa.decide(30.0, 6, 0.3) == 6


def test_the_larger_recommendation_wins() -> None:
    hpa = Hpa(HpaSettings(target_queue_wait_s=0.5, target_utilisation=0.8))
    assert hpa.decide(0.0, 4, 0.0, 1.0) == 5  # no queue, but every slot busy: ceil(4 x 1.0 / 0.8)


def test_invalid_settings() -> None:
    with pytest.raises(ValueError):
        HpaSettings(min_replicas=5, max_replicas=2)


def test_learning_curve() -> None:
    c = flat(0.5, 60.0)
    assert c.at(10.0) == 0.5 and c.at(1e6) == 1.0
    assert c.time_to(0.95) == pytest.approx(60.0, abs=1e-3)


def test_load_triples_scales_out_drains_and_warm_starts_help() -> None:
    t = np.arange(0.0, 1500.0)
    arrivals = load_triples(t, base_rps=12.0, at_s=300.0)  # 2 replicas at 60 %, then 36 req/s
    assert arrivals[299] == 12.0 and arrivals[300] == 36.0
    settings = HpaSettings(startup_s=120.0, min_replicas=2)
    cold = simulate_fleet(replica=replica(), arrival_rps=arrivals, hpa=settings, warm_start=False)
    warm = simulate_fleet(replica=replica(), arrival_rps=arrivals, hpa=settings, warm_start=True)
    for s in (cold, warm):
        assert s.replicas[299] == 2 and s.replicas.max() >= 4
        assert s.queue_wait_s[310] > 0 and s.queue_wait_s[-1] == 0.0
        assert s.ready[-1] * 10.0 >= 36.0  # enough serving capacity at the end
    # New replicas at half speed for their first minute leave a longer queue than warm ones.
    assert summarise(warm, 300.0)["queue_wait_s_integral"] < summarise(cold, 300.0)["queue_wait_s_integral"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # the load triples after the run ends: the summary of the step had no samples (a traceback)
        (["--duration", "60"], "--triple-at 300: must be before the run ends (--duration 60)\n"),
        (["--duration", "300"], "--triple-at 300: must be before the run ends (--duration 300)\n"),
        (
            ["--json", "/nonexistent/a.json"],
            "--json /nonexistent/a.json: no directory /nonexistent to write it in\n",
        ),
    ],
)
def test_a_run_that_cannot_report_is_refused_before_it_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from sim.cli import main

    assert main(["sim", "autoscale", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err == says and "measuring" not in captured.err


def test_a_profile_whose_steps_take_no_time_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # LearningCurve.at raised IndexError (no samples) after a 7 s measurement.
    import yaml

    from sim.cli import main
    from sim.costmodel import _profile_dir

    doc = yaml.safe_load((_profile_dir() / "llama-3.1-8b-h100.yaml").read_text())
    doc["target"] = {"kv_s_per_token": 0, "batched_s_per_token": 0, "const_s": 0}
    doc["overhead_s"] = 0
    p = tmp_path / "zero.yaml"
    p.write_text(yaml.safe_dump(doc))
    argv = ["sim", "autoscale", "--profile", str(p), "--duration", "60", "--triple-at", "10"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    # FILE:LINE: the line of the field the message names
    assert (
        captured.err.startswith(f"{p}:")
        and ": target.const_s: a step of one request takes 0 s" in captured.err
    )
    assert "measuring" not in captured.err


@pytest.mark.parametrize("fails", ["autoscale.md", "a.json"])
def test_a_write_that_fails_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fails: str
) -> None:
    # The plot and JSON were written one by one: a failure on the next left a half report (and the
    # directory made for it), exit 1 after a traceback-free but partial run.
    import sim.autoscale_cli as cli
    from sim.cli import main
    from sim.files import replace_file

    def flaky(path: Path, data: bytes) -> None:
        if Path(path).name == fails:
            raise OSError(28, "No space left on device", str(path))
        replace_file(path, data)

    monkeypatch.setattr(cli, "replace_file", flaky)
    out = tmp_path / "new" / "report"
    argv = ["sim", "autoscale", "--duration", "20", "--triple-at", "10", "--requests", "256",
            "--out", str(out)]  # fmt: skip
    assert main([*argv, "--json", str(tmp_path / "a.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and fails in err
    assert list(tmp_path.iterdir()) == []  # neither the files nor the directories it made
