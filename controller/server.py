"""The sidecar served: the engine and admin gRPC servers (TLS, token auth, health, reflection), the
metrics endpoint, the fleet link, and the background task (decision tick, posteriors, snapshots).

``SidecarServer`` is a ``Sidecar`` bound to its sockets. What must hold: ``start`` either serves on
every configured address or leaves nothing behind (servers closed, fleet stopped, state directory
released); a Unix socket is created with ``engine_socket_mode`` and no window in which it is wider;
a broker that is down delays the start by ``FLEET_SYNC_S`` at most and never prevents it; the
background task survives any failure of one tick; ``max_engines`` engines attaching at once are all
taken, also while the loop is busy (gRPC's backlog of streams not yet taken is sized to them, see
``engine_backlog_options``). A start that fails or is cancelled at any point (also mid-bind, where
gRPC's own stop can fail once) raises what stopped it and leaves nothing behind; ``stop`` after such
a start, or a second ``stop``, does nothing (in particular it writes no snapshot into a state
directory this sidecar no longer holds).

Server reflection (what ``grpcurl list`` reads) is served only on a listener that only this host can
reach (a Unix socket or a loopback address): it lists every service and method to whoever connects,
which beyond loopback is anyone who can reach the port, before any token or certificate is asked for
the call itself. ``grpcurl -plaintext 127.0.0.1:PORT list`` works on the default (local) listeners; a
client of a listener beyond loopback uses the proto files (``grpcurl -import-path ... -proto
controller/v1/controller.proto``). Health checking is served on every listener (probes need it).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from controller.admin_service import AdminService
from controller.auth import (
    MUTATING_METHODS,
    READ_METHODS,
    MalformedRequestGuard,
    TokenInterceptor,
    server_credentials,
)
from controller.config import SidecarConfig
from controller.engine_service import EngineService
from controller.fleet import FleetLink
from controller.metrics import MetricsServer
from controller.sidecar import Sidecar
from controller.state_dir import remove_stale_socket, tcp_address_taken
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.wire.address import is_local_address, parse_address

if TYPE_CHECKING:
    from controller._mqtt import BrokerSettings

log = logging.getLogger(__name__)

#: How long start() waits for the broker's retained policy and posteriors, so engines that attach
#: right after start get the fleet's policy and a warm start. A broker that is down costs this once.
FLEET_SYNC_S = 2.0
#: The sidecar pings each engine connection this often (seconds) and closes it when a ping goes
#: unanswered for half of it (see ``_serve``).
ENGINE_KEEPALIVE_S = 30.0


#: gRPC's own limits on streams waiting to be taken by the server's loop (the soft limit, above which it
#: drops new streams at random, rising to all of them at the hard limit).
GRPC_DEFAULT_PENDING = (1000, 3000)


#: How long (s) a stream may wait in that backlog before gRPC drops it (its default, 30 s, dropped one
#: of 1,024 engines attaching at once on a loaded 2-core machine: the whole project suite beside it,
#: CANCELLED after ~34 s, never seen by the sidecar; with 8 CPU hogs beside the test, 3 of 3 runs).
#: The backlog is bounded by the limits above, so a stream waits here only while the loop works
#: through the ones before it; one that waits this long meets a sidecar stalled for minutes.
UNREQUESTED_S = 300


def engine_backlog_options(max_engines: int) -> list[tuple[str, int]]:
    """The engine server's limits on streams that arrived but are not yet taken by its event loop.

    gRPC's server keeps a stream in that backlog until the Python loop asks for the next call (one at a
    time, between everything else the loop runs); above ``grpc.server.max_pending_requests`` (1000 by
    default) it drops new streams at random, and above the hard limit (3000) all of them. A dropped
    stream ends CANCELLED (INTERNAL when the engine's Hello was still being written) without reaching
    the sidecar: no handler, no log line, no count. The default ``max_engines`` is 1024, so every
    engine attaching at once (a restart's reconnect storm) while the loop is busy with the first of
    them lost a stream or two at random (``test_stream_hostile.py::test_max_engines_streams_attach_*``
    failed about 1 run in 10: one stream past the 1000th ended CANCELLED); so did a stream that waited
    longer than gRPC's 30 s (``UNREQUESTED_S``). The soft limit leaves room
    for every engine and as many again (probes, refused and reconnecting engines), the hard limit keeps
    gRPC's ratio; neither goes below gRPC's defaults, and the backlog stays bounded (a flood is still
    dropped, by gRPC).
    """
    soft = max(GRPC_DEFAULT_PENDING[0], 2 * max_engines)
    hard = max(GRPC_DEFAULT_PENDING[1], 3 * soft)
    return [
        ("grpc.server.max_pending_requests", soft),
        ("grpc.server.max_pending_requests_hard_limit", hard),
        ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_S),
    ]


def client_target(listen: str, port: int) -> str:
    """The address a client dials for a server bound on ``listen`` (its port resolved to ``port``)."""
    addr = parse_address(listen, field="listen")
    if isinstance(addr, str):
        return f"unix://{addr}"
    host = addr[0] if addr[0] not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class SidecarServer(Sidecar):
    """The sidecar on its engine, admin and metrics addresses."""

    def __init__(
        self,
        *,
        config: SidecarConfig,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(config=config, registry=registry, clock=clock)
        self._engine_server: grpc.aio.Server | None = None
        self._admin_server: grpc.aio.Server | None = None
        self._admin_service: AdminService | None = None
        self._metrics_server: MetricsServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._engine_target = ""
        self._admin_target = ""
        self._metrics_url = ""
        self._last_snapshot_attempt = 0.0
        self._last_posteriors = 0.0

    @property
    def engine_target(self) -> str:
        return self._engine_target

    @property
    def admin_target(self) -> str:
        return self._admin_target

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics``, or ``""`` when metrics are disabled."""
        return self._metrics_url

    async def start(self) -> None:
        """Restore the snapshot, join the fleet, bind the servers and start the background task.

        The fleet link is started before the servers so that the first engines find the fleet's
        policy and posteriors in place; a broker that cannot be reached delays the start by
        ``FLEET_SYNC_S`` at most and never prevents it (the link keeps retrying in the background).
        """
        broker = self.config.broker_settings()  # reads the password file: fails before anything starts
        self.open()
        try:
            await self._join_and_serve(broker)
        except BaseException:
            # Cancelled or failed anywhere after open (also while waiting for the broker): each step
            # runs whatever the one before it raised, and the state directory is always let go.
            try:
                await self._close_servers()
                await self._stop_fleet()
            finally:
                self.close(snapshot=False)
            raise
        self._task = asyncio.create_task(self._run(), name="sidecar-tick")
        self._task.add_done_callback(self._task_done)

    async def _join_and_serve(self, broker: BrokerSettings | None) -> None:
        """Join the fleet (when a broker is configured), then bind and start the servers."""
        if broker is not None:
            self.fleet = FleetLink(
                broker=broker,
                fleet=self.config.fleet,
                node_id=self.config.fleet_node_id,
                registry=self.registry,
                policy_version=self.fleet_policy_version,
                policy_digest=self.fleet_policy_digest,
                on_policy=self._on_fleet_policy,
                on_policy_cleared=self._on_fleet_policy_cleared,
                clock=self.clock,
            )
            await self.fleet.start()
            if not await self.fleet.wait_synced(FLEET_SYNC_S):
                log.warning(
                    "fleet link: not synced with %s after %.0f s; serving with the local policy",
                    broker.describe(),
                    FLEET_SYNC_S,
                )
        await self._serve()

    async def _serve(self) -> None:
        opts = [
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            ("grpc.max_send_message_length", self.config.max_message_bytes),
            # Streams per connection; engines use one each, a flood of them is refused by gRPC.
            ("grpc.max_concurrent_streams", 256),
            # grpc sets SO_REUSEPORT by default: a second sidecar on a taken port would share it
            # silently (and steal half the connections) instead of failing to start.
            ("grpc.so_reuseport", 0),
            # Engines ping to find a dead connection (controller.vllm.link.KEEPALIVE_S: 20 s; the tests'
            # links ping every 1 s, and a gRPC client never pings more often than that). gRPC's server
            # default strikes a ping sooner than 5 minutes after the last one (nothing sent in between:
            # any headers or data the server sends clear the strikes) and the third strike is a GOAWAY.
            # Here a strike is a ping sooner than 500 ms: half the fastest legitimate period, so a ping
            # delayed by a busy loop and the next one on time are not one. Strikes stay bounded (0 is
            # unlimited), so a client flooding either socket with pings is sent away (too_many_pings)
            # instead of being answered forever. The key is the server's receive interval despite its
            # name (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS); gRPC ignores unknown keys.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 500),
            ("grpc.http2.max_ping_strikes", 2),
            # And the sidecar pings engines: a stream whose engine vanished without a reset is closed
            # within ENGINE_KEEPALIVE_S x 1.5, not the kernel's TCP timeout (hours), so the engine shows as gone and
            # its restarted process may attach under its id (refused while the old stream looks open).
            ("grpc.keepalive_time_ms", int(ENGINE_KEEPALIVE_S * 1000)),
            ("grpc.keepalive_timeout_ms", int(ENGINE_KEEPALIVE_S * 500)),
            ("grpc.http2.ping_timeout_ms", int(ENGINE_KEEPALIVE_S * 500)),  # gRPC >= 1.6x reads this one
        ]
        engine_name = pb.DESCRIPTOR.services_by_name["EngineService"].full_name
        admin_name = pb.DESCRIPTOR.services_by_name["AdminService"].full_name
        token = self.config.admin_token()  # like the broker password: a bad file fails the start
        # First: a body that is not its request message ends INVALID_ARGUMENT, counted, before any
        # handler (gRPC ended it UNKNOWN with a traceback in the log per request).
        interceptors: list[grpc.aio.ServerInterceptor[Any, Any]] = [
            MalformedRequestGuard(on_reject=self._auth_rejected)
        ]
        if token:
            local = is_local_address(self.config.admin_listen, field="admin_listen")
            guarded = MUTATING_METHODS if local else MUTATING_METHODS | READ_METHODS
            interceptors.append(TokenInterceptor(token=token, guarded=guarded, on_reject=self._auth_rejected))
        elif not is_local_address(self.config.admin_listen, field="admin_listen"):
            log.info("admin API on %s: clients authenticate with mTLS", self.config.admin_listen)
        self._engine_server = grpc.aio.server(options=opts + engine_backlog_options(self.config.max_engines))
        pb_grpc.add_EngineServiceServicer_to_server(EngineService(self), self._engine_server)  # type: ignore[no-untyped-call]
        self._admin_server = grpc.aio.server(options=opts, interceptors=interceptors)
        self._admin_service = AdminService(self)
        pb_grpc.add_AdminServiceServicer_to_server(self._admin_service, self._admin_server)  # type: ignore[no-untyped-call]
        for server, name, side in (
            (self._engine_server, engine_name, "engine"),
            (self._admin_server, admin_name, "admin"),
        ):
            hs = health.aio.HealthServicer()  # type: ignore[attr-defined]
            await hs.set("", health_pb2.HealthCheckResponse.SERVING)
            await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(hs, server)
            # Only where only this host can connect (see the module docstring).
            if is_local_address(self.config.listen_address(side), field=f"{side}_listen"):
                reflection.enable_server_reflection(
                    (name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
                )
        # Each server is started right after its bind: gRPC listens from the bind on, and a server that
        # was bound but never started ignores stop (its port stays open until it is garbage), so a
        # failure or cancel between a bind and its start would leave a port behind.
        self._engine_target = self._bind(self._engine_server, "engine")
        await self._engine_server.start()
        self._admin_target = self._bind(self._admin_server, "admin")
        await self._admin_server.start()
        if self.config.metrics_listen:
            addr = parse_address(self.config.metrics_listen, field="metrics_listen")
            assert not isinstance(addr, str)  # SidecarConfig rejects unix addresses for metrics
            self._metrics_server = MetricsServer(registry=self.registry, host=addr[0], port=addr[1])
            self._metrics_url = self._metrics_server.start()

    async def stop(self, *, snapshot: bool = True) -> None:
        """End the streams, close the servers and the fleet link, write the final snapshot and let go of
        the state directory. After a start that failed or was cancelled, or a stop, nothing is held:
        no snapshot is written then (the directory may be another sidecar's by now)."""
        snapshot = snapshot and self._lock is not None
        await self._stop_fleet()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.end_streams()
        await self._close_servers()
        self.close(snapshot=snapshot)

    async def _stop_fleet(self) -> None:
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            await fleet.stop()

    def _auth_rejected(self, method: str, why: str) -> None:
        self.admin_rejected(why)
        log.warning("admin %s refused: %s", method, why.replace("_", " "))

    # -- background ------------------------------------------------------------------------------

    async def _run(self) -> None:
        self._last_snapshot_attempt = self._last_posteriors = self.clock()
        while True:
            await asyncio.sleep(self.config.decision_tick_s)
            try:
                await self.tick_yielding()
                now = self.clock()
                if (
                    self.fleet is not None
                    and now - self._last_posteriors >= self.config.posteriors_interval_s
                ):
                    self._last_posteriors = now
                    self.publish_posteriors()
                since = now - self._last_snapshot_attempt
                # Engines are acknowledged only what a snapshot holds: while batches wait for one,
                # write every ack_interval_s (else every snapshot_interval_s).
                if since >= self.config.snapshot_interval_s or (
                    since >= self.config.ack_interval_s and self.unsaved_batches()
                ):
                    self._last_snapshot_attempt = now
                    await self.save_snapshot_async()
            except Exception:
                log.exception("sidecar tick failed; continuing")

    async def tick_yielding(self) -> None:
        """``tick``, letting the event loop run after each engine's decision round: engines that
        attached together decide in the same tick, and one synchronous pass over a hundred of them
        would hold every stream's reports (and the admin API) for the sum of their rounds."""
        now = self.clock()
        for st in list(self._engines.values()):
            if self.tick_engine(st, now):
                await asyncio.sleep(0)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("sidecar background task died", exc_info=task.exception())

    # -- sockets ---------------------------------------------------------------------------------

    def _bind(self, server: grpc.aio.Server, side: str) -> str:
        """Listen on the engine or admin address; a Unix socket gets ``engine_socket_mode``."""
        cfg = self.config
        listen = cfg.listen_address(side)
        addr = parse_address(listen, field=f"{side}_listen")
        if isinstance(addr, str):  # its length was checked with the config
            parent = Path(addr).parent
            if not parent.exists():
                parent.mkdir(parents=True, mode=0o700)
            remove_stale_socket(Path(addr), field=f"{side}_listen")
            target = f"unix://{addr}"
            # The socket is created by the bind: a tight umask closes the window before the chmod.
            old = os.umask(0o177)
            try:
                # Bound as unix:PATH: gRPC's server refuses unix://PATH past 105 bytes (grpcio 1.85,
                # "Path name should not have more than 107 characters"), where the kernel and the
                # config take 107; its clients dial either form to the end.
                server.add_insecure_port(f"unix:{addr}")
            finally:
                os.umask(old)
            os.chmod(addr, cfg.engine_socket_mode)
            return target
        host, port = addr
        if port and tcp_address_taken(host, port):  # (serve names it; gRPC's bind would log first)
            raise OSError(errno.EADDRINUSE, f"cannot listen on {listen}: the address is in use")
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        cert = getattr(cfg, f"{side}_tls_cert_file")
        if cert:
            creds = server_credentials(
                cert_file=cert,
                key_file=getattr(cfg, f"{side}_tls_key_file"),
                client_ca_file=getattr(cfg, f"{side}_tls_client_ca_file"),
                field=side,
            )
            bound = server.add_secure_port(where, creds)
        else:
            bound = server.add_insecure_port(where)
        if bound == 0:
            raise OSError(f"cannot listen on {listen}")
        return client_target(listen, bound)

    async def _close_servers(self) -> None:
        if self._admin_service is not None:
            await self._admin_service.end_watches(timeout_s=0.5)
        servers = (self._engine_server, self._admin_server)
        self._engine_server = self._admin_server = None
        for server in servers:
            if server is not None:
                await _stop_server(server)
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None


async def _stop_server(server: grpc.aio.Server) -> None:
    """``server.stop``, once more if it fails: a server whose ``start`` was cancelled raises
    InvalidStateError from its first stop (gRPC's main loop was left half set up) and is stopped, its
    port closed, by the second. A failure of the second is logged, not raised: the caller is closing
    everything else too."""
    try:
        await server.stop(grace=0.5)
        return
    except Exception as e:
        log.debug("gRPC server stop failed (%r); stopping it again", e)
    await asyncio.sleep(0)
    try:
        await server.stop(grace=0.5)
    except Exception:
        log.exception("gRPC server could not be stopped")
