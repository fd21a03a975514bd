"""The ``controllerctl`` console script ends a Ctrl-C pressed while it is still loading the CLI the way
it ends one pressed later: "interrupted" on stderr, exit 130, no traceback.

The press is made deterministic, not raced against the interpreter's start-up: a ``sitecustomize``
on PYTHONPATH sends the process a real SIGINT at the moment a named module starts to import, so the
KeyboardInterrupt comes out of the middle of the CLI's imports (or, for the later moments, of a
module the CLI imports only to run a command). The installed script is the one a user runs, so its
entry point (pyproject's ``[project.scripts]``) is what is tested.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from controller import cli

CTL = str(Path(sys.executable).parent / "controllerctl")

_PRESS_ON_IMPORT = """
import importlib.abc, os, signal, sys

class _PressCtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == os.environ["PRESS_CTRL_C_ON_IMPORT"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _PressCtrlC())
"""


def _run_pressing_on_import(tmp_path: Path, module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(_PRESS_ON_IMPORT)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PRESS_CTRL_C_ON_IMPORT=module)
    return subprocess.run([CTL, *argv], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "module",
    [
        "grpc",  # among the CLI's first imports
        "sim.cli",  # among its last
    ],
)
def test_ctrl_c_while_the_cli_loads_is_one_line_and_exit_130(tmp_path: Path, module: str) -> None:
    done = _run_pressing_on_import(tmp_path, module, "policy", "list")
    assert done.returncode == 130, done.stderr
    assert done.stderr == "interrupted\n"
    assert done.stdout == ""


def test_the_press_reaches_the_process(tmp_path: Path) -> None:
    """The check above is not empty: without the guard, the same press is Python's traceback."""
    (tmp_path / "sitecustomize.py").write_text(_PRESS_ON_IMPORT)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PRESS_CTRL_C_ON_IMPORT="grpc")
    done = subprocess.run(
        [sys.executable, "-c", "import controller.cli"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "KeyboardInterrupt" in done.stderr


def test_a_command_runs_through_the_entry_point(tmp_path: Path) -> None:
    """The entry point hands argv and the exit status through (a usage error is exit 2, one line)."""
    done = subprocess.run(
        [CTL, "policy", "list", "--no-such-flag"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr


def test_ctrl_c_while_the_cli_parses_its_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once loaded, the CLI's own guard covers building the parser and parsing argv too."""

    def pressed() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", pressed)
    # What the handler changes for the rest of the process (a second press ends it at once).
    monkeypatch.setattr(cli.signal, "signal", lambda *_: None)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    with warnings.catch_warnings():
        assert cli.main(["policy", "list"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_the_entry_module_loads_nothing_heavy() -> None:
    """Its guard is in force from the script's first line only if importing it imports nothing slow."""
    probe = "import sys, controller._entry; print(' '.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    assert {
        m for m in loaded if m.split(".")[0] in {"controller", "grpc", "google", "numpy", "sim", "policies"}
    } == {
        "controller",
        "controller._entry",
    }


def test_a_client_command_says_its_error_in_one_line_without_grpc_s_own(tmp_path: Path) -> None:
    """--admin-ca-file against a plaintext sidecar: gRPC logged a handshake line of its own first."""
    from tests.security.certs import make_certs
    from tests.serve_process import serve_process

    certs = make_certs(tmp_path / "c")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    with serve_process(tmp_path) as ends:
        argv = [CTL, "--admin", ends["admin"], "--timeout", "5", "--admin-ca-file", str(certs.ca), "status"]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("cannot reach the sidecar at ") and done.stderr.count("\n") == 1, (
        done.stderr
    )
