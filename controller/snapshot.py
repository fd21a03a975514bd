"""Atomic JSON snapshots of the sidecar's state.

A write goes to a temporary file in the same directory, is fsynced, renamed over the old file and
the directory fsynced, so a crash leaves either the old snapshot or the new one, never a mix. A
snapshot that cannot be read back is moved aside and the sidecar starts clean.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


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
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class SnapshotStore:
    """One snapshot file. ``save`` never raises: a failure is logged, and the old file stays intact."""

    def __init__(self, *, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.last_saved_s: float = 0.0

    def save(self, state: Mapping[str, Any]) -> bool:
        try:
            write_json_atomic(
                self.path, {"format": FORMAT_VERSION, "saved_at_s": self.clock(), "state": state}
            )
        except (OSError, TypeError, ValueError) as e:
            log.error("snapshot %s: write failed, previous snapshot kept: %s", self.path, e)
            return False
        self.last_saved_s = self.clock()
        return True

    def load(self) -> dict[str, Any] | None:
        """The saved state, or None when there is none (or it was unreadable and moved aside)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw.decode("utf-8"))
            if (
                not isinstance(doc, dict)
                or doc.get("format") != FORMAT_VERSION
                or not isinstance(doc.get("state"), dict)
            ):
                raise ValueError(f"not a format-{FORMAT_VERSION} snapshot")
        except (ValueError, UnicodeDecodeError) as e:
            self.quarantine(f"unreadable: {e}")
            return None
        self.last_saved_s = float(doc.get("saved_at_s", 0.0))
        state: dict[str, Any] = doc["state"]
        return state

    def quarantine(self, why: str) -> Path | None:
        """Move the snapshot aside (``.corrupt-<ts>``) so the next start is clean."""
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(self.clock())}")
        try:
            os.replace(self.path, aside)
        except OSError as e:
            log.warning("snapshot %s: %s; could not move it aside (%s); starting clean", self.path, why, e)
            return None
        log.warning("snapshot %s: %s; moved to %s, starting clean", self.path, why, aside)
        return aside
