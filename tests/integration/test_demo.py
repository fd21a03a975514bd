"""The demo end to end: sidecar + embedded engines over real gRPC, short run, JSON result."""

import asyncio
import gc
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from controller import demo as demo_mod
from controller import snapshot as snapshot_mod
from controller.cli import main
from controller.client import AdminClient
from controller.demo import ADAPTIVE, STATIC_ARMS, engine_name, run_demo
from controller.embedded.core import EngineCore
from controller.embedded.engine import EmbeddedEngine
from controller.server import SidecarServer

pytestmark = pytest.mark.integration


def test_demo_json_table_and_adaptive_beats_the_worst_static(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--seconds", "6", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["engine"]: r for r in doc["engines"]}
    assert set(rows) == {ADAPTIVE, *(engine_name(a) for a in STATIC_ARMS)}
    for r in rows.values():
        assert set(r) >= {
            "goodput_tok_s",
            "speedup_vs_no_spec",
            "acceptance_rate",
            "phase_goodput_tok_s",
            "arm_steps",
        }
        assert r["tokens"] > 0 and r["virtual_s"] >= 6.0
        assert len(r["phase_goodput_tok_s"]) == len(doc["phases"]) == 4
    assert rows[engine_name("off")]["speedup_vs_no_spec"] == 1.0
    assert rows[engine_name("off")]["acceptance_rate"] == 0.0
    assert set(rows[engine_name("ngram:4")]["arm_steps"]) == {"ngram:4"}
    # Every engine heard the sidecar; the adaptive one switched arms.
    assert all(r["directives"] > 0 for r in rows.values())
    assert len(rows[ADAPTIVE]["arm_steps"]) > 2
    statics = [r["goodput_tok_s"] for n, r in rows.items() if n != ADAPTIVE]
    assert rows[ADAPTIVE]["goodput_tok_s"] > min(statics)
    assert doc["adaptive_vs_worst_static"] > 1.0
    assert doc["best_static"] in rows and doc["worst_static"] in rows
    # Ratios per phase against that phase's best static arm, and goodput over time for the plot.
    assert len(doc["adaptive_vs_best_static_per_phase"]) == len(doc["phase_best_static"]) == 4
    assert all(x > 0 for x in doc["adaptive_vs_best_static_per_phase"])
    assert doc["phase_starts_s"][0] == 0.0 and doc["phase_starts_s"] == sorted(doc["phase_starts_s"])
    assert set(doc["goodput_over_time"]) == set(rows)
    assert all(len(s) > 10 for s in doc["goodput_over_time"].values())


def test_demo_table_output_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    assert main(["demo", "--seconds", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "adaptive / best" in out and "worst phase: " in out
    assert "adaptive vs best static: " in out and "── phase 1/4" in out
    header = next(line for line in out.splitlines() if line.startswith("engine "))
    assert "goodput tok/s" in header and "vs off" in header


@pytest.fixture
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The demo's temporary state directory goes under ``tmp_path`` (to see that none is left)."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


async def test_ctrl_c_while_the_sidecar_starts_is_clean(own_tmp: Path) -> None:
    # Cancelled inside gRPC's server start, the sidecar's shutdown raised InvalidStateError: a
    # traceback, or "Task exception was never retrieved" on stderr after "interrupted".
    problems: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: problems.append(ctx))
    task = asyncio.create_task(run_demo(seconds=1.0, out=None))
    await asyncio.sleep(0)  # the demo runs up to its first wait: inside the sidecar's start
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gc.collect()
    await asyncio.sleep(0.2)
    assert problems == []
    assert list(own_tmp.iterdir()) == []


def test_an_engine_that_fails_ends_the_demo_at_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], own_tmp: Path
) -> None:
    # It ended the demo only once every engine before it in the table had played its whole schedule,
    # then as a traceback.
    step = EngineCore.step
    made: list[EmbeddedEngine] = []
    init = EmbeddedEngine.__init__

    def failing(self: EngineCore) -> Any:
        if self.settings.engine_id == engine_name("ngram:3") and self.totals.steps >= 5:
            raise ValueError("boom")
        return step(self)

    def spy(self: EmbeddedEngine, **kw: Any) -> None:
        init(self, **kw)
        made.append(self)

    monkeypatch.setattr(EngineCore, "step", failing)
    monkeypatch.setattr(EmbeddedEngine, "__init__", spy)
    assert main(["demo", "--seconds", "30"]) == 1
    assert capsys.readouterr().err == f"demo: engine {engine_name('ngram:3')} failed: ValueError: boom\n"
    assert len(made) == len(STATIC_ARMS) + 1 and not any(e.done for e in made)
    assert list(own_tmp.iterdir()) == []


def _keep_started(monkeypatch: pytest.MonkeyPatch) -> list[SidecarServer]:
    """The demo's sidecar, once started (for a test to stop it)."""
    started: list[SidecarServer] = []
    start = SidecarServer.start

    async def start_and_keep(self: SidecarServer) -> None:
        await start(self)
        started.append(self)

    monkeypatch.setattr(SidecarServer, "start", start_and_keep)
    return started


def test_a_sidecar_that_stops_mid_run_ends_the_demo_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], own_tmp: Path
) -> None:
    # The engines went on without it (on their last directives: not the policies' figures); the
    # decision stream's end surfaced at the very end as an AioRpcError traceback. The stop comes
    # after the demo set its policies (a fixed delay after the start raced them on a loaded machine).
    started = _keep_started(monkeypatch)
    set_policies = demo_mod._set_policies

    async def set_then_stop(*args: Any) -> None:
        await set_policies(*args)

        async def stop_soon() -> None:
            await asyncio.sleep(0.5)
            await started[0].stop(snapshot=False)

        asyncio.get_running_loop().create_task(stop_soon())

    monkeypatch.setattr(demo_mod, "_set_policies", set_then_stop)
    assert main(["demo", "--seconds", "30"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        ("demo: the sidecar ended its decision stream", "demo: the sidecar's decision stream")
    ), err
    assert list(own_tmp.iterdir()) == []


def test_a_sidecar_that_stops_while_taking_the_policies_is_not_called_a_refusal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], own_tmp: Path
) -> None:
    # A clean-clone CI stopped the sidecar (above, at a fixed delay) while the demo set its policies:
    # the demo said the sidecar "refused its policies: CANCELLED", which it never did.
    started = _keep_started(monkeypatch)
    set_policy = AdminClient.set_policy

    async def stop_after_the_first(self: AdminClient, *args: Any, **kw: Any) -> Any:
        out = await set_policy(self, *args, **kw)
        await started[0].stop(snapshot=False)
        return out

    monkeypatch.setattr(AdminClient, "set_policy", stop_after_the_first)
    assert main(["demo", "--seconds", "30"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("demo: the sidecar stopped before it took the demo's policies: UNAVAILABLE"), err
    assert err.count("\n") == 1 and list(own_tmp.iterdir()) == []


async def test_no_snapshot_write_is_in_flight_when_the_state_directory_goes(
    monkeypatch: pytest.MonkeyPatch, own_tmp: Path
) -> None:
    # Ctrl-C mid-run: the sidecar's stop cancelled its tick while a snapshot write ran on a worker
    # thread, which went on writing in the temporary directory being removed: "demo: [Errno 39]
    # Directory not empty" (exit 1) and the directory left in /tmp, when the two met.
    write = snapshot_mod.write_json_atomic
    in_flight = [0]
    at_cleanup: list[int] = []
    slow = asyncio.Event()

    def slow_write(path: Path, data: Any) -> None:
        if not slow.is_set():  # (the policies set at the start are written through)
            return write(path, data)
        in_flight[0] += 1
        try:
            time.sleep(0.5)  # (the acknowledgements wait for a write: they come back to back)
            write(path, data)
        finally:
            in_flight[0] -= 1

    cleanup = tempfile.TemporaryDirectory.cleanup

    def checked_cleanup(self: tempfile.TemporaryDirectory[str]) -> None:
        at_cleanup.append(in_flight[0])
        cleanup(self)

    monkeypatch.setattr(snapshot_mod, "write_json_atomic", slow_write)
    monkeypatch.setattr(tempfile.TemporaryDirectory, "cleanup", checked_cleanup)
    task = asyncio.create_task(run_demo(seconds=60.0, out=None))
    await asyncio.sleep(1.0)  # mid-run
    slow.set()
    while in_flight[0] == 0:  # the engines' batches wait for a snapshot, being written now
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert at_cleanup == [0]
    assert list(own_tmp.iterdir()) == []


class _ReaderGone(io.StringIO):
    """Standard output whose reader went away (``controllerctl demo | head -1``) after one line."""

    def write(self, s: str) -> int:
        if "\n" in self.getvalue():
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(s)


async def test_an_output_gone_mid_run_ends_the_demo_at_once(
    monkeypatch: pytest.MonkeyPatch, own_tmp: Path
) -> None:
    # The live lines' task died with the BrokenPipeError and the engines played on to the end (20 s
    # of CPU after `| head -1` had exited), then the error came out.
    made: list[EmbeddedEngine] = []
    init = EmbeddedEngine.__init__

    def spy(self: EmbeddedEngine, **kw: Any) -> None:
        init(self, **kw)
        made.append(self)

    monkeypatch.setattr(EmbeddedEngine, "__init__", spy)
    with pytest.raises(BrokenPipeError):
        await run_demo(seconds=30.0, out=_ReaderGone())
    assert made and not any(e.done for e in made)
    assert list(own_tmp.iterdir()) == []


def test_a_state_directory_that_cannot_be_written_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], own_tmp: Path
) -> None:
    # A full /tmp: the sidecar refuses the demo's policies (it writes them through), which came out
    # of `controllerctl demo` as a gRPC traceback.
    def disk_full(path: Path, data: Any) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(snapshot_mod, "write_json_atomic", disk_full)
    assert main(["demo", "--seconds", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("demo: the demo's sidecar refused its policies: ABORTED: "), err
    assert "No space left on device" in err[-1]
    assert list(own_tmp.iterdir()) == []


def test_controllerctl_demo_whose_reader_went_away_exits_1_in_silence(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], own_tmp: Path
) -> None:
    # The CLI's rule for a reader gone (`controllerctl ... | head -1`): exit 1, nothing said. The demo's
    # handler made it "demo: [Errno 32] Broken pipe" on a stderr the user may still be reading.
    from controller import cli, demo

    def reader_gone(**_: Any) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(demo, "main", reader_gone)
    monkeypatch.setattr(cli.os, "dup2", lambda *_: None)  # (main points stdout at /dev/null)
    assert cli.main(["demo", "--seconds", "1"]) == 1
    assert capsys.readouterr().err == ""
