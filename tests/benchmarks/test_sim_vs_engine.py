"""benchmarks/sim_vs_engine.py: its run order (every setting once per round, interleaved, one pin per arm), and
where its engine's sockets go."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sim_vs_engine as sve  # noqa: E402


def test_every_setting_once_per_round_in_a_new_order() -> None:
    order = sve.run_order(3)
    assert Counter((arm, c) for _, arm, c in order) == {(a, c): 3 for a in sve.ARMS for c in sve.LEVELS}
    rounds = [[(arm, c) for r, arm, c in order if r == i] for i in range(3)]
    assert len({tuple(r) for r in rounds}) == 3  # interleaved: no two rounds in the same order
    for r in rounds:  # an arm's settings run together: one pin per arm and round
        arms = [a for a, _ in r]
        assert [a for i, a in enumerate(arms) if i == 0 or arms[i - 1] != a] == list(dict.fromkeys(arms))
    assert sve.run_order(3) == order  # seeded


def test_the_training_settings_leave_some_held_out() -> None:
    settings = {(a, c) for a in sve.ARMS for c in sve.LEVELS}
    assert settings > sve.TRAIN and len(settings - sve.TRAIN) >= 4


def _fake_vllm(tmp: Path, body: str, run_dir: Path) -> dict[str, str]:
    """An environment whose vLLM virtualenv's Python is the shell script ``body``; runs go in
    ``run_dir`` (short: the sidecar's socket is in it, and a socket path holds 107 bytes)."""
    py = tmp / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n" + body)
    py.chmod(0o755)
    return {**os.environ, "VLLM_VENV": str(tmp / "venv"), "TMPDIR": str(run_dir)}


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("exit 3\n", "building the tiny model with {py} failed (exit 3)"),
        # The model is built; the server exits at once (a vLLM that cannot start): the real sidecar
        # starts and is stopped with it.
        (
            '[ "$2" = tests.e2e.tiny_model ] && exit 0\nexit 3\n',
            "the vLLM server exited (exit 3) before it was up",
        ),
    ],
)
def test_an_engine_that_cannot_start_is_one_line(
    tmp_path: Path, short_tmp_path: Path, body: str, said: str
) -> None:
    # A sidecar slow to start (a loaded machine), vLLM exiting, or a model that could not be built
    # ended the run in a traceback.
    env = _fake_vllm(tmp_path, body, short_tmp_path)
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sim_vs_engine.py"), "--rounds", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("sim_vs_engine: " + said.format(py=tmp_path / "venv" / "bin" / "python")), r.stderr
    assert "Traceback" not in r.stderr and "the run's files are in" in line


def test_vllms_sockets_go_in_the_run_directory_when_the_path_fits(short_tmp_path: Path) -> None:
    # (vLLM's default, /tmp, kept every socket of an engine ended by a signal)
    run = short_tmp_path / "r"
    run.mkdir()
    assert sve._rpc_directory(run) == {"VLLM_RPC_BASE_PATH": str(run / "rpc")}
    assert (run / "rpc").is_dir()
    long = short_tmp_path / ("x" * (107 - len(str(short_tmp_path))))  # a socket's path would pass 107 bytes
    long.mkdir()
    assert sve._rpc_directory(long) == {}  # vLLM's default: it would fail to bind
    assert not (long / "rpc").exists()
