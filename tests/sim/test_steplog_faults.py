"""``serve --record-steps`` when its file fails: a write cut short leaves whole lines only, a removed
file is said once and made anew, and nothing raises into the sidecar. Read back (``profile fit``), a
last line cut mid-way is left out and said, never the whole file refused for it."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.arms import Method
from policies.observation import StepObservation
from sim.cli import main
from sim.steplog import StepLogError, StepRecorder, read_steps


def _obs(t: float, n: int = 1) -> StepObservation:
    o = StepObservation.build(
        time_s=t,
        duration_s=0.01,
        traffic_class=["default"] * n,
        method=[Method.EAGLE3] * n,
        k=[2] * n,
        drafted=[2] * n,
        accepted=[1] * n,
        request_id=[f"r{i}" for i in range(n)],
    )
    return dataclasses.replace(o, finished=np.zeros(n, dtype=bool))


def test_a_write_cut_short_leaves_only_whole_lines(tmp_path: Path) -> None:
    """A file-size limit (as a full disk) stops a write mid-line: the half line made profile fit refuse
    the whole file ("invalid JSON ... cut off?")."""
    path = tmp_path / "s.jsonl"
    script = textwrap.dedent(
        f"""
        import logging, resource, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_steplog_faults import _obs
        from pathlib import Path
        from sim.steplog import StepRecorder
        logging.basicConfig(level=logging.ERROR)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        rec = StepRecorder(path=Path({str(path)!r}))
        for i in range(200):
            rec("pod-1", [_obs(float(i), 3)] * 7)
        rec.close()
        print(rec.steps)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("recording stopped after") == 1
    steps = int(r.stdout)
    assert 0 < steps < 1400
    assert read_steps(path).n == steps  # was a StepLogError on the cut line
    assert path.read_bytes().endswith(b"\n")


def test_a_removed_file_is_said_once_and_made_anew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps after a removal went on into the deleted file; the log then said they were in PATH."""
    monkeypatch.setattr(StepRecorder, "CHECK_EVERY_S", 0.0)
    path = tmp_path / "s.jsonl"
    rec = StepRecorder(path=path)
    rec("e", [_obs(0.0)])
    path.unlink()
    with caplog.at_level(logging.WARNING):
        for i in range(1, 6):
            rec("e", [_obs(float(i))])
    rec.close()
    assert caplog.text.count("removed or replaced while recording") == 1
    assert read_steps(path).time_s.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert (rec.steps, rec.steps_at_path) == (6, 5)  # what serve's last line says is in PATH


def test_a_path_that_cannot_be_made_again_stops_the_recording_without_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StepRecorder, "CHECK_EVERY_S", 0.0)
    path = tmp_path / "d" / "s.jsonl"
    path.parent.mkdir()
    rec = StepRecorder(path=path)
    rec("e", [_obs(0.0)])
    path.unlink()
    path.parent.rmdir()
    with caplog.at_level(logging.WARNING):
        for i in range(1, 50):
            rec("e", [_obs(float(i))])
    rec.close()
    assert caplog.text.count("recording stopped after 1 steps") == 1


def test_an_unexpected_error_in_recording_never_reaches_the_sidecar(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only OSError was caught: anything else (here a step the recorder cannot render) failed the
    engine's report."""
    rec = StepRecorder(path=tmp_path / "s.jsonl")
    bad = dataclasses.replace(_obs(0.0), method=np.array([99], dtype=np.int8))
    with caplog.at_level(logging.ERROR):
        rec("e", [bad])
        rec("e", [_obs(1.0)])
    assert caplog.text.count("recording stopped after 0 steps") == 1


def test_a_half_line_a_killed_sidecar_left_is_cut_before_the_next_recording(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """kill -9 inside a write leaves a half line at the end (the kernel ends a write between pages when
    the signal comes; a batch is up to hundreds of KB), and so may a power loss; the restarted sidecar
    appended its first step to it, and the one line that made in the middle of the file had profile
    fit refuse the whole recording."""
    path = tmp_path / "s.jsonl"
    rec = StepRecorder(path=path)
    rec("pod-1", [_obs(float(i), 3) for i in range(3)])
    rec.close()
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[0][:40])  # the killed write's first bytes
    caplog.set_level(logging.WARNING)
    rec = StepRecorder(path=path)  # the restart, on the same file
    rec("pod-1", [_obs(float(i), 3) for i in range(3, 5)])
    rec.close()
    assert read_steps(path).n == 5
    assert "40 bytes" in caplog.text  # what was cut is said


# -- a file still being written (or left by a killed sidecar) read by profile fit ---------------------


def _whole_steps(n: int) -> list[dict[str, Any]]:
    return [
        {
            "engine": "e",
            "time_s": float(i),
            "duration_s": 0.01 + 1e-4 * (1 + i % 16),
            "batch": 1 + i % 16,
            "prefill_tokens": 0,
            "kv_tokens": None,
            "decoded_tokens": 10 * i,
            "method": ["eagle3"] * (1 + i % 16),
            "k": [2] * (1 + i % 16),
            "accepted": [1] * (1 + i % 16),
        }
        for i in range(n)
    ]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_a_half_written_last_line_is_left_out_and_said(tmp_path: Path, cut: float) -> None:
    """A sidecar killed inside a write (or still writing) leaves its last line cut: profile fit refused
    the whole file ("FILE:N: invalid JSON: Unterminated string ..."), every whole step with it."""
    steps = _whole_steps(5)
    text = "".join(json.dumps(s) + "\n" for s in steps)
    last = json.dumps(_whole_steps(6)[5])
    path = tmp_path / "steps.jsonl"
    path.write_text(text + last[: max(1, int(cut * len(last)))])
    said: list[str] = []
    log = read_steps(path, warn=said.append)
    assert log.n == 5
    assert said == [
        f"{path}:6: a half-written last line (no newline ends it): left out, the 5 steps before it read"
    ]


def test_a_bad_line_with_its_newline_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in _whole_steps(5)) + '{"engine": \n')
    with pytest.raises(StepLogError, match=r"steps.jsonl:6: invalid JSON"):
        read_steps(path, warn=lambda _: None)


def test_profile_fit_says_the_half_line_it_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = _whole_steps(300)
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps) + json.dumps(steps[0])[:40])
    out = tmp_path / "mine.yaml"
    assert main(["profile", "fit", str(path), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{path}:301: a half-written last line" in err and err.count("\n") == 1
    assert out.exists()
