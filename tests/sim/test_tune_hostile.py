"""``controllerctl sim tune`` against a careless or hostile user: outputs that name its inputs,
odd grid values, ``--jobs`` far above the CPU count, a worker that dies, Ctrl-C mid-sweep, and
the determinism a sweep promises (the same seed gives the same bytes whatever ``--jobs`` is).

What must hold: bad input is one line on stderr, exit 2, nothing written; a sweep that fails or is
interrupted writes no ``--out`` and leaves no process behind; the table does not depend on the
worker count. Traces are a few generated requests so that each test is quick.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.tune
from policies.presets import resolve_policy as resolve_preset
from sim.cli import main
from sim.executor import usable_cpus
from sim.tune import parse_grid, with_params

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--scenario", "chat", "--requests", "2", "--concurrency", "1"]


def _policy_file(tmp_path: Path) -> Path:
    src = REPO / "policies" / "library" / "default.yaml"
    dst = tmp_path / "mine.yaml"
    shutil.copyfile(src, dst)
    return dst


def test_out_naming_the_policy_file_is_refused_and_the_policy_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It was replaced by the winner (renamed default-tuned): the policy being tuned was gone.
    pol = _policy_file(tmp_path)
    before = pol.read_bytes()
    rc = main(["sim", "tune", "--policy", str(pol), *SMALL, "--param", "explore=0,0.1", "--out", str(pol)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err == f"--out {pol}: is the --policy file it reads; name another output"
    assert pol.read_bytes() == before


def test_out_naming_the_profile_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.yaml"
    shutil.copyfile(REPO / "sim" / "profiles" / "llama-3.1-8b-h100.yaml", prof)
    before = prof.read_bytes()
    head = ["sim", "tune", "--policy", "default", "--profile", str(prof)]
    rc = main([*head, *SMALL, "--param", "explore=0", "--out", str(prof)])
    assert rc == 2
    assert "is the --profile file it reads" in capsys.readouterr().err
    assert prof.read_bytes() == before


def test_minus_zero_is_the_same_grid_point_as_zero() -> None:
    # "-0,0" made one point named -0 (printed "explore=-0" in the table and the tuned description).
    (v,) = parse_grid(["explore=-0,0"])["explore"]
    assert v == 0.0 and str(v) == "0.0"
    assert parse_grid(["explore=0,-0.0"]) == {"explore": [0.0]}


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=6))
def test_any_grid_of_numbers_is_points_or_one_clear_error(values: list[float]) -> None:
    text = "explore=" + ",".join(repr(v) for v in values)
    grid = parse_grid([text])
    assert 1 <= len(grid["explore"]) <= len(values)
    for v in grid["explore"]:
        try:
            spec = with_params(resolve_preset("default"), {"explore": v})
        except ValueError as e:
            assert str(e).startswith("--param explore: ") and "\n" not in str(e)
        else:
            assert spec.params["explore"] == pytest.approx(v)


def test_jobs_far_above_the_cpus_is_clamped_said_and_gives_the_same_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["sim", "tune", "--policy", "default", *SMALL, "--param", "explore=0,0.1,0.3", "--seed", "7"]
    assert main([*args, "--jobs", "1"]) == 0
    serial = capsys.readouterr()
    assert serial.err == ""
    assert main([*args, "--jobs", "1024"]) == 0
    many = capsys.readouterr()
    assert many.out == serial.out
    n = usable_cpus()
    assert many.err == f"--jobs 1024: {n} CPUs usable here; running at most {n} workers\n"


def _die(job: object) -> float:
    os._exit(137)  # a worker killed for memory: no exception, no result


def test_a_worker_that_dies_is_one_line_exit_1_and_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was BrokenProcessPool's traceback.
    monkeypatch.setattr(sim.tune, "_replay", _die)
    out = tmp_path / "best.yaml"
    head = ["sim", "tune", "--policy", "default", *SMALL, "--param", "explore=0,0.1,0.3"]
    rc = main([*head, "--jobs", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("a worker process of the sweep died") and err.count("\n") == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform == "win32", reason="process groups")
def test_ctrl_c_mid_sweep_exits_130_writes_nothing_and_leaves_no_process(tmp_path: Path) -> None:
    # Ctrl-C reached the workers too (each job raised KeyboardInterrupt and the worker took the next)
    # while the parent waited for every queued job: it ended only when the whole sweep had run.
    out = tmp_path / "best.yaml"
    grid = ",".join(str(i / 1000) for i in range(200))
    entry = "from controller._entry import main; import sys; sys.exit(main())"
    cmd = [sys.executable, "-c", entry, "sim", "tune", "--policy", "default", "--scenario", "chat"]
    cmd += ["--requests", "60", "--concurrency", "1", "--param", f"explore={grid}", "--jobs", "2"]
    cmd += ["--progress", "--out", str(out)]
    err_path = tmp_path / "err.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, text=True
        )
        try:
            while "[1/" not in err_path.read_text() and proc.poll() is None:
                time.sleep(0.1)
            assert proc.poll() is None, err_path.read_text()
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole group
            # A hang guard (the sweep left would take minutes), not a measure of speed.
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    lines = err_path.read_text().splitlines()
    assert rc == 130
    assert lines[-1] == "interrupted" and not any("Traceback" in x for x in lines)
    assert not out.exists() and not any(p.name.startswith("best") for p in tmp_path.iterdir())
    with pytest.raises(ProcessLookupError):  # nobody left in its process group: no orphan worker
        os.killpg(proc.pid, 0)


def test_each_grid_point_is_built_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The command validated every point, then tune() built every one again: at 10^4 points (about
    # 10 ms each) minutes went by before the first job, silently.
    calls: list[dict[str, float]] = []
    real = sim.tune.with_params

    def counted(spec: object, values: dict[str, float]) -> object:
        calls.append(dict(values))
        return real(spec, values)  # type: ignore[arg-type]

    monkeypatch.setattr(sim.tune, "with_params", counted)
    args = ["sim", "tune", "--policy", "default", *SMALL, "--param", "explore=0,0.1,0.3", "--jobs", "1"]
    assert main(args) == 0
    assert sorted(c["explore"] for c in calls) == [0.0, 0.1, 0.3]
    assert "score" in capsys.readouterr().out


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals")
def test_on_a_terminal_the_sweep_shows_one_bar_not_a_line_per_job(tmp_path: Path) -> None:
    # A grid of 10^4 points printed 10^4 lines on the terminal; a log file (--progress, no terminal)
    # still gets a line per job, which a bar's carriage returns would make one unreadable line.
    import pty

    entry = "from controller._entry import main; import sys; sys.exit(main())"
    cmd = [sys.executable, "-c", entry, "sim", "tune", "--policy", "default", *SMALL]
    cmd += ["--param", "explore=0,0.1,0.2", "--jobs", "1"]
    main_fd, sub_fd = pty.openpty()
    try:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=sub_fd, timeout=600)
        os.close(sub_fd)
        shown = b""
        while True:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # (EIO: the terminal's other side is closed and read out)
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(main_fd)
    text = shown.decode()
    assert proc.returncode == 0, text
    assert "100.0%" in text and "[4/4]" not in text and "\r" in text
    err = tmp_path / "err.txt"
    with err.open("w") as f:
        rc = subprocess.run([*cmd, "--progress"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=f, timeout=600)
    assert rc.returncode == 0
    lines = err.read_text().splitlines()
    assert [x.split("]")[0] for x in lines] == ["[1/4", "[2/4", "[3/4", "[4/4"], lines
