"""The sidecar's configuration: a typed, frozen value validated at the edge, loaded from YAML.

Every field has a default, so the sidecar serves with no file at all. Errors read
``FILE:LINE: field: message`` like policy errors do.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

MAX_CONFIG_BYTES = 64 * 1024
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FLEET_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ConfigError(ValueError):
    """An invalid configuration; ``str()`` reads ``source:line: field: message``."""

    def __init__(
        self, message: str, *, source: str = "<config>", line: int | None = None, field: str = ""
    ) -> None:
        self.message, self.source, self.line, self.field = message, source, line, field
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {field}: {message}" if field else f"{where}: {message}")


def parse_address(value: str, *, field: str) -> tuple[str, int] | str:
    """``host:port`` -> (host, port); ``unix:/path`` or ``unix:///path`` -> the path. Raises ConfigError."""
    if value.startswith("unix:"):
        path = value[len("unix:") :]
        path = path[2:] if path.startswith("//") else path
        if not path or not path.startswith("/"):
            raise ConfigError(
                "unix socket address needs an absolute path, e.g. unix:///run/sc.sock", field=field
            )
        return path
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"expected 'host:port' or 'unix:///path', got {value!r}", field=field)
    if not 0 <= int(port) <= 65535:
        raise ConfigError(f"port must be 0..65535 (0: any free port), got {port}", field=field)
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise ConfigError(f"missing host in {value!r} (use 0.0.0.0 for every interface)", field=field)
    return host, int(port)


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    #: Where engines attach (EngineService): ``host:port`` (port 0: ephemeral) or ``unix:///path/sock``.
    engine_listen: str = "127.0.0.1:50061"
    #: Where ``controllerctl`` talks to the sidecar (AdminService), same forms as ``engine_listen``.
    admin_listen: str = "127.0.0.1:50062"
    #: Prometheus ``/metrics`` over HTTP at ``host:port`` (port 0: ephemeral); ``""`` disables it.
    metrics_listen: str = "127.0.0.1:9464"
    #: Directory of the state snapshot (``sidecar-state.json``) and ``endpoints.json``.
    state_dir: str = "./.state"
    #: Seconds between periodic snapshots (one is also written on shutdown).
    snapshot_interval_s: float = 30.0
    #: The default policy at first start: a preset name (``policies/library``) or a YAML file path.
    #: A snapshot's active policy takes precedence on restart.
    default_policy: str = "default"
    #: How often the sidecar runs each engine's control loop (the loop itself decides when a round is due).
    decision_tick_s: float = 0.1
    #: gRPC receive and send limit per message.
    max_message_bytes: int = 4 * 1024 * 1024
    #: Telemetry limits: steps per report batch and request rows per step.
    max_steps_per_batch: int = 1024
    max_requests_per_step: int = 4096
    #: Fleet name (MQTT topics ``speccontrol/v1/<fleet>/...``).
    fleet: str = "default"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        for name in ("engine_listen", "admin_listen"):
            _str(self, name)
            parse_address(getattr(self, name), field=name)
        _str(self, "metrics_listen")
        if self.metrics_listen:
            if self.metrics_listen.startswith("unix:"):
                raise ConfigError(
                    "metrics are served over TCP: expected 'host:port' or ''", field="metrics_listen"
                )
            parse_address(self.metrics_listen, field="metrics_listen")
        if not _str(self, "state_dir"):
            raise ConfigError("must not be empty", field="state_dir")
        if not _str(self, "default_policy"):
            raise ConfigError("must not be empty (a preset name or a YAML file)", field="default_policy")
        _number(self, "snapshot_interval_s", 0.1, 86400.0)
        _number(self, "decision_tick_s", 0.005, 60.0)
        _integer(self, "max_message_bytes", 1024, 256 * 1024 * 1024)
        _integer(self, "max_steps_per_batch", 1, 1_000_000)
        _integer(self, "max_requests_per_step", 1, 1_000_000)
        if not _FLEET_RE.match(_str(self, "fleet")):
            raise ConfigError("1-64 letters, digits, '-', '_' or '.'", field="fleet")
        level = _str(self, "log_level").upper()
        if level not in LOG_LEVELS:
            raise ConfigError(
                f"expected one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}", field="log_level"
            )
        object.__setattr__(self, "log_level", level)

    @property
    def snapshot_path(self) -> Path:
        return Path(self.state_dir) / "sidecar-state.json"

    @property
    def endpoints_path(self) -> Path:
        return Path(self.state_dir) / "endpoints.json"


def _str(cfg: SidecarConfig, name: str) -> str:
    v = getattr(cfg, name)
    if not isinstance(v, str):
        raise ConfigError(f"expected a string, got {type(v).__name__} {v!r}", field=name)
    return v


def _number(cfg: SidecarConfig, name: str, lo: float, hi: float) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"expected a number, got {type(v).__name__} {v!r}", field=name)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ConfigError(f"must be between {lo} and {hi}, got {v!r}", field=name)
    object.__setattr__(cfg, name, float(v))


def _integer(cfg: SidecarConfig, name: str, lo: int, hi: int) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"expected an integer, got {type(v).__name__} {v!r}", field=name)
    if not lo <= v <= hi:
        raise ConfigError(f"must be between {lo} and {hi}, got {v!r}", field=name)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SidecarConfig))


def _key_lines(text: str, source: str) -> tuple[Any, dict[str, int]]:
    """The document and the line of each top-level key (1-based)."""
    lines: dict[str, int] = {}
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return {}, lines
            if isinstance(node, yaml.MappingNode):
                for k, _ in node.value:
                    if isinstance(k, yaml.ScalarNode):
                        lines.setdefault(str(k.value), k.start_mark.line + 1)
            lines[""] = node.start_mark.line + 1
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise ConfigError(
            f"invalid YAML: {e.problem or e.context}", source=source, line=mark.line + 1 if mark else None
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML: {e}", source=source) from None
    return data, lines


def parse_config(text: str, *, source: str = "<config>") -> SidecarConfig:
    """A config from YAML text. Raises ConfigError naming source, line and field."""
    if len(text.encode("utf-8", "replace")) > MAX_CONFIG_BYTES:
        raise ConfigError(f"larger than {MAX_CONFIG_BYTES} bytes", source=source)
    data, lines = _key_lines(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"expected a mapping of settings, got {type(data).__name__}", source=source, line=lines.get("")
        )
    for key in data:
        if not isinstance(key, str) or key not in FIELD_NAMES:
            raise ConfigError(
                f"unknown setting (known: {', '.join(FIELD_NAMES)})",
                source=source,
                line=lines.get(str(key)),
                field=str(key),
            )
    try:
        return SidecarConfig(**data)
    except ConfigError as e:
        raise ConfigError(
            e.message, source=source, line=lines.get(e.field, lines.get("")), field=e.field
        ) from None


def load_config(path: str | None) -> SidecarConfig:
    """The config from a YAML file, or the defaults when ``path`` is None."""
    if path is None:
        return SidecarConfig()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror or e}", source=path) from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text", source=path) from None
    return parse_config(text, source=path)
