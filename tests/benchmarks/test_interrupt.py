"""Ctrl-C on the benchmark scripts, as a user presses it: "interrupted" on stderr, exit 130, no traceback,
no ``--json``/``--out`` file, and nothing of the run left behind (no process of its group, no
temporary directory). Each script runs in its own process group with SIGINT at its default (a test's
background job would ignore it); the press goes to the whole group, as a terminal sends it, or to the
script's process alone (``kill -INT PID``), once the script has shown that it got to the point tested."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.spawn import default_signals

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
#: How long an interrupted script may take to end before the test calls it hung (not a timing goal:
#: the old sidecar_load never ended).
ENDS_WITHIN_S = 120


def _start(args: list[str], tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}
    return subprocess.Popen(
        default_signals([sys.executable, *args]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
        process_group=0,  # its own group, which the tests signal whole
    )


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _interrupt(
    p: subprocess.Popen[str], ready: Callable[[str], bool], *, group: bool = True
) -> tuple[int, str]:
    """Wait until ``ready(output so far)``, press Ctrl-C, and return (exit status, all output)."""
    assert p.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        while not ready("".join(lines)):
            if p.poll() is not None:
                reader.join(10)
                pytest.fail("ended before the point to interrupt it at:\n" + "".join(lines)[-3000:])
            time.sleep(0.05)
        if group:
            os.killpg(p.pid, signal.SIGINT)
        else:
            os.kill(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {ENDS_WITHIN_S} s after Ctrl-C:\n" + "".join(lines)[-3000:])
        reader.join(10)
        # Whatever the script started has ended with it (children of a pool, a sidecar, an engine).
        for _ in range(50):
            if not _group_alive(p.pid):
                break
            time.sleep(0.1)
        assert not _group_alive(p.pid), "a process of the run outlived it"
        return p.returncode, "".join(lines)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _assert_interrupted(code: int, out: str) -> None:
    assert code == 130, out[-3000:]
    assert out.rstrip().endswith("interrupted"), out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]


_HALF_MADE = """
import asyncio, sys
sys.path.insert(0, {bench!r})
from _interrupt import run_main

class HalfMade:  # what a signal inside asyncio.run's loop set-up leaves: __del__ fails at exit
    def __del__(self):
        raise AttributeError("no attribute '_debug'")

async def never():
    pass

def main():
    global kept
    kept = (HalfMade(), never())
    raise KeyboardInterrupt

run_main(main)
"""


def test_shutdown_noise_after_an_interrupt_is_not_printed(tmp_path: Path) -> None:
    """A run interrupted while asyncio.run built its loop (sidecar_load, SIGHUP) printed "interrupted"
    and then the half-made loop's __del__ traceback and "coroutine ... was never awaited" at exit."""
    script = tmp_path / "half_made.py"
    script.write_text(_HALF_MADE.format(bench=str(BENCH)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    _assert_interrupted(r.returncode, r.stdout + r.stderr)


_SWALLOWING = """
import asyncio, sys
sys.path.insert(0, {bench!r})
from _interrupt import run_main

async def stream():  # gRPC aio's request-stream task: a bare except, the RPC cancelled
    print("streaming", flush=True)
    try:
        while True:
            await asyncio.sleep(0)
            for _ in range(100000):  # (nearly all the time in this task)
                pass
    except:  # noqa: E722
        return

async def run():
    task = asyncio.ensure_future(stream())
    try:
        await asyncio.sleep(3600)  # the script waits on the stream's call
    finally:
        print("cleaned up", flush=True)
        task.cancel()

run_main(lambda: asyncio.run(run()))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_termination_signal_is_not_swallowed_by_a_library_task(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM raised KeyboardInterrupt at whatever line ran: inside gRPC's request-stream task, whose
    bare ``except:`` took it (the RPC cancelled), and sidecar_load waited on for good (1 of ~20 under
    load). Now the loop raises it between callbacks: the script ends, its ``finally`` blocks run."""
    script = tmp_path / "swallowing.py"
    script.write_text(_SWALLOWING.format(bench=str(BENCH)))
    p = _start([str(script)], tmp_path)
    try:
        assert p.stdout is not None and p.stdout.readline() == "streaming\n"
        os.kill(p.pid, sig)  # as `timeout` or a closed terminal sends it, while the stream's task runs
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{sig.name} was swallowed: the script was still running after 60 s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    _assert_interrupted(p.returncode, out)
    assert "cleaned up" in out


def test_sim_speed_mid_run(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    p = _start(
        [str(BENCH / "sim_speed.py"), "--tokens", "3000000", "--repeat", "1", "--json", str(out)], tmp_path
    )
    _assert_interrupted(*_interrupt(p, lambda s: "req-steps/s" in s))
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_demo_headroom_mid_run(tmp_path: Path) -> None:
    out = tmp_path / "headroom.json"
    p = _start([str(BENCH / "demo_headroom.py"), "--requests", "5000", "--json", str(out)], tmp_path)
    _assert_interrupted(*_interrupt(p, lambda s: "[1/" in s))
    assert not out.exists()


def test_decision_quality_with_its_process_pool(tmp_path: Path) -> None:
    # Two workers: the pool's processes are in the group, and must be gone with the script.
    out = tmp_path / "dq.md"
    args = [str(BENCH / "decision_quality.py"), "--jobs", "2", "--requests", "400", "--scenarios", "chat,drift",
            "--policies", "default,ucb1", "--out", str(out)]  # fmt: skip
    _assert_interrupted(*_interrupt(_start(args, tmp_path), lambda s: "[1/" in s))
    assert not out.exists()


def _sidecar_dirs(tmp: Path, inner: str) -> Callable[[str], bool]:
    return lambda _: any(tmp.glob(f"sc-load-*{inner}"))


@pytest.mark.parametrize(
    ("when", "group"),
    [
        ("", True),  # its sidecar process starting (importing)
        ("/state/*", True),  # the sidecar up, the engines streaming
        ("/state/*", False),  # the script alone (kill -INT): it waited on its sidecar for good
    ],
)
def test_sidecar_load_stops_its_sidecar(tmp_path: Path, when: str, group: bool) -> None:
    out = tmp_path / "load.json"
    args = [str(BENCH / "sidecar_load.py"), "--engines", "2", "--seconds", "600", "--core", "-1",
            "--json", str(out)]  # fmt: skip
    _assert_interrupted(*_interrupt(_start(args, tmp_path), _sidecar_dirs(tmp_path, when), group=group))
    assert not out.exists()
    assert not list(tmp_path.glob("sc-load-*")), "the run's temporary directory was left behind"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_sidecar_load_terminated_or_killed_takes_its_sidecar_with_it(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # The script alone gets the signal (``timeout``, a job cancelled): its sidecar process, waiting for
    # a ``stop`` that never came, ran on for good.
    args = [str(BENCH / "sidecar_load.py"), "--engines", "2", "--seconds", "600", "--core", "-1"]
    p = _start(args, tmp_path)
    try:
        ready = _sidecar_dirs(tmp_path, "/state/*")
        while not ready(""):
            assert p.poll() is None, p.communicate()[0][-3000:]
            time.sleep(0.05)
        os.kill(p.pid, sig)
        out, _ = p.communicate(timeout=ENDS_WITHIN_S)
        for _ in range(100):
            if not _group_alive(p.pid):
                break
            time.sleep(0.1)
        assert not _group_alive(p.pid), "the sidecar process outlived the script"
        if sig != signal.SIGKILL:
            _assert_interrupted(p.returncode, out)
            assert not list(tmp_path.glob("sc-load-*"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _processes_naming(text: str) -> list[str]:
    """The command lines of live processes that name ``text`` (the run's directory)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{proc.name}: {cmd}")
    return out
