"""The only module that imports aiomqtt: broker settings and a small connection over aiomqtt 2.x.

aiomqtt 3 changes the client API; everything else in the project goes through ``MqttConnection`` so
that a port touches this file alone.

aiomqtt 2.x asks the event loop to watch the broker's socket from paho's thread-safe callbacks
(``call_soon_threadsafe(loop.add_writer, fd, ...)``). When the connection drops between that call and
the loop running it, the loop raises EBADF on a closed descriptor and its default handler logs a
traceback, although nothing is wrong beyond the connection loss that the caller already handles. A
connection therefore installs ``_quiet_closed_socket`` as the loop's exception handler (where none is
set): that one case becomes a warning line, everything else goes to the default handler.

aiomqtt keeps the messages that arrived and were not yet read in a queue that has no bound by
default: a peer flooding the broker faster than the reader handles its messages (parsing each takes
longer than receiving it) grew it without limit, hundreds of MB in seconds, until the process ran
out of memory. A connection's queue holds at most ``max_queued_bytes`` of payload; a message that
does not fit is dropped at once and handed to ``on_dropped`` (topic, size) instead, never queued.

A connect that does not finish (the broker never answers CONNACK, so ``connect_timeout_s`` ends it,
or the caller is cancelled) closes paho's socket: aiomqtt leaves it open and watched by the loop,
so a link retrying a broker that accepts TCP and never answers leaked one socket per attempt until
the process ran out of file descriptors (and a connect cancelled by a stop lived on as a client
holding the node's client id).

aiomqtt keeps why a connection ended in a future that only its message iterator reads. A connection
lost before anything read it (during the connect itself, when another client took the client id, or
in a subscribe or publish) left it unread, and asyncio logged "Future exception was never retrieved"
with a traceback when it was collected; the caller has its ConnectionLost, so the connection reads
it (``_read_why_it_ended``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self
from urllib.parse import unquote, urlsplit

import aiomqtt

DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883
#: Default bound on the payload bytes of the messages received and not yet read (see the docstring).
MAX_QUEUED_BYTES = 64 * 1024 * 1024
#: What a queued message costs beside its payload (its topic, the objects around it): a flood of
#: empty messages is bounded too.
_MESSAGE_OVERHEAD = 512

log = logging.getLogger("controller.mqtt")
#: Loop methods aiomqtt schedules to watch the broker's socket.
_WATCHES = ("add_writer", "add_reader")


def _quiet_closed_socket(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    """The loop's exception handler: a scheduled watch of a socket that closed meanwhile is one
    warning line (see the module's docstring); anything else is the default handler's."""
    exc = context.get("exception")
    callback = getattr(context.get("handle"), "_callback", None)
    if (
        isinstance(exc, OSError)
        and exc.errno == errno.EBADF
        and getattr(callback, "__name__", "") in _WATCHES
    ):
        log.warning("MQTT: the broker's socket closed before the event loop watched it (%s); ignored", exc)
        return
    loop.default_exception_handler(context)


def _message_size(message: aiomqtt.Message) -> int:
    payload = message.payload
    return len(payload) if isinstance(payload, bytes | bytearray | str) else 0


class _Inbox(asyncio.Queue[aiomqtt.Message]):
    """aiomqtt's queue of received messages, bounded by their bytes; what does not fit is dropped."""

    max_bytes = MAX_QUEUED_BYTES
    on_dropped: Callable[[str, int], None] | None = None

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self.queued_bytes = 0

    def put_nowait(self, item: aiomqtt.Message) -> None:
        cost = _message_size(item) + len(item.topic.value) + _MESSAGE_OVERHEAD
        if self.queued_bytes + cost > self.max_bytes:
            if self.on_dropped is not None:
                self.on_dropped(item.topic.value, _message_size(item))
            return
        super().put_nowait(item)
        self.queued_bytes += cost

    def get_nowait(self) -> aiomqtt.Message:
        item = super().get_nowait()  # (``get`` ends in ``get_nowait`` too)
        self.queued_bytes -= _message_size(item) + len(item.topic.value) + _MESSAGE_OVERHEAD
        return item


def _inbox_type(max_bytes: int, on_dropped: Callable[[str, int], None] | None) -> type[_Inbox]:
    return type(
        "Inbox",
        (_Inbox,),
        {"max_bytes": max_bytes, "on_dropped": staticmethod(on_dropped) if on_dropped else None},
    )


def _read_why_it_ended(client: aiomqtt.Client) -> None:
    """Mark the exception aiomqtt will set on the connection's end as read (see the module's
    docstring): the iterator still raises it, a caller that never iterates is not logged at."""
    ended = getattr(client, "_disconnected", None)
    if isinstance(ended, asyncio.Future):
        ended.add_done_callback(lambda f: f.cancelled() or f.exception())


def _abandon(client: aiomqtt.Client) -> None:
    """Close the socket of a connect that did not finish (see the module's docstring). paho's
    ``_sock_close`` also has aiomqtt remove the loop's watches of it."""
    paho = getattr(client, "_client", None)
    close = getattr(paho, "_sock_close", None)
    if close is not None:
        try:
            close()
        except Exception as e:  # the socket is closed regardless (paho closes it in a finally)
            log.debug("MQTT: closing an unfinished connection: %s", e)


def raise_if_cancelled() -> None:
    """Raise the cancellation of the running task when one is pending that its code never saw.
    Python 3.11's ``asyncio.wait_for``, which each of aiomqtt's waits uses, returns the result of a
    future that completed as the task was cancelled and drops the cancel (3.12 fixed it): a link
    stopped just as the broker ended its connection ran on as "cancelling", reconnecting, and its
    ``stop()`` waited for good (seen in a test of two links with one client id). Call it where a
    loop would otherwise go round again."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class ConnectionLost(Exception):
    """The broker could not be reached, refused us, or went away."""


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    """Where and how to reach the MQTT broker. Validated on construction; reads no files until used."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    username: str | None = None
    password: str | None = None
    #: TLS on the connection; ``ca_file`` None uses the system's trust store.
    tls: bool = False
    ca_file: str | None = None
    #: Client certificate and key for mutual TLS.
    cert_file: str | None = None
    key_file: str | None = None
    #: Skip the server hostname check (test brokers with self-signed certificates only).
    tls_insecure: bool = False
    keepalive_s: int = 30
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.host or any(c.isspace() for c in self.host):
            raise ValueError(f"broker host: expected a host name or address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"broker port: must be 1..65535, got {self.port!r}")
        if self.password is not None and self.username is None:
            raise ValueError("broker password: given without a username")
        if (self.ca_file or self.cert_file or self.key_file or self.tls_insecure) and not self.tls:
            raise ValueError("broker TLS options (ca_file, cert_file, key_file, tls_insecure) need tls: true")
        if self.key_file and not self.cert_file:
            raise ValueError("broker key_file: given without cert_file")
        if not 5 <= self.keepalive_s <= 3600:
            raise ValueError(f"broker keepalive_s: must be 5..3600, got {self.keepalive_s!r}")
        if not 0.1 <= self.connect_timeout_s <= 300:
            raise ValueError(f"broker connect_timeout_s: must be 0.1..300, got {self.connect_timeout_s!r}")

    @classmethod
    def from_url(cls, url: str, **options: object) -> BrokerSettings:
        """``mqtt://[user[:password]@]host[:port]`` or ``mqtts://...`` (TLS, default port 8883).

        ``options`` fill the remaining fields (``ca_file``, ``keepalive_s``, ...). Raises ValueError.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            raise ValueError(f"broker URL: expected mqtt://host[:port] or mqtts://host[:port], got {url!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"broker URL: unexpected path or query in {url!r}")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"broker URL: invalid port in {url!r}") from None
        tls = parts.scheme == "mqtts"
        kw: dict[str, object] = {
            "host": parts.hostname,
            "port": port or (DEFAULT_TLS_PORT if tls else DEFAULT_PORT),
            "tls": tls,
        }
        if parts.username is not None:
            kw["username"] = unquote(parts.username)
        if parts.password is not None:
            kw["password"] = unquote(parts.password)
        kw.update(options)
        return cls(**kw)  # type: ignore[arg-type]

    def describe(self) -> str:
        """For logs: never includes the password."""
        user = f"{self.username}@" if self.username else ""
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.tls_insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


@dataclass(frozen=True, slots=True)
class Received:
    topic: str
    payload: bytes
    retain: bool


class MqttConnection:
    """One broker session: ``async with MqttConnection(...) as c``; raises ConnectionLost on any failure."""

    def __init__(
        self,
        *,
        settings: BrokerSettings,
        client_id: str,
        op_timeout_s: float = 10.0,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        on_dropped: Callable[[str, int], None] | None = None,
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self.op_timeout_s = op_timeout_s
        #: Received messages not yet read hold at most this many bytes; one that does not fit is
        #: given to ``on_dropped(topic, payload size)`` and dropped.
        self.max_queued_bytes = max_queued_bytes
        self.on_dropped = on_dropped
        self._client: aiomqtt.Client | None = None

    async def __aenter__(self) -> Self:
        s = self.settings
        loop = asyncio.get_running_loop()
        if loop.get_exception_handler() is None:
            loop.set_exception_handler(_quiet_closed_socket)
        try:
            tls = s.ssl_context()
        except (OSError, ssl.SSLError) as e:
            raise ConnectionLost(f"TLS setup failed: {e}") from None
        client = aiomqtt.Client(
            s.host,
            s.port,
            username=s.username,
            password=s.password,
            identifier=self.client_id,
            keepalive=s.keepalive_s,
            timeout=self.op_timeout_s,
            tls_context=tls,
            clean_session=True,
            queue_type=_inbox_type(self.max_queued_bytes, self.on_dropped),
        )
        _read_why_it_ended(client)
        try:
            async with asyncio.timeout(s.connect_timeout_s):
                await client.__aenter__()
            _read_why_it_ended(client)  # (a connect that finds it ended replaces it with a new one)
        except BaseException as e:
            _abandon(client)
            if isinstance(e, aiomqtt.MqttError | TimeoutError | OSError):
                raise ConnectionLost(f"cannot connect to {s.describe()}: {e or type(e).__name__}") from None
            raise
        self._client = client
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            # A hung broker must not hold up shutdown.
            async with asyncio.timeout(self.op_timeout_s):
                await client.__aexit__(exc_type, exc, tb)
        except (aiomqtt.MqttError, TimeoutError, OSError):
            pass

    def _live(self) -> aiomqtt.Client:
        if self._client is None:
            raise ConnectionLost("not connected")
        return self._client

    async def subscribe(self, topics: Sequence[str], *, qos: int = 1) -> None:
        client = self._live()
        try:
            await client.subscribe([(t, qos) for t in topics])
        except aiomqtt.MqttError as e:
            raise ConnectionLost(f"subscribe failed: {e}") from None

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        client = self._live()
        try:
            await client.publish(topic, payload, qos=qos, retain=retain)
        except aiomqtt.MqttError as e:
            raise ConnectionLost(f"publish to {topic} failed: {e}") from None

    async def messages(self) -> AsyncIterator[Received]:
        """Every message on the subscribed topics, until the connection ends (then ConnectionLost)."""
        client = self._live()
        try:
            async for m in client.messages:
                payload = m.payload
                if isinstance(payload, str):
                    payload = payload.encode()
                elif not isinstance(payload, bytes | bytearray):
                    payload = b"" if payload is None else str(payload).encode()
                yield Received(topic=m.topic.value, payload=bytes(payload), retain=bool(m.retain))
        except aiomqtt.MqttError as e:
            raise ConnectionLost(f"connection lost: {e}") from None
        raise ConnectionLost("connection closed by the broker")
