"""The sidecar's hold on its state directory, and the one file it may remove there.

What must hold: one sidecar per state directory (a second one would take over the engine socket and
the endpoints file and write the same snapshot), enforced by an exclusive ``flock`` on
``<state_dir>/sidecar.lock`` that the kernel releases when the process dies, kill -9 included; and a
socket path is only ever unlinked when what is there is a socket nobody listens on (a stale one from
an earlier run), never a live one (another sidecar with another state directory but the same socket
path would cut the first off from its engines for good) nor a regular file, directory or symlink a
mistyped ``engine_listen`` happens to name. Anything but a regular file at the lock's path (a
directory, FIFO, symlink) stops the start with one line naming it. A TCP address another process
listens on is found before gRPC tries it (``tcp_address_taken``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

from controller.errors import ConfigError
from policies.text import error_text

LOCK_NAME = "sidecar.lock"


class StateDirLocked(OSError):
    """Another live process holds the state directory."""


class SocketInUse(OSError):
    """Another live process listens on a Unix socket path the sidecar was told to listen on."""


class StateDirLock:
    """An exclusive lock on a state directory, held until ``release`` (or the process ends)."""

    def __init__(self, *, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, state_dir: Path) -> StateDirLock:
        """Raises StateDirLocked when another sidecar holds ``state_dir``, OSError when it is unusable."""
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = state_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError as e:
            raise OSError(f"state_dir lock {path} cannot be opened: {error_text(e)}") from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):  # a FIFO took the lock, then failed to truncate, naming nothing
                raise OSError(
                    f"state_dir lock {path} is {'a FIFO' if stat.S_ISFIFO(mode) else 'not a regular file'}"
                    ", not the sidecar's lock file: move it away and start again"
                )
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise StateDirLocked(
                f"state_dir {state_dir} is in use by another sidecar"
                + (f" (pid {holder})" if holder.isdigit() else "")
                + "; give each sidecar its own state_dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # a full disk or read-only state_dir: say which file, let go of the lock
            os.close(fd)
            raise OSError(f"state_dir lock {path} cannot be written: {error_text(e)}") from None
        return cls(fd=fd, path=path)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the descriptor drops the flock


def tcp_address_taken(host: str, port: int) -> bool:
    """Whether another process listens on ``host:port`` (the bind gRPC would make fails with
    EADDRINUSE). Asked before gRPC binds, which logs its own multi-line error first (``E... add_port.cc``),
    and again after a failed start, to name the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def remove_stale_socket(path: Path, *, field: str) -> None:
    """Unlink ``path`` if it is a socket nobody listens on (left by an earlier run, it would block the
    bind); a live one raises SocketInUse. Anything else there is refused with a ConfigError: the
    sidecar never deletes a file it did not make."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a symlink"
            if stat.S_ISLNK(st.st_mode)
            else "a file"
        )
        raise ConfigError(f"{path} exists and is {kind}, not a socket; refusing to remove it", field=field)
    if _listened_on(path):
        raise SocketInUse(f"{field} {path} is in use: another process listens there; refusing to remove it")
    path.unlink()


def _listened_on(path: Path) -> bool:
    """Whether a process listens on the Unix socket ``path``. Only a connection refused (or the path
    gone meanwhile) means nobody does: anything else, a full backlog's EAGAIN or a timeout included,
    is a live listener that is busy, and its socket must stay."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()
    return True
