"""benchmarks/plugin_overhead.py: a mistaken command line is a usage error (exit 2, no traceback)
before anything starts (its measurements need the vLLM virtualenv and run in `make results`)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.usage import assert_usage_error

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plugin_overhead.py"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cold-mb", "4"], "--cold-mb: 0..4096, with --scripted only"),
        (["--scripted", "--cold-mb", "-1"], "--cold-mb: 0..4096"),
        (["--scripted", "--repeat", "0"], "--repeat: 1..100"),
        (["--batches", "8,x"], "--batches: comma-separated integers"),
        (["--batches", "64"], "batches in 1..32"),
    ],
)
def test_usage_errors_exit_2_and_say_what(args: list[str], says: str) -> None:
    assert_usage_error(SCRIPT, args, says)


def test_a_cold_run_flushes_before_every_hook_and_the_next_warm_run_does_not() -> None:
    # --cold-mb wraps the clocked hooks in a cache flush; a warm run after it must time the hooks
    # without that layer (else its figures would carry the flushes' misses).
    sys.path.insert(0, str(SCRIPT.parent))
    import plugin_overhead as po

    from controller.vllm.engine_hooks import EngineHooks

    def layer() -> str:
        return EngineHooks.after_update.__qualname__

    def wraps_the_original() -> bool:  # the outermost layer calls the plugin's own hook directly
        cells = EngineHooks.after_update.__closure__ or ()
        return any(c.cell_contents is po._ORIGINALS[(EngineHooks, "after_update")] for c in cells)

    try:
        cold = po._scripted(32, 300, 12, "k-table", cold_mb=1)
        assert layer().startswith("_flush_before_hooks.") and not wraps_the_original()
        assert cold["cpu_median"] > 0 and cold["cpu_us_by_hook"]["after_update"] > 0
        warm = po._scripted(32, 300, 12, "k-table")
        assert layer().startswith("HookClock._wrap.") and wraps_the_original()
        assert warm["cpu_median"] > 0
    finally:
        for (owner, name), orig in po._ORIGINALS.items():  # leave the plugin's hooks as they were
            setattr(owner, name, orig)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="this Python has torch")
def test_scripted_without_torch_says_which_python_to_use() -> None:
    # The project's own virtualenv has no torch; the async mode needs it. One line, exit 1, no
    # traceback, before any hook is timed.
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--scripted"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "--scripted needs torch" in r.stderr and ".venv-vllm/bin/python" in r.stderr
    assert "Traceback" not in r.stderr and "plugin_overhead: run" not in r.stderr
