"""Who may talk to the sidecar: TLS credentials for its listeners and the admin bearer token.

Server side, ``server_credentials`` builds TLS (mTLS when a client CA is given) and
``TokenInterceptor`` checks ``authorization: Bearer <token>`` on the admin methods it guards; a
refused call ends with UNAUTHENTICATED before any handler runs and is counted. Client side,
``channel_credentials`` and ``bearer_metadata`` are what ``AdminClient`` and the engines use.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from controller.errors import ConfigError

AUTH_HEADER = "authorization"
#: Larger than any certificate chain or key a listener would use.
MAX_PEM_BYTES = 1 << 20
ADMIN_SERVICE = "/controller.v1.AdminService/"
#: Admin methods that change what engines do.
MUTATING_METHODS = frozenset({ADMIN_SERVICE + "SetPolicy", ADMIN_SERVICE + "RollbackPolicy"})
READ_METHODS = frozenset(
    ADMIN_SERVICE + m for m in ("GetPolicy", "ListPolicies", "GetStatus", "ListEngines", "WatchDecisions")
)


def _read(path: str, field: str) -> bytes:
    """A PEM file (a certificate, a key or a CA bundle). Raises ConfigError naming ``field``: grpc
    would report a file that is not PEM only as a failed bind, naming no file."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}", field=field) from None
    if len(data) > MAX_PEM_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_PEM_BYTES} bytes, not a PEM file", field=field)
    want = b"PRIVATE KEY-----" if field.endswith("key_file") else b"CERTIFICATE-----"
    if b"-----BEGIN " not in data or want not in data:
        what = "private key" if field.endswith("key_file") else "certificate"
        raise ConfigError(f"{path}: not a PEM {what} (no '-----BEGIN ...{want.decode()}' block)", field=field)
    return data


def check_pem_files(cert_file: str, key_file: str, client_ca_file: str, *, field: str) -> None:
    """What ``server_credentials`` reads, read and checked now (``config validate``, before binding):
    each file PEM, the certificate and the CA parsed and the key the certificate's own (Python's ssl,
    the same OpenSSL checks; gRPC would say only "Failed to bind to address")."""
    import ssl

    _read(cert_file, f"{field}_tls_cert_file")
    _read(key_file, f"{field}_tls_key_file")
    if client_ca_file:
        _read(client_ca_file, f"{field}_tls_client_ca_file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        raise ConfigError(
            f"{cert_file} with {key_file}: not a certificate and its own private key ({e.reason or e})",
            field=f"{field}_tls_key_file",
        ) from None
    if client_ca_file:
        try:
            ctx.load_verify_locations(cafile=client_ca_file)
        except ssl.SSLError as e:
            raise ConfigError(
                f"{client_ca_file}: not a CA certificate bundle ({e.reason or e})",
                field=f"{field}_tls_client_ca_file",
            ) from None


def server_credentials(
    *, cert_file: str, key_file: str, client_ca_file: str = "", field: str
) -> grpc.ServerCredentials:
    """TLS for a listener; with ``client_ca_file`` clients must present a certificate it signed."""
    cert, key = _read(cert_file, f"{field}_tls_cert_file"), _read(key_file, f"{field}_tls_key_file")
    ca = _read(client_ca_file, f"{field}_tls_client_ca_file") if client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """What a client needs for a TLS listener: the CA to trust, and a certificate for mTLS."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    #: Expected server name when it differs from the target's host (e.g. a pod IP).
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs its key (and the key its certificate)")


def channel_credentials(tls: ClientTLS) -> grpc.ChannelCredentials:
    """Raises ValueError naming the file that cannot be read."""

    def read(path: str) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(tls.ca_file),
        private_key=read(tls.key_file),
        certificate_chain=read(tls.cert_file),
    )


def channel_options(tls: ClientTLS | None) -> list[tuple[str, Any]]:
    if tls is not None and tls.server_name:
        return [("grpc.ssl_target_name_override", tls.server_name)]
    return []


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def token_matches(metadata: Collection[tuple[str, str | bytes]] | None, token: str) -> str:
    """ "" when the metadata carries ``token``; else why not (a metric label)."""
    values = [v for k, v in metadata or () if k == AUTH_HEADER]
    if not values:
        return "token_missing"
    v = values[0]
    given = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    scheme, _, presented = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), token.encode()):
        return "token_invalid"
    return ""


if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses calls to ``guarded`` methods that do not carry the bearer token."""

    def __init__(
        self, *, token: str, guarded: Collection[str], on_reject: Callable[[str, str], None]
    ) -> None:
        if not token:
            raise ValueError("TokenInterceptor needs a token")
        self.token = token
        self.guarded = frozenset(guarded)
        self.on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        handler = await continuation(handler_call_details)
        if method not in self.guarded or handler is None:
            return handler
        why = token_matches(handler_call_details.invocation_metadata, self.token)  # type: ignore[attr-defined]
        if not why:
            return handler
        self.on_reject(method.rsplit("/", 1)[-1], why)
        return _deny(
            handler, f"{why.replace('_', ' ')}: this admin call needs 'authorization: Bearer <token>'"
        )


def _deny(handler: Handler, message: str) -> Handler:
    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator)

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, des, ser)
    return grpc.unary_unary_rpc_method_handler(unary, des, ser)
