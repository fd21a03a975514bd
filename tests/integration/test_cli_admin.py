"""controllerctl against a real sidecar on loopback (ephemeral ports), run in a background loop."""

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.cli import main
from controller.config import SidecarConfig
from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import demo_workload
from controller.server import SidecarServer as Sidecar

pytestmark = pytest.mark.integration

BROKEN = "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: b}\nspec:\n  algorithm: {name: nope}\n"


class Background:
    """A sidecar and one embedded engine on an event loop in a thread (the CLI runs its own loop)."""

    def __init__(self, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.state_dir = state_dir

    def call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=20)

    async def _start(self) -> None:
        cfg = SidecarConfig(
            engine_listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            metrics_listen="",
            state_dir=str(self.state_dir),
        )
        self.sidecar = Sidecar(config=cfg)
        await self.sidecar.start()
        self.engine = EmbeddedEngine(
            target=self.sidecar.engine_target,
            settings=EngineSettings(engine_id="engine-a"),
            workload=demo_workload(duration_s=600.0),
            link=LinkSettings(time_scale=1.0),
        )
        await self.engine.start()
        for _ in range(200):
            if "engine-a" in self.sidecar.engines() and self.sidecar.engines()["engine-a"].loop.totals.steps:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the engine did not attach")

    async def _stop(self) -> None:
        await self.engine.stop()
        await self.sidecar.stop(snapshot=False)

    def __enter__(self) -> "Background":
        self.thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@pytest.fixture
def bg(tmp_path: Path) -> Iterator[Background]:
    with Background(tmp_path / "state") as b:
        yield b


def _run(bg: Background, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["--admin", bg.sidecar.admin_target, *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_policy_set_get_list_rollback(
    bg: Background, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, out, _ = _run(bg, capsys, "policy", "get", "--json")
    assert rc == 0 and json.loads(out)["name"] == "default"

    rc, out, _ = _run(bg, capsys, "policy", "set", "static-ngram-4", "--engine", "engine-a")
    assert rc == 0 and "static-ngram-4" in out and "engine engine-a" in out
    rc, out, _ = _run(bg, capsys, "policy", "get", "--engine", "engine-a", "--json")
    assert json.loads(out)["name"] == "static-ngram-4"

    rc, out, _ = _run(bg, capsys, "policy", "set", "epsilon-greedy")
    assert rc == 0
    rc, out, _ = _run(bg, capsys, "policy", "list", "--json")
    doc = json.loads(out)
    assert {p["name"] for p in doc["presets"]} >= {"default", "static-off"}
    assert {(p["engine_id"], p["name"]) for p in doc["active"]} == {
        ("", "epsilon-greedy"),
        ("engine-a", "static-ngram-4"),
    }

    rc, out, _ = _run(bg, capsys, "policy", "rollback")
    assert rc == 0 and "default" in out
    rc, out, _ = _run(bg, capsys, "policy", "get", "--json")
    assert json.loads(out)["name"] == "default"


def test_broken_policy_leaves_the_active_one(
    bg: Background, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(BROKEN)
    rc, _, err = _run(bg, capsys, "policy", "set", str(f))
    assert rc == 2 and f"{f}:5: spec.algorithm.name" in err
    rc, out, _ = _run(bg, capsys, "policy", "get", "--json")
    doc = json.loads(out)
    assert doc["name"] == "default" and int(doc["revision"]) == 1


def test_server_side_refusal_is_one_line_exit_2(bg: Background, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(bg, capsys, "policy", "rollback")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err


def test_status_and_engines(bg: Background, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(bg, capsys, "status")
    assert rc == 0 and "default policy: default" in out and "engine-a" in out
    rc, out, _ = _run(bg, capsys, "status", "--json")
    doc = json.loads(out)
    assert [e["engine_id"] for e in doc["engines"]] == ["engine-a"] and doc["engines"][0]["connected"]
    rc, out, _ = _run(bg, capsys, "engines")
    assert rc == 0 and out.splitlines()[0].split()[:2] == ["engine", "connected"] and "engine-a" in out
    rc, out, _ = _run(bg, capsys, "engines", "--json")
    assert json.loads(out)["engines"][0]["granularity"] == "GRANULARITY_REQUEST_METHOD"
