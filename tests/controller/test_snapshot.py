"""SnapshotStore: atomic writes, typed reads, unusable files moved aside, and what is not a file refused.

What must hold: a failed write keeps the previous snapshot and leaves no temporary file; something other
than a file in the snapshot's place stops the load with one line naming it and changes nothing (a FIFO
hung it for good); temporary files a killed write left are removed at the next load.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.snapshot import SnapshotStore, SnapshotUnusable, write_json_atomic
from tests.spawn import limited


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


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _loop(p: Path) -> None:
    p.symlink_to(p.name)


def _device(p: Path) -> None:
    p.symlink_to("/dev/null")  # /dev/zero too: a read of it never ended, growing without bound


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (_fifo, "is a FIFO, not a file"),  # the read blocked for good: the start hung, deaf to SIGTERM
        (lambda p: p.mkdir(), "is a directory, not a file"),
        (_device, "is a device, not a file"),
        (_loop, "cannot be read: Too many levels of symbolic links"),
    ],
    ids=["fifo", "directory", "device", "link-loop"],
)
def test_something_not_a_file_in_place_of_the_snapshot_is_refused_naming_it_and_left_alone(
    tmp_path: Path, make: Callable[[Path], None], said: str
) -> None:
    s = store(tmp_path)
    s.path.parent.mkdir(parents=True)
    make(s.path)
    before = sorted(p.name for p in s.path.parent.iterdir())
    got: list[object] = []

    def load() -> None:
        try:
            got.append(s.load())
        except Exception as e:  # handed to the test's thread
            got.append(e)

    t = threading.Thread(target=load, daemon=True)  # a hang fails the test rather than blocking it
    t.start()
    t.join(timeout=10)
    assert got, "the load hung"
    e = got[0]
    assert isinstance(e, SnapshotUnusable), e
    assert str(e).startswith(f"snapshot {s.path} ") and said in str(e)
    assert "\n" not in str(e)
    assert sorted(p.name for p in s.path.parent.iterdir()) == before  # nothing moved or removed


def test_temporary_files_a_killed_write_left_are_swept_at_the_next_load(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert s.save({"v": 1})
    d = s.path.parent
    left = [d / f".sidecar-state.json.{x}.tmp" for x in ("a1b2c3", "zz_9")]  # as mkstemp names them
    for p in left:
        p.write_text('{"format": 1, "state": {"v"')  # half of a snapshot
    others = [d / ".other.json.a1.tmp", d / "sidecar-state.json.corrupt-1", d / "notes.tmp"]
    for p in others:
        p.write_text("not the sidecar's to remove")
    (d / ".sidecar-state.json.dir.tmp").mkdir()  # not a file it wrote either
    assert store(tmp_path).load() == {"v": 1}
    assert not any(p.exists() for p in left)
    assert all(p.exists() for p in others) and (d / ".sidecar-state.json.dir.tmp").is_dir()


def test_a_write_past_the_file_size_limit_keeps_the_previous_and_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    """A full disk, as a process sees it under RLIMIT_FSIZE (EFBIG midway through the new file)."""
    s = store(tmp_path)
    assert s.save({"v": 1})
    child = (
        "import json, sys; from pathlib import Path; from controller.snapshot import SnapshotStore;"
        "s = SnapshotStore(path=Path(sys.argv[1]));"
        "print(json.dumps([s.save({'v': 2, 'pad': 'x' * 200_000}), s.last_error]))"
    )
    done = subprocess.run(
        limited([sys.executable, "-c", child, str(s.path)], limit="RLIMIT_FSIZE", value=65536),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    ok, why = json.loads(done.stdout)
    assert not ok and "File too large" in why
    assert sorted(p.name for p in s.path.parent.iterdir()) == ["sidecar-state.json"]
    assert store(tmp_path).load() == {"v": 1}


@pytest.mark.parametrize("fails", ["file", "directory"])
def test_a_write_is_reported_written_exactly_when_the_new_file_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """An fsync failing (EIO) before the rename (the file's) or after it (the directory's): the caller
    undoes a change whose write failed, so a failure with the new file in place made the next start
    restore a policy change the caller was told was not made."""
    s = store(tmp_path)
    assert s.save({"v": 1})
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode) == (fails == "directory"):
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ok = s.save({"v": 2})
    monkeypatch.undo()
    assert ok == (store(tmp_path).load() == {"v": 2})
    assert ok == (fails == "directory")
    assert "Input/output error" in s.last_error
