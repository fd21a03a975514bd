"""The sidecar's configuration: a typed, frozen value validated at the edge, loaded from YAML.

Every field has a default, so the sidecar serves with no file at all. Errors read
``FILE:LINE: field: message`` like policy errors do.
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.errors import ConfigError, not_regular
from controller.wire.address import MAX_UNIX_PATH, is_local_address, parse_address
from controller.wire.names import escape_text, has_control
from policies import yamldoc
from policies.params import shown
from policies.text import error_text, name_problem

if TYPE_CHECKING:
    from controller._mqtt import BrokerSettings
    from policies.spec import PolicySpec

MAX_CONFIG_BYTES = 64 * 1024
#: A bearer token shorter than this is refused (a guessable token is no protection).
MIN_TOKEN_CHARS = 16
MAX_TOKEN_BYTES = 4096
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: A fleet's name is a level of its MQTT topics (``policies.text.name_problem``'s rule).
MAX_FLEET_NAME = 64


def header_safe(token: str) -> bool:
    """Whether ``token`` can go in a gRPC header value: printable ASCII only (a gRPC client refuses
    other bytes there, failing the call on its own side)."""
    return token.isascii() and token.isprintable()


def read_secret_file(path: str, *, field: str) -> str:
    """A token or password from a file (e.g. a mounted Secret), stripped. Raises ConfigError."""
    problem = not_regular(path)
    if problem:
        raise ConfigError(f"{path}: {problem}", field=field)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {error_text(e)}", field=field) from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_TOKEN_BYTES} bytes", field=field)
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text", field=field) from None


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    #: Where engines attach (EngineService): ``unix:///path/sock`` or ``host:port`` (port 0: ephemeral).
    #: ``""`` (the default): the Unix socket ``engine.sock`` in ``state_dir``. Unix sockets are created
    #: with ``engine_socket_mode``; TCP beyond loopback needs mTLS (``engine_tls_*``).
    engine_listen: str = ""
    #: Permissions of the engine (and admin) Unix socket; 0600: only the sidecar's user may connect.
    engine_socket_mode: int = 0o600
    #: TLS for a TCP engine listener: server certificate and key, and the CA that signs engine client
    #: certificates (set: clients must present one, i.e. mTLS).
    engine_tls_cert_file: str = ""
    engine_tls_key_file: str = ""
    engine_tls_client_ca_file: str = ""
    #: Where ``controllerctl`` talks to the sidecar (AdminService), same forms as ``engine_listen``.
    #: Beyond loopback it needs ``admin_token_file`` or mTLS (``admin_tls_client_ca_file``).
    admin_listen: str = "127.0.0.1:50062"
    #: A file holding the admin bearer token (e.g. a mounted Secret). Set: policy set and rollback need
    #: it, and so does everything else when the admin API is reachable beyond loopback. Read at start:
    #: a rotated token takes effect when the sidecar restarts.
    admin_token_file: str = ""
    #: TLS for the admin API, and the CA of client certificates (set: mTLS).
    admin_tls_cert_file: str = ""
    admin_tls_key_file: str = ""
    admin_tls_client_ca_file: str = ""
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
    #: An engine whose batches may hold more requests (vLLM's ``max_num_seqs``) is refused at its Hello
    #: (reason ``max_batch_size_over_limit``, naming this key).
    max_requests_per_step: int = 4096
    #: Per-engine cap on reported steps per second (a token bucket holding ``telemetry_burst_s`` of
    #: them); a batch beyond it is refused and counted (reason ``rate_limited``), the stream stays up.
    max_engine_steps_per_s: float = 5000.0
    telemetry_burst_s: float = 5.0
    #: Per-engine cap on reported request-steps per second (each step's requests, summed: what the
    #: sidecar's work on a batch grows with, so steps of thousands of requests within
    #: ``max_engine_steps_per_s`` cannot keep it busy); a token bucket holding ``telemetry_burst_s`` of
    #: them, and at least one batch of ``max_steps_per_batch`` x ``max_requests_per_step``. A batch
    #: beyond it is refused and counted (reason ``rate_limited_request_steps``), the stream stays up.
    #: The default is 20x an engine at 100 steps/s of 512 requests, and its burst holds that engine's
    #: backlog after an outage (the vLLM plugin queues up to 8,192 steps).
    max_engine_request_steps_per_s: float = 1_000_000.0
    #: Distinct engine ids the sidecar keeps; a Hello beyond it is refused (reason ``too_many_engines``).
    max_engines: int = 1024
    #: How often, at most, an engine hears which report batches are on disk (a directive refresh); while
    #: batches wait for that, the snapshot is written this often (an engine keeps them until then).
    ack_interval_s: float = 1.0
    #: Policy changes (set, rollback, fleet policies) per second, sustained; bursts of 10 pass.
    max_policy_changes_per_s: float = 2.0
    #: Concurrent ``WatchDecisions`` streams.
    max_watchers: int = 64
    #: Fleet name (MQTT topics ``speccontrol/v1/<fleet>/...``): 1-64 of ``[A-Za-z0-9._-]``, not ``.`` or ``..``.
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
    #: host name, i.e. the pod name. Must be unique within the fleet; 1-128 of ``[A-Za-z0-9._-]``, not
    #: ``.`` or ``..``.
    node_id: str = ""
    #: Seconds between shares of the learned statistics per model (the warm start of new replicas).
    posteriors_interval_s: float = 30.0
    #: The sidecar's log level: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case).
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if _str(self, "engine_listen"):
            parse_address(self.engine_listen, field="engine_listen")
        parse_address(_str(self, "admin_listen"), field="admin_listen")
        v = self.engine_socket_mode
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 0o777:
            raise ConfigError(f"expected a file mode 0000..0777, got {v!r}", field="engine_socket_mode")
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
        # At least what the admin API's answers need: one policy document is up to 64 KiB.
        _integer(self, "max_message_bytes", 128 * 1024, 256 * 1024 * 1024)
        _integer(self, "max_steps_per_batch", 1, 1_000_000)
        _integer(self, "max_requests_per_step", 1, 1_000_000)
        _number(self, "max_engine_steps_per_s", 1.0, 1e7)
        _number(self, "telemetry_burst_s", 0.1, 3600.0)
        _number(self, "max_engine_request_steps_per_s", 1.0, 1e10)
        _integer(self, "max_engines", 1, 1_000_000)
        _number(self, "ack_interval_s", 0.01, 3600.0)
        _number(self, "max_policy_changes_per_s", 0.01, 1000.0)
        _integer(self, "max_watchers", 0, 100_000)
        self._check_listeners()
        self._check_security()
        problem = name_problem(_str(self, "fleet"), longest=MAX_FLEET_NAME)
        if problem is not None:
            raise ConfigError(problem, field="fleet")
        self._check_mqtt()
        _number(self, "posteriors_interval_s", 0.1, 86400.0)
        level = _str(self, "log_level").upper()
        if level not in LOG_LEVELS:
            raise ConfigError(
                f"expected one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}", field="log_level"
            )
        object.__setattr__(self, "log_level", level)

    def _check_listeners(self) -> None:
        """What only the bind would find otherwise (``config validate`` checks it too)."""
        addrs = {}
        for side in ("engine", "admin"):
            addr = parse_address(self.listen_address(side), field=f"{side}_listen")
            if isinstance(addr, str) and len(addr.encode()) > MAX_UNIX_PATH:
                raise ConfigError(
                    f"socket path {addr} is longer than {MAX_UNIX_PATH} bytes; use a shorter path"
                    + (" (or a shorter state_dir)" if side == "engine" and not self.engine_listen else ""),
                    field=f"{side}_listen",
                )
            addrs[side] = addr
        if self.metrics_listen:
            addrs["metrics"] = parse_address(self.metrics_listen, field="metrics_listen")
        seen: dict[object, str] = {}
        for side, addr in addrs.items():
            if isinstance(addr, tuple) and addr[1] == 0:
                continue  # any free port: never a clash
            if addr in seen:
                raise ConfigError(f"the same address as {seen[addr]}_listen", field=f"{side}_listen")
            seen[addr] = side

    def _check_security(self) -> None:
        for side in ("engine", "admin"):
            cert, key, ca = (_str(self, f"{side}_tls_{n}_file") for n in ("cert", "key", "client_ca"))
            if bool(cert) != bool(key):
                raise ConfigError(
                    f"{side}_tls_cert_file and {side}_tls_key_file go together", field=f"{side}_tls_key_file"
                )
            if ca and not cert:
                raise ConfigError(
                    f"needs {side}_tls_cert_file (mTLS is TLS)", field=f"{side}_tls_client_ca_file"
                )
            if cert and self.listen_address(side).startswith("unix:"):
                raise ConfigError("TLS is for TCP listeners; a Unix socket is guarded by its mode",
                                  field=f"{side}_tls_cert_file")  # fmt: skip
        _str(self, "admin_token_file")
        if (
            not is_local_address(self.engine_address, field="engine_listen")
            and not self.engine_tls_client_ca_file
        ):
            raise ConfigError(
                "a TCP listener beyond loopback needs mTLS: set engine_tls_cert_file, engine_tls_key_file "
                "and engine_tls_client_ca_file (or use a unix:// socket)",
                field="engine_listen",
            )
        if (
            not is_local_address(self.admin_listen, field="admin_listen")
            and not self.admin_token_file
            and not self.admin_tls_client_ca_file
        ):
            raise ConfigError(
                "the admin API beyond loopback needs authentication: set admin_token_file or mTLS "
                "(admin_tls_cert_file, admin_tls_key_file, admin_tls_client_ca_file)",
                field="admin_listen",
            )

    def listen_address(self, side: str) -> str:
        return self.engine_address if side == "engine" else self.admin_listen

    @property
    def engine_address(self) -> str:
        """``engine_listen``, or the default socket ``unix://<state_dir>/engine.sock`` (absolute)."""
        if self.engine_listen:
            return self.engine_listen
        return f"unix://{os.path.abspath(os.path.join(self.state_dir, 'engine.sock'))}"

    def admin_token(self) -> str:
        """The admin bearer token ("" when none is configured). Raises ConfigError."""
        if not self.admin_token_file:
            return ""
        token = read_secret_file(self.admin_token_file, field="admin_token_file")
        # Printable ASCII only (header_safe): a token with other bytes started the sidecar and then
        # failed every mutating call with a client-side error.
        if len(token) < MIN_TOKEN_CHARS or not header_safe(token) or " " in token:
            raise ConfigError(
                f"{self.admin_token_file}: the token must be at least {MIN_TOKEN_CHARS} printable ASCII "
                "characters without spaces (e.g. openssl rand -hex 32)",
                field="admin_token_file",
            )
        return token

    def check_files(self) -> None:
        """What the config names on disk, read and checked as ``serve`` will use it: the state
        directory (or where it will be made), the token, password and TLS files. ``serve`` calls it
        before binding and ``config validate`` too, so the two agree. Raises ConfigError."""
        from controller.auth import check_pem_files

        _dir_usable(self.state_dir, field="state_dir")
        engine = parse_address(self.engine_address, field="engine_listen")
        if isinstance(engine, str):
            _dir_usable(os.path.dirname(engine), field="engine_listen")
        self.admin_token()
        if self.mqtt_url:
            self.broker_settings()  # reads mqtt_password_file
            # The fleet link reads its TLS files only when it connects, inside the event loop: a FIFO
            # there blocked the whole sidecar.
            for name in ("mqtt_ca_file", "mqtt_cert_file", "mqtt_key_file"):
                path = getattr(self, name)
                problem = not_regular(path) if path else None
                if problem:
                    raise ConfigError(f"{path}: {problem}", field=name)
        for side in ("engine", "admin"):
            cert = getattr(self, f"{side}_tls_cert_file")
            if cert:
                check_pem_files(
                    cert,
                    getattr(self, f"{side}_tls_key_file"),
                    getattr(self, f"{side}_tls_client_ca_file"),
                    field=side,
                )

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
        problem = name_problem(node) if node else None  # "": the host name (fleet_node_id)
        if problem is not None:
            raise ConfigError(problem, field="node_id")
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
            broker = self.broker_settings(password="")
        except ValueError as e:
            raise ConfigError(str(e), field="mqtt_url") from None
        if self.mqtt_password_file and broker is not None and broker.username is None:
            # BrokerSettings refuses a password without a user name: check_files and serve, which read
            # the file, raised that ValueError (a traceback) where --no-files had said OK
            raise ConfigError(
                "given without mqtt_username (or a user in mqtt_url)", field="mqtt_password_file"
            )

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
            password = read_secret_file(self.mqtt_password_file, field="mqtt_password_file")
        if password:
            opts["password"] = password
        return BrokerSettings.from_url(self.mqtt_url, **opts)

    def load_default_policy(self) -> tuple[PolicySpec, str]:
        """``default_policy`` as a policy, and where it came from (a preset or the file). Raises
        PolicyError naming FILE:LINE and the field. The sidecar loads it at a first start (a snapshot's
        active policy takes precedence on restart); ``controllerctl config validate`` always does."""
        from policies.presets import resolve_policy_text
        from policies.spec import parse_policy

        text, source = resolve_policy_text(self.default_policy)
        return parse_policy(text, source=source), source

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


def _dir_usable(path: str, *, field: str) -> None:
    """``path`` is a directory, or can be made one: its nearest existing ancestor is a directory in
    which a directory can be made (tried, and removed again: ``/proc`` is a directory, writable by
    root, in which mkdir still fails, so a check of modes passed what ``serve`` then could not make)."""
    p = Path(os.path.abspath(path))
    try:  # exists() raises for a name longer than the file system's (ENAMETOOLONG) or EACCES
        while not p.exists() and not p.is_symlink() and p != p.parent:
            p = p.parent
        is_dir = p.is_dir()
    except OSError as e:
        raise ConfigError(f"cannot use {path}: {error_text(e)}", field=field) from None
    if not is_dir:
        where = "" if str(p) == os.path.abspath(path) else f" (where {path} would be made)"
        raise ConfigError(f"{p} exists and is not a directory{where}", field=field)
    if str(p) == os.path.abspath(path):
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".speccontrol-check-", dir=p))
    except OSError as e:
        raise ConfigError(f"cannot make {path} in {p}: {error_text(e)}", field=field) from None


def _str(cfg: SidecarConfig, name: str) -> str:
    v = getattr(cfg, name)
    if not isinstance(v, str):
        raise ConfigError(f"expected a string, got {type(v).__name__} {v!r}", field=name)
    if has_control(v):  # paths and addresses: a NUL broke open() later, a newline forged log lines
        raise ConfigError(f"holds control characters ({escape_text(v)[:120]})", field=name)
    if not v.isascii():
        try:  # YAML's "\ud800" escape makes a lone surrogate, which no path, address or log line takes
            v.encode("utf-8")
        except UnicodeEncodeError:
            shown_v = v.encode("utf-8", "backslashreplace").decode()[:120]
            raise ConfigError(f"not valid Unicode: a lone surrogate ({shown_v})", field=name) from None
    return v


def _number(cfg: SidecarConfig, name: str, lo: float, hi: float) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"expected a number, got {type(v).__name__} {v!r}", field=name)
    if not lo <= v <= hi:  # NaN fails it too; an integer beyond a double's range never reaches float()
        raise ConfigError(f"must be between {lo} and {hi}, got {shown(v)}", field=name)
    object.__setattr__(cfg, name, float(v))


def _integer(cfg: SidecarConfig, name: str, lo: int, hi: int) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"expected an integer, got {type(v).__name__} {v!r}", field=name)
    if not lo <= v <= hi:
        raise ConfigError(f"must be between {lo} and {hi}, got {v!r}", field=name)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SidecarConfig))


#: Settings that take text, by name (``fields`` of SidecarConfig whose type is ``str``).
_TEXT_FIELDS = {f.name: f.type in (str, "str") for f in fields(SidecarConfig)}


def _key_lines(text: str, source: str) -> tuple[Any, dict[str, int]]:
    """The document and the line of each key (1-based; "" is the document's). Duplicate keys,
    deep nesting and alias bombs are refused (``policies.yamldoc``). A text setting written like a
    YAML 1.2 float (``fleet: 1e3``, which ``yamldoc`` reads as a number) is the text as written, as
    YAML 1.1 read it."""
    try:
        data, lines = yamldoc.load(text, max_depth=8, max_nodes=10_000)
    except yamldoc.YamlProblem as e:
        raise ConfigError(e.message, source=source, line=e.line, field=e.path) from None
    if isinstance(data, dict):
        for key, value in data.items():
            written = (
                lines.yaml12_float_text(key) if isinstance(key, str) and isinstance(value, float) else None
            )
            if written is not None and _TEXT_FIELDS.get(key, False):
                data[key] = written
    return ({} if data is None else data), lines.by_path


def _key_text(key: Any, lines: dict[str, int]) -> tuple[str, int | None]:
    """A key as an error names it, and its line: YAML's null (``~``) is the key None, whose ``str()``
    is no text in the file, so its line was not found."""
    if key is None:
        for text in ("~", "null", "Null", "NULL", ""):
            if text and text in lines:
                return "null", lines[text]
        return "null", None
    text = str(key)
    return (text if text.isprintable() else ascii(key)), lines.get(text)


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
            name, line = _key_text(key, lines)
            raise ConfigError(
                f"unknown setting (known: {', '.join(FIELD_NAMES)})", source=source, line=line, field=name
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
    if not path:  # Path('') is '.': the error read ": cannot read: Is a directory"
        raise ConfigError("not a file name", source="''")
    try:
        # Never read past the limit: a device (``--config /dev/zero``, a slip of the shell) was read
        # whole, gigabytes a second until the process was killed for memory.
        with Path(path).open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read: {error_text(e)}", source=path) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"larger than {MAX_CONFIG_BYTES} bytes", source=path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text", source=path) from None
    return parse_config(text, source=path)
