"""Snapshot faults at the sidecar level: a corrupt or truncated snapshot is moved aside and the
sidecar starts clean; a snapshot that cannot be written is logged and counted, the old one intact.

(``tests/controller/test_snapshot.py`` covers the same at the ``SnapshotStore`` level.)
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from tests.integration.test_sidecar_grpc import (
    STATIC_EAGLE3_2,
    TestEngine,
    hello,
    loopback_config,
    step,
    until,
)

pytestmark = pytest.mark.integration


def _config(tmp_path: Path) -> SidecarConfig:
    return loopback_config(tmp_path, snapshot_interval_s=3600.0)


async def _with_state(tmp_path: Path) -> Path:
    """A sidecar that learned something and set a policy, stopped cleanly: a good snapshot."""
    sc = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    sc.set_policy(STATIC_EAGLE3_2, source="s.yaml")
    eng = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello("e1")))
    await eng.directive()
    eng.report(step(t=1.0, accepted=[1, 2]))
    await until(lambda: sc.engines()["e1"].loop.totals.steps == 1)
    await eng.close()
    await sc.stop()
    return sc.snapshots.path


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])


def _garble_policy(p: Path) -> None:
    doc = json.loads(p.read_text())
    doc["state"]["policies"] = {"default": {"yaml": "kind: [not a policy"}}
    p.write_text(json.dumps(doc))


def _binary(p: Path) -> None:
    p.write_bytes(os.urandom(512))


@pytest.mark.parametrize(
    "damage", [_truncate, _garble_policy, _binary], ids=["truncated", "bad-policy", "binary"]
)
async def test_corrupt_snapshot_is_moved_aside_and_the_start_is_clean(
    tmp_path: Path, damage: object, caplog: pytest.LogCaptureFixture
) -> None:
    path = await _with_state(tmp_path)
    damage(path)  # type: ignore[operator]
    broken = path.read_bytes()
    caplog.set_level(logging.WARNING)
    sc = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    try:
        assert sc.engines() == {}
        assert (sc.policy_store.default.spec.name, sc.policy_store.default.revision) == ("default", 1)
        aside = [p for p in path.parent.iterdir() if p.name.startswith("sidecar-state.json.corrupt-")]
        assert len(aside) == 1 and aside[0].read_bytes() == broken
        assert "moved to" in caplog.text
    finally:
        await sc.stop()
    assert json.loads(path.read_text())["state"]["engines"] == {}  # the clean start saved a new one


async def test_failing_snapshot_write_is_logged_counted_and_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = await _with_state(tmp_path)
    sc = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    good = path.read_bytes()  # as the start wrote it (no longer marked clean)
    try:
        if os.geteuid() == 0:
            # root writes through directory permissions: stand in for a read-only file system.
            def rofs(*a: object, **kw: object) -> tuple[int, str]:
                raise OSError(errno.EROFS, "Read-only file system")

            monkeypatch.setattr(tempfile, "mkstemp", rofs)
        else:
            path.parent.chmod(0o500)
        caplog.set_level(logging.ERROR)
        assert not sc.save_snapshot()
        assert not sc.save_snapshot()
        assert sc.registry.get_sample_value("speccontrol_snapshot_failures_total") == 2
        assert "write failed, previous snapshot kept" in caplog.text
        assert path.read_bytes() == good
        # The sidecar serves on.
        eng = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello("e1")))
        try:
            assert (await eng.directive()).policy == "static-eagle3-2"
        finally:
            await eng.close()
    finally:
        monkeypatch.undo()
        path.parent.chmod(0o700)
        await sc.stop(snapshot=False)
    assert path.read_bytes() == good
