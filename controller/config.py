"""The sidecar's configuration: a typed, frozen value validated at the edge, loaded from YAML.

Every field has a default, so the sidecar serves with no file at all. Errors read
``FILE:LINE: field: message`` like policy errors do.
"""

from __future__ import annotations

import math
import re
import socket
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from controller._mqtt import BrokerSettings

MAX_CONFIG_BYTES = 64 * 1024
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FLEET_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_NODE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


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
    #: The fleet link's broker, ``mqtt://host[:port]`` or ``mqtts://host[:port]`` (TLS); ``""`` disables
    #: the link. A password belongs in ``mqtt_password_file``, not in the URL.
    mqtt_url: str = ""
    mqtt_username: str = ""
    #: A file holding the broker password (e.g. a mounted Secret); read when the sidecar starts.
    mqtt_password_file: str = ""
    #: CA bundle for ``mqtts://`` (default: the system trust store); client certificate and key for mTLS.
    mqtt_ca_file: str = ""
    mqtt_cert_file: str = ""
    mqtt_key_file: str = ""
    #: Skip the broker's host name check (test brokers with self-signed certificates only).
    mqtt_tls_insecure: bool = False
    #: This sidecar's name in the fleet (MQTT client id, ``node`` of what it publishes); ``""``: the
    #: host name, i.e. the pod name. Must be unique within the fleet.
    node_id: str = ""
    #: Seconds between shares of the learned statistics per model (the warm start of new replicas).
    posteriors_interval_s: float = 30.0
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
        if not FLEET_NAME_RE.match(_str(self, "fleet")):
            raise ConfigError("1-64 letters, digits, '-', '_' or '.'", field="fleet")
        self._check_mqtt()
        _number(self, "posteriors_interval_s", 0.1, 86400.0)
        level = _str(self, "log_level").upper()
        if level not in LOG_LEVELS:
            raise ConfigError(
                f"expected one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}", field="log_level"
            )
        object.__setattr__(self, "log_level", level)

    def _check_mqtt(self) -> None:
        for name in (
            "mqtt_username",
            "mqtt_password_file",
            "mqtt_ca_file",
            "mqtt_cert_file",
            "mqtt_key_file",
        ):
            _str(self, name)
        if not isinstance(self.mqtt_tls_insecure, bool):
            raise ConfigError(
                f"expected true or false, got {self.mqtt_tls_insecure!r}", field="mqtt_tls_insecure"
            )
        node = _str(self, "node_id")
        if node and not _NODE_RE.match(node):
            raise ConfigError("1-128 letters, digits, '-', '_' or '.'", field="node_id")
        url = _str(self, "mqtt_url")
        if not url:
            return
        tls = url.startswith("mqtts://")
        for name in ("mqtt_ca_file", "mqtt_cert_file", "mqtt_key_file", "mqtt_tls_insecure"):
            if getattr(self, name) and not tls:
                raise ConfigError("needs an mqtts:// mqtt_url (TLS)", field=name)
        if self.mqtt_key_file and not self.mqtt_cert_file:
            raise ConfigError("given without mqtt_cert_file", field="mqtt_key_file")
        try:
            self.broker_settings(password="")
        except ValueError as e:
            raise ConfigError(str(e), field="mqtt_url") from None

    def broker_settings(self, *, password: str | None = None) -> BrokerSettings | None:
        """The fleet link's broker, or None when ``mqtt_url`` is empty. Raises ConfigError.

        Reads ``mqtt_password_file`` unless ``password`` is given.
        """
        from controller._mqtt import BrokerSettings

        if not self.mqtt_url:
            return None
        opts: dict[str, object] = {
            "ca_file": self.mqtt_ca_file or None,
            "cert_file": self.mqtt_cert_file or None,
            "key_file": self.mqtt_key_file or None,
            "tls_insecure": self.mqtt_tls_insecure,
        }
        if self.mqtt_username:
            opts["username"] = self.mqtt_username
        if password is None and self.mqtt_password_file:
            try:
                password = Path(self.mqtt_password_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(
                    f"cannot read {self.mqtt_password_file}: {getattr(e, 'strerror', None) or e}",
                    field="mqtt_password_file",
                ) from None
        if password:
            opts["password"] = password
        return BrokerSettings.from_url(self.mqtt_url, **opts)

    @property
    def fleet_node_id(self) -> str:
        """``node_id``, or the host name (the pod name in Kubernetes)."""
        return self.node_id or socket.gethostname()

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
