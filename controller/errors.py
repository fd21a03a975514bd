"""Errors shared by the sidecar's settings and the vLLM plugin's: a bad setting named by where it is.

A leaf module (it imports nothing of ours), so the plugin can raise and catch it without importing
the sidecar's configuration.
"""

from __future__ import annotations


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
