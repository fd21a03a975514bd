from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from controller.snapshot import SnapshotStore, write_json_atomic


def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(path=tmp_path / "state" / "sidecar-state.json", clock=lambda: 1700000000.0)


def test_absent_is_none(tmp_path: Path) -> None:
    assert store(tmp_path).load() is None


def test_round_trip(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert s.save({"a": [1, 2.5, "x"], "big": 2**70})
    assert s.last_saved_s == 1700000000.0
    assert store(tmp_path).load() == {"a": [1, 2.5, "x"], "big": 2**70}
    # No temporary files are left next to it.
    assert sorted(p.name for p in s.path.parent.iterdir()) == ["sidecar-state.json"]


@pytest.mark.parametrize(
    "content", ['{"format": 1, "state": {"a": ', "not json", '{"format": 99, "state": {}}', "[]"]
)
def test_corrupt_snapshot_moved_aside(tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture) -> None:
    s = store(tmp_path)
    s.path.parent.mkdir(parents=True)
    s.path.write_text(content)
    assert s.load() is None
    aside = s.path.with_name("sidecar-state.json.corrupt-1700000000")
    assert aside.read_text() == content
    assert not s.path.exists()
    assert "moved to" in caplog.text


def test_copies_aside_within_one_second_keep_every_original(tmp_path: Path) -> None:
    # A crash loop on bad snapshots: named by the second alone, each copy replaced the one before.
    s = store(tmp_path)
    s.path.parent.mkdir(parents=True)
    for content in ("bad 1", "bad 2", "bad 3"):
        s.path.write_text(content)
        assert s.load() is None
    for content in ("partial 1", "partial 2"):
        s.path.write_text(content)
        assert s.keep_copy("entries dropped") is not None
    names = {p.name: p.read_text() for p in s.path.parent.iterdir() if p != s.path}
    base = "sidecar-state.json"
    assert names == {
        f"{base}.corrupt-1700000000": "bad 1",
        f"{base}.corrupt-1700000000-2": "bad 2",
        f"{base}.corrupt-1700000000-3": "bad 3",
        f"{base}.partial-1700000000": "partial 1",
        f"{base}.partial-1700000000-2": "partial 2",
    }


def test_failed_write_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = store(tmp_path)
    assert s.save({"v": 1})

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    assert not s.save({"v": 2})
    monkeypatch.undo()
    assert json.loads(s.path.read_text())["state"] == {"v": 1}
    assert sorted(p.name for p in s.path.parent.iterdir()) == ["sidecar-state.json"]


def test_unserialisable_state_is_a_failed_write(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert s.save({"v": 1})
    assert not s.save({"v": float("nan")})
    assert store(tmp_path).load() == {"v": 1}


def test_write_json_atomic_creates_directory(tmp_path: Path) -> None:
    p = tmp_path / "a" / "b" / "x.json"
    write_json_atomic(p, {"k": 1})
    assert json.loads(p.read_text()) == {"k": 1}


def test_an_older_state_is_never_written_over_a_newer_one(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert s.save({"n": 2}, generation=2)
    assert s.save({"n": 1}, generation=1)  # held by the newer one already on disk
    assert store(tmp_path).load() == {"n": 2}
    assert s.save({"n": 3}, generation=3) and s.save({"plain": True})  # unnumbered writes always go
    assert store(tmp_path).load() == {"plain": True}


def test_a_bad_fleet_policy_digest_is_dropped_alone() -> None:
    from controller.policy_store import PolicyStore
    from controller.state import parse_state, state_to_json
    from policies.presets import load_preset

    doc = state_to_json(
        policies=PolicyStore(default=load_preset("default"), source="preset:default"),
        directive_version=5,
        fleet_policy_version=2,
        fleet_policy_digest="a" * 64,
        engines={},
        clean=True,
    )
    assert parse_state(doc).fleet_policy_digest == "a" * 64
    for bad in ("xyz", 7, "A" * 64):
        saved = parse_state({**doc, "fleet_policy_digest": bad})
        assert saved.fleet_policy_digest == "" and saved.fleet_policy_version == 2
        assert any("fleet_policy_digest" in p for p in saved.problems)
    assert parse_state({k: v for k, v in doc.items() if k != "fleet_policy_digest"}).fleet_policy_digest == ""


def test_a_dangling_link_in_place_of_the_snapshot_is_said_not_silent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = store(tmp_path)
    s.path.parent.mkdir(parents=True)
    s.path.symlink_to(tmp_path / "gone" / "x.json")
    assert s.load() is None  # nothing to restore: a clean start, as without a file...
    assert "is a link to" in caplog.text and "does not exist" in caplog.text  # ...but said
    assert s.save({"a": 1}) and s.load() == {"a": 1}
