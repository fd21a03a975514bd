"""Real ``controllerctl serve`` processes (issue 15, findings 3 and 5).

- ``policy set`` is written through: SIGKILL right after it is acknowledged loses nothing.
- One sidecar per state directory: a second one exits 1 with a clear error and leaves the first's
  socket and endpoints file alone; once the first dies (kill -9 included), a new one starts.
- The engine socket path is unlinked only when it is a socket: a regular file there is refused.
- Something other than a file at the lock's path (a FIFO, directory, symlink) is refused with one line
  naming it (a FIFO gave "[Errno 22] Invalid argument", naming nothing), and left as it was.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller.state_dir import LOCK_NAME, StateDirLock
from tests.integration.test_sidecar_grpc import STATIC_EAGLE3_2
from tests.reliability.serve_process import Serve, ctl

pytestmark = pytest.mark.integration


@pytest.fixture
def config(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    state = tmp_path / "state"
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        "engine_listen: ''\n"  # the default: <state_dir>/engine.sock
        "admin_listen: 127.0.0.1:0\n"
        "metrics_listen: ''\n"
        f"state_dir: {state}\n"
        "snapshot_interval_s: 3600\n"  # no periodic snapshot can rescue a lost write
    )
    yield cfg, state


def test_kill_9_right_after_policy_set_loses_nothing(config: tuple[Path, Path], tmp_path: Path) -> None:
    cfg, state = config
    policy = tmp_path / "p.yaml"
    policy.write_text(STATIC_EAGLE3_2)
    first = Serve(cfg, state)
    try:
        for _ in range(3):  # three revisions, each acknowledged, then kill -9 at once
            done = ctl("--admin", first.admin, "policy", "set", str(policy))
            assert done.returncode == 0, done.stderr
        first.kill9()
    finally:
        first.stop()
    second = Serve(cfg, state)
    try:
        got = ctl("--admin", second.admin, "policy", "get", "--json")
        assert got.returncode == 0, got.stderr
        info = json.loads(got.stdout)
        assert (info["name"], int(info["revision"])) == ("static-eagle3-2", 4)  # uint64: a string in JSON
    finally:
        second.stop()


def test_a_second_sidecar_on_the_same_state_dir_exits_1(config: tuple[Path, Path]) -> None:
    cfg, state = config
    first = Serve(cfg, state)
    try:
        endpoints = first.endpoints.read_bytes()
        sock = state / "engine.sock"
        inode = sock.stat().st_ino
        second = ctl("serve", "--config", str(cfg))
        assert second.returncode == 1
        assert f"state_dir {state} is in use by another sidecar (pid {first.proc.pid})" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.endpoints.read_bytes() == endpoints and sock.stat().st_ino == inode
        assert ctl("--admin", first.admin, "status").returncode == 0  # the first serves on
        first.kill9()  # the kernel releases the lock with the process
        third = Serve(cfg, state)
        assert third.stop() == 0
    finally:
        first.stop()


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_a_socket_path_naming_something_else_is_refused_and_left_alone(tmp_path: Path, kind: str) -> None:
    state = tmp_path / "state"
    target = tmp_path / "precious"
    if kind == "file":
        target.write_text("keep me")
    elif kind == "directory":
        target.mkdir()
    else:
        (tmp_path / "real").write_text("keep me")
        target.symlink_to(tmp_path / "real")
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"engine_listen: unix://{target}\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\nstate_dir: {state}\n"
    )
    done = ctl("serve", "--config", str(cfg))
    assert done.returncode == 2, done.stderr
    assert f"{target} exists and is a {kind}, not a socket; refusing to remove it" in done.stderr
    assert "Traceback" not in done.stderr
    assert os.path.lexists(target)
    if kind != "directory":
        assert target.read_text() == "keep me"
    # The refused start released the state dir: a correct config serves at once.
    cfg.write_text(f"admin_listen: 127.0.0.1:0\nmetrics_listen: ''\nstate_dir: {state}\n")
    assert Serve(cfg, state).stop() == 0


def test_a_second_sidecar_on_the_same_socket_path_exits_1_and_leaves_the_first_serving(
    config: tuple[Path, Path], tmp_path: Path
) -> None:
    # Another state directory, the same engine socket: the second must not unlink the first's live
    # socket (the first would keep running with no way for an engine to reach it, for good).
    cfg, state = config
    first = Serve(cfg, state)
    try:
        sock = state / "engine.sock"
        inode = sock.stat().st_ino
        other = tmp_path / "other.yaml"
        other.write_text(
            f"engine_listen: unix://{sock}\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\n"
            f"state_dir: {tmp_path / 'other-state'}\n"
        )
        second = ctl("serve", "--config", str(other))
        assert second.returncode == 1, second.stderr
        assert f"engine_listen {sock} is in use: another process listens there" in second.stderr
        assert "Traceback" not in second.stderr
        assert sock.stat().st_ino == inode
        assert ctl("--admin", first.admin, "status").returncode == 0  # the first serves on
        first.kill9()  # its socket is now stale: the second takes the path
        assert Serve(other, tmp_path / "other-state").stop() == 0
    finally:
        first.stop()


def test_a_live_socket_with_a_full_backlog_is_not_taken_for_a_stale_one(tmp_path: Path) -> None:
    # A busy sidecar that has not accepted for a moment: the probe's connect fails at once (EAGAIN),
    # which is not "nobody listens".
    from controller.state_dir import SocketInUse, remove_stale_socket

    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(path))
        srv.listen(0)
        held = []
        try:
            for _ in range(8):  # fill the backlog
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.setblocking(False)
                held.append(c)
                try:
                    c.connect(str(path))
                except BlockingIOError:
                    break
            with pytest.raises(SocketInUse, match="in use"):
                remove_stale_socket(path, field="engine_listen")
            assert path.exists()
        finally:
            for c in held:
                c.close()
    remove_stale_socket(path, field="engine_listen")  # closed: stale now, removed
    assert not path.exists()


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (os.mkfifo, "is a FIFO, not the sidecar's lock file"),  # was "[Errno 22] Invalid argument"
        (os.mkdir, "cannot be opened: Is a directory"),
        (lambda p: os.symlink("/etc/hostname", p), "cannot be opened: Too many levels of symbolic links"),
    ],
    ids=["fifo", "directory", "symlink"],
)
def test_something_not_a_file_in_place_of_the_lock_is_refused_naming_it(
    tmp_path: Path, make: Callable[[Path], None], said: str
) -> None:
    make(tmp_path / LOCK_NAME)
    with pytest.raises(OSError) as e:
        StateDirLock.acquire(tmp_path)
    assert str(e.value) == f"state_dir lock {tmp_path / LOCK_NAME} {said}" + (
        ": move it away and start again" if "FIFO" in said else ""
    )
    assert os.listdir(tmp_path) == [LOCK_NAME]  # left as it was
