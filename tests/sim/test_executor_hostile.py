"""The local sweep executor when a sweep goes wrong: Ctrl-C, a job that raises, a worker that dies,
a parent that dies, and ``--jobs`` far above the CPU count.

What must hold: ``map`` never waits for the rest of the sweep once it is abandoned (the pool's own
shutdown ran every queued job first), leaves no worker behind (not even when the parent is killed),
turns a dead worker into a one-line ``ExecutorError``, keeps workers out of the terminal's Ctrl-C,
and runs no more workers than there are usable CPUs. Jobs here are tiny (a marker file, a short
sleep) so that each test is quick; the counts, not the clock, decide pass or fail.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.executor
from sim.executor import ExecutorError, LocalExecutor, usable_cpus


def _mark_and_sleep(item: tuple[str, int]) -> int:
    """Leaves a marker for each job that ran; job 0 fails at once, the others take a while."""
    where, i = item
    Path(where, f"ran-{i}").touch()
    if i == 0:
        raise ValueError("job 0 is bad")
    time.sleep(0.2)
    return i


def _sleep_then_pid(i: int) -> int:
    time.sleep(0.05)
    return os.getpid()


def _exit_hard(i: int) -> int:
    if i == 3:
        os._exit(137)  # as the OOM killer leaves it: no exception, no result
    return i


def _kill_self(i: int) -> int:
    if i == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


def _sigint_disposition(i: int) -> bool:
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def _square(i: int) -> int:
    return i * i


def test_a_job_that_raises_ends_the_sweep_without_running_the_rest(tmp_path: Path) -> None:
    # The pool's shutdown(wait=True) ran every queued job before the error came out: all 60 here,
    # hours on a real sweep.
    items = [(str(tmp_path), i) for i in range(60)]
    with pytest.raises(ValueError, match="job 0 is bad"):
        LocalExecutor(jobs=2).map(_mark_and_sleep, items)
    assert multiprocessing.active_children() == []
    assert len(list(tmp_path.glob("ran-*"))) <= 30


def test_ctrl_c_in_the_parent_ends_the_sweep_and_its_workers(tmp_path: Path) -> None:
    items = [(str(tmp_path), i) for i in range(1, 61)]

    def interrupt(i: int, r: int) -> None:
        raise KeyboardInterrupt  # as the terminal's SIGINT arrives between two results

    with pytest.raises(KeyboardInterrupt):
        LocalExecutor(jobs=2).map(_mark_and_sleep, items, interrupt)
    assert multiprocessing.active_children() == []
    assert len(list(tmp_path.glob("ran-*"))) <= 30


@pytest.mark.parametrize("fn", [_exit_hard, _kill_self])
def test_a_worker_that_dies_is_one_clear_error(fn: object) -> None:
    with pytest.raises(ExecutorError, match=r"a worker process of the sweep died .*fewer --jobs") as e:
        LocalExecutor(jobs=2).map(fn, list(range(8)))  # type: ignore[arg-type]
    assert "\n" not in str(e.value)
    assert multiprocessing.active_children() == []


def test_workers_leave_ctrl_c_to_the_parent() -> None:
    # The terminal sends SIGINT to the whole process group: each worker raised KeyboardInterrupt in
    # its job and went on to the next queued one.
    assert LocalExecutor(jobs=2).map(_sigint_disposition, list(range(4))) == [True] * 4


def test_no_more_workers_than_usable_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim.executor, "usable_cpus", lambda: 2)
    assert LocalExecutor(jobs=1024).workers(5000) == 2
    pids = set(LocalExecutor(jobs=64).map(_sleep_then_pid, list(range(40))))
    assert 1 <= len(pids) <= 2 and os.getpid() not in pids


@settings(max_examples=25, deadline=None)
@given(jobs=st.integers(1, 1024), n=st.integers(0, 3000))
def test_worker_count_is_bounded_by_jobs_items_and_cpus(jobs: int, n: int) -> None:
    w = LocalExecutor(jobs=jobs).workers(n)
    if jobs <= 1 or n <= 1:
        assert w == 0
    else:
        assert 1 <= w <= min(jobs, n, usable_cpus())


def test_results_are_in_item_order_whatever_the_worker_count() -> None:
    items = list(range(200))
    expected = [i * i for i in items]
    for jobs in (1, 2, 1024):
        seen: list[int] = []
        assert LocalExecutor(jobs=jobs).map(_square, items, lambda i, r, s=seen: s.append(i)) == expected
        assert sorted(seen) == items


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_workers_die_with_a_killed_parent(tmp_path: Path) -> None:
    # SIGTERM or the OOM killer on the parent left its workers blocked on their queue for good.
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        from sim.executor import LocalExecutor

        def job(i):
            with open(sys.argv[1], "a") as f:
                f.write(str(os.getpid()) + " ")
            time.sleep(120)
            return i


        if __name__ == "__main__":
            import threading
            threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            LocalExecutor(jobs=2).map(job, list(range(4)))
        """
    )
    (tmp_path / "victim.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    pid_file = tmp_path / "pids"
    # (no pipes: a worker left alive would hold them open, and the test would wait on it)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "victim.py"), str(pid_file)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL
    pids = sorted({int(x) for x in pid_file.read_text().split()})
    assert pids
    deadline = time.monotonic() + 30  # (how long the kernel may take: not what is tested)
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    for p in alive:  # do not leave them behind for the rest of the run
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    assert alive == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has died
    except FileNotFoundError:
        return False
