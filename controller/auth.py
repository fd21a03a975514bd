"""Who may talk to the sidecar: TLS credentials for its listeners and the admin bearer token.

Server side, ``server_credentials`` builds TLS (mTLS when a client CA is given) and
``TokenInterceptor`` checks ``authorization: Bearer <token>`` on the admin methods it guards; a
refused call ends with UNAUTHENTICATED before any handler runs and is counted. Client side,
``channel_credentials`` and ``bearer_metadata`` are what ``AdminClient`` and the engines use.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from controller.errors import ConfigError, not_regular
from policies.text import error_text

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
    problem = not_regular(path)
    if problem:
        raise ConfigError(f"{path}: {problem}", field=field)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {error_text(e)}", field=field) from None
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
            raise ValueError(f"cannot read {path}: {error_text(e)}") from None

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


def _ignore_body(_data: bytes) -> None:
    return None


def _deny(handler: Handler, message: str) -> Handler:
    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator)

    # A refused call's body is never parsed: a stranger's malformed bytes would otherwise fail in
    # the deserializer first, ending the call UNKNOWN (not UNAUTHENTICATED) with a traceback in the
    # sidecar's log per request, and a 4 MiB body would cost a parse the caller has no right to.
    des, ser = _ignore_body, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, des, ser)
    return grpc.unary_unary_rpc_method_handler(unary, des, ser)


class _Malformed:
    """What a guarded deserializer returns for bytes that are not the request message."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


class MalformedRequestGuard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Ends a unary-request call whose body is not its request message with INVALID_ARGUMENT (counted
    through ``on_reject``), before any handler runs.

    Without it the deserializer's DecodeError reaches gRPC, which ends the call UNKNOWN ("Unexpected
    DecodeError") and logs an ERROR with a traceback per request: any client that can connect (no
    token needed for a read-only call on loopback) could flood the sidecar's log. Streaming-request
    methods (the engine's ``Attach``) are left as they are: their servicer reads the messages itself.
    """

    def __init__(self, *, on_reject: Callable[[str, str], None]) -> None:
        self.on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        name = method.rsplit("/", 1)[-1]
        parse = handler.request_deserializer

        def des(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as e:  # DecodeError, or whatever else the message's parser raises
                return _Malformed(str(e).splitlines()[0] if str(e) else type(e).__name__)

        async def refuse(request: _Malformed, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            self.on_reject(name, "malformed_request")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{name}: the request is not a valid message ({request.why})",
            )

        ser = handler.response_serializer
        # Handlers may be async generators (WatchDecisions), coroutines writing with context.write
        # (health's Watch) or plain functions; the last are left unguarded rather than misrun.
        if handler.response_streaming:
            inner_stream: Any = handler.unary_stream
            if inspect.isasyncgenfunction(inner_stream):

                async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                    if isinstance(request, _Malformed):
                        await refuse(request, context)
                    responses = inner_stream(request, context)
                    try:
                        async for m in responses:
                            yield m
                    finally:  # however this one ends, the handler's own cleanup (unwatch) runs now
                        await responses.aclose()

                return grpc.unary_stream_rpc_method_handler(streaming, des, ser)
            if inspect.iscoroutinefunction(inner_stream):

                async def writing(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                    if isinstance(request, _Malformed):
                        await refuse(request, context)
                    return await inner_stream(request, context)

                return grpc.unary_stream_rpc_method_handler(writing, des, ser)
            return handler
        inner_unary: Any = handler.unary_unary
        if not inspect.iscoroutinefunction(inner_unary):
            return handler

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, _Malformed):
                await refuse(request, context)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
