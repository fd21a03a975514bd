"""Errors shared by the sidecar's settings and the vLLM plugin's: a bad setting named by where it is,
and what a file a setting names is when it is not a regular file.

A leaf module (it imports nothing of ours), so the plugin can raise and catch it without importing
the sidecar's configuration.
"""

from __future__ import annotations

import os
import stat


class ConfigError(ValueError):
    """An invalid configuration; ``str()`` reads ``source:line: field: message``."""

    def __init__(
        self, message: str, *, source: str = "<config>", line: int | None = None, field: str = ""
    ) -> None:
        self.message, self.source, self.line, self.field = message, source, line, field
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {field}: {message}" if field else f"{where}: {message}")

    def located(self, source: str) -> ConfigError:
        """This error in ``source`` when it names no file yet (raised after parsing, e.g. by
        ``SidecarConfig.check_files``, which does not know the file it was read from)."""
        if self.source != "<config>":
            return self
        return ConfigError(self.message, source=source, line=self.line, field=self.field)


def file_kind(mode: int) -> str:
    """What a node that is not a regular file is, for messages: "a directory", "a FIFO", ..."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def not_regular(path: str) -> str | None:
    """Why the file a setting names cannot be read as one ("is a FIFO, not a regular file"), asked
    before it is opened; None for a regular file (a link to one is followed: a mounted Secret's files
    are links) and for a path that cannot be looked at, whose open then says why. open() of a FIFO
    without a writer blocks until one comes, and a device's read may never end: a token or a
    certificate given as one hung the start for good."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # (ValueError: a NUL in the path)
        return None
    return None if stat.S_ISREG(mode) else f"is {file_kind(mode)}, not a regular file"
