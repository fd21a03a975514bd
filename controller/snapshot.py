"""Atomic JSON snapshots of the sidecar's state, and the typed readers that check them on load.

A write goes to a temporary file in the same directory, is fsynced, renamed over the old file and
the directory fsynced, so a crash leaves either the old snapshot or the new one, never a mix; a write
is reported written exactly when the new file is in place (a directory fsync failing after the rename
is logged, not reported as a failure: the caller would undo what the next start restores). A
snapshot that cannot be read back (not JSON, not an object, another format version, NaN/Infinity
constants, nesting beyond the parser) is moved aside and the sidecar starts clean; something other
than a file in its place (a directory, FIFO, device, a link loop) or a file that cannot be read stops
the start with one line naming it, and nothing is changed (a FIFO used to hang the start for good).
Temporary files a write killed midway left are removed at the next start. Every value read
from a snapshot goes through ``int_field``/``float_field``/``str_field``/``mapping_field``, which
refuse a wrong type or a value outside its physical range with a ``SnapshotError`` naming the path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from controller.errors import file_kind
from controller.wire.names import escape_text, has_control
from policies.text import error_text

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
#: Counters and versions restored from a snapshot: exact in a JSON number (a float64).
MAX_COUNT = (1 << 53) - 1


class SnapshotError(ValueError):
    """A snapshot value of the wrong type or out of range; ``str()`` starts with its path."""


class SnapshotUnusable(OSError):
    """Something other than a readable file where the snapshot goes: the sidecar cannot start on it,
    and does not remove it (it never removes what it did not write)."""


def _read_regular(path: Path) -> bytes:
    """The bytes of the regular file ``path`` (a link to one is followed). Raises FileNotFoundError
    when nothing is there, SnapshotUnusable for anything else that is not a readable regular file.
    Opened non-blocking and checked before reading: a read of a FIFO with no writer never returns."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SnapshotUnusable(
            f"snapshot {path} cannot be read: {error_text(e)}; the sidecar changed nothing"
        ) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise SnapshotUnusable(
            f"snapshot {path} is {file_kind(mode)}, not a file: move it away and start again (the "
            "sidecar removes nothing it did not write)",
        )
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise SnapshotUnusable(
                f"snapshot {path} cannot be read: {error_text(e)}; the sidecar changed nothing"
            ) from None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a snapshot may hold")


def mapping_field(d: Mapping[str, Any], key: str, *, path: str) -> Mapping[str, Any]:
    v = d.get(key)
    if not isinstance(v, Mapping):
        raise SnapshotError(f"{path}.{key}: expected an object, got {type(v).__name__}")
    return v


def list_field(d: Mapping[str, Any], key: str, *, path: str, max_len: int) -> list[Any]:
    v = d.get(key)
    if not isinstance(v, list):
        raise SnapshotError(f"{path}.{key}: expected a list, got {type(v).__name__}")
    if len(v) > max_len:
        raise SnapshotError(f"{path}.{key}: {len(v)} entries exceed {max_len}")
    return v


def int_field(
    d: Mapping[str, Any], key: str, *, path: str, lo: int = 0, hi: int = MAX_COUNT, default: int | None = None
) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise SnapshotError(f"{path}.{key}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise SnapshotError(f"{path}.{key}: {v} is outside [{lo}, {hi}]")
    return v


def float_field(
    d: Mapping[str, Any], key: str, *, path: str, lo: float = 0.0, hi: float, default: float | None = None
) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SnapshotError(f"{path}.{key}: expected a number, got {type(v).__name__}")
    f = float(v) if abs(v) < 1e308 else math.inf
    if not (math.isfinite(f) and lo <= f <= hi):
        raise SnapshotError(f"{path}.{key}: {v!r} is outside [{lo:g}, {hi:g}]")
    return f


def str_field(
    d: Mapping[str, Any], key: str, *, path: str, max_len: int, default: str | None = None, name: bool = False
) -> str:
    """``d[key]`` as a string of at most ``max_len`` characters; ``name``: also without control
    characters (an id or a source the sidecar logs and echoes, as the admin API and the Hello refuse)."""
    v = d.get(key, default)
    if not isinstance(v, str):
        raise SnapshotError(f"{path}.{key}: expected a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise SnapshotError(f"{path}.{key}: longer than {max_len} characters")
    if name and has_control(v):
        raise SnapshotError(f"{path}.{key}: holds control characters ({escape_text(v)[:80]})")
    return v


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    """Replace ``path`` with ``data`` as JSON, atomically. Raises OSError/TypeError/ValueError."""
    text = json.dumps(data, sort_keys=True, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        raise NotSynced(f"{path} replaced, but its directory could not be synced: {e}") from e


class NotSynced(OSError):
    """The new file is in place (any restart reads it), but its directory's fsync failed: a power
    loss may still bring the old one back."""


class SnapshotStore:
    """One snapshot file. ``save`` never raises: a failure is logged, and the old file stays intact.

    Writes may come from two threads (a periodic one on a worker, a policy change's on the caller's):
    they take turns, and a state numbered older than the one on disk is not written over it."""

    def __init__(self, *, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.last_saved_s: float = 0.0
        #: Why the last failed write failed ("" before any failure).
        self.last_error = ""
        self._lock = threading.Lock()
        self._written = 0

    def save(self, state: Mapping[str, Any], *, generation: int = 0) -> bool:
        """Write ``state``; True when it (or, for a ``generation`` older than the last written, a newer
        state, which holds everything it does) is on disk."""
        with self._lock:
            if generation and generation < self._written:
                return True
            try:
                write_json_atomic(
                    self.path, {"format": FORMAT_VERSION, "saved_at_s": self.clock(), "state": state}
                )
            except NotSynced as e:
                # Written: what is in the file is what the next start restores, so it is reported
                # written (a "failed" write whose file was in place had the caller undo a policy
                # change the restart then brought back). The caller's state and the file agree.
                log.error("snapshot %s: written, but a power loss may still lose it: %s", self.path, e)
                self.last_error = f"{type(e).__name__}: {e}"
            except (OSError, TypeError, ValueError) as e:
                log.error("snapshot %s: write failed, previous snapshot kept: %s", self.path, e)
                self.last_error = f"{type(e).__name__}: {e}"
                return False
            self._written = max(self._written, generation)
            self.last_saved_s = self.clock()
            return True

    def load(self) -> dict[str, Any] | None:
        """The saved state, or None when there is none (or it was unreadable and moved aside). Raises
        SnapshotUnusable when something other than a file is in its place (the sidecar cannot replace a
        directory, and a FIFO or device would block or never end the read: it hung the start for good,
        deaf to SIGTERM), or the file cannot be read at all; the message names it, nothing is changed.

        Called once at start, with the state directory's lock held: temporary files an earlier process
        left mid-write (a kill -9 during a snapshot write) are removed first, as they piled up, one per
        such kill, for good."""
        self._sweep_temporaries()
        try:
            raw = _read_regular(self.path)
        except FileNotFoundError:
            if self.path.is_symlink():  # a dangling link: say so, rather than start clean in silence
                log.warning(
                    "snapshot %s is a link to %s, which does not exist: starting clean; the first "
                    "snapshot replaces the link with a file",
                    self.path,
                    os.readlink(self.path),
                )
            return None
        try:
            doc = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
            if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict):
                raise ValueError("not a sidecar snapshot (no state object)")
            if doc.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {doc.get('format')!r}, this sidecar reads format {FORMAT_VERSION}")
            saved_at = float_field(doc, "saved_at_s", path="snapshot", hi=1e11, default=0.0)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            self.quarantine(f"unreadable: {type(e).__name__}: {str(e)[:200]}")
            return None
        self.last_saved_s = saved_at
        state: dict[str, Any] = doc["state"]
        return state

    def _sweep_temporaries(self) -> None:
        """Remove ``.<name>.*.tmp`` files ``write_json_atomic`` left behind (its process was killed
        between making one and renaming it): only regular files, only of this snapshot's name."""
        prefix = f".{self.path.name}."
        try:
            names = [n for n in os.listdir(self.path.parent) if n.startswith(prefix) and n.endswith(".tmp")]
        except OSError:
            return  # no directory yet (nothing to sweep), or unreadable: the read below says so
        for n in names:
            tmp = self.path.parent / n
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(tmp).st_mode):
                    tmp.unlink()
                    log.info("snapshot %s: removed %s, left by a write that did not finish", self.path, n)

    def _aside(self, kind: str) -> Path:
        """A free name beside the snapshot: ``.<kind>-<ts>``, or ``-2``, ``-3``... after it when taken.
        Named by the second alone, a second copy within the same second (a crash loop restarting on a
        bad snapshot) replaced the first, and the original it kept was lost."""
        base = f"{self.path.name}.{kind}-{int(self.clock())}"
        aside, n = self.path.with_name(base), 1
        while aside.exists() or aside.is_symlink():
            n += 1
            aside = self.path.with_name(f"{base}-{n}")
        return aside

    def keep_copy(self, why: str) -> Path | None:
        """Copy the snapshot aside (``.partial-<ts>``): parts of it were dropped on load, and the next
        write replaces it."""
        aside = self._aside("partial")
        try:
            shutil.copyfile(self.path, aside)
        except OSError as e:
            log.warning("snapshot %s: %s; could not copy it aside (%s)", self.path, why, e)
            return None
        log.warning("snapshot %s: %s; the original is kept as %s", self.path, why, aside)
        return aside

    def quarantine(self, why: str) -> Path | None:
        """Move the snapshot aside (``.corrupt-<ts>``) so the next start is clean."""
        aside = self._aside("corrupt")
        try:
            os.replace(self.path, aside)
        except OSError as e:
            log.warning("snapshot %s: %s; could not move it aside (%s); starting clean", self.path, why, e)
            return None
        log.warning("snapshot %s: %s; moved to %s, starting clean", self.path, why, aside)
        return aside
