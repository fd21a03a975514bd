"""The vLLM plugin's link finds a connection whose peer vanished without a reset, and reconnects.

A real sidecar behind a proxy that freezes the link's connection (a partitioned network: bytes go
nowhere, no FIN or RST). Without keepalive pings the link's stream waited on that socket for the
kernel's TCP timeout (hours): no directive arrived, the engine ran on its safe default, and nothing it
reported reached the sidecar. With them the link declares the connection dead, reconnects (the proxy
forwards new connections) and resends what the sidecar did not acknowledge. The pings are permitted by
the sidecar: a healthy stream is never closed for them (gRPC's server default answers pings more often
than every 5 minutes with GOAWAY). Within bounds: a client flooding the sidecar with pings is sent away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller import server
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.vllm.link import SidecarLink
from tests.controller.vllm.test_link import _record
from tests.integration.test_sidecar_grpc import WAIT_S, until
from tests.reliability.proxy import CuttableProxy
from tests.reliability.test_reconnect_accounting import _config

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def _linked(
    tmp_path: Path, engine_id: str, keepalive_s: float
) -> AsyncIterator[tuple[Sidecar, CuttableProxy, SidecarLink]]:
    """A started sidecar, a proxy to its engine socket and a started link through the proxy."""
    sc = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    proxy = CuttableProxy(upstream=sc.engine_target)
    await proxy.start()
    hello = pb.Hello(
        engine_id=engine_id, model="m", max_k=4, arms=[pb.Arm(method="eagle3", k=2)], protocol_version=1
    )
    link = SidecarLink(
        target=proxy.target, hello=hello, flush_s=0.01, backoff_s=(0.02, 0.1), keepalive_s=keepalive_s
    )
    try:
        link.start()
        yield sc, proxy, link
    finally:
        await asyncio.to_thread(link.close)
        await proxy.stop()
        await sc.stop(snapshot=False)


async def test_a_frozen_connection_is_found_dead_and_the_link_reconnects(tmp_path: Path) -> None:
    async with _linked(tmp_path, "ka", keepalive_s=1.0) as (sc, proxy, link):
        await until(lambda: link.stats().connected)
        for i in range(10):
            assert link.offer(_record(i))
        await until(lambda: "ka" in sc.engines() and sc.engines()["ka"].loop.totals.steps == 10)
        await asyncio.sleep(3.0)  # three pings: the sidecar permits them
        assert link.stats().disconnects == 0
        assert proxy.freeze() == 1
        for i in range(10, 20):
            assert link.offer(_record(i))
        await until(lambda: sc.engines()["ka"].loop.totals.steps == 20)
        stats = link.stats()
        assert stats.disconnects >= 1 and stats.attaches >= 2
        assert stats.dropped_steps == 0 and stats.evicted_steps == 0


async def test_the_sidecar_closes_a_frozen_engine_stream_so_the_engine_shows_as_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine side pings rarely here (an hour): only the sidecar's own pings can find the dead
    # connection. Before, the stream stayed open for the kernel's TCP timeout: the engine showed as
    # connected, and its restarted process was refused its id (engine_id_in_use) all that time.
    monkeypatch.setattr(server, "ENGINE_KEEPALIVE_S", 1.0)
    async with _linked(tmp_path, "gone", keepalive_s=3600.0) as (sc, proxy, _):
        await until(lambda: "gone" in sc.engines() and sc.engines()["gone"].connected)
        await asyncio.sleep(2.5)  # pings answered: the stream stays
        assert sc.engines()["gone"].connected
        assert proxy.freeze() == 1
        await until(lambda: not sc.engines()["gone"].connected)


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _PING, _GOAWAY, _ACK = 0x4, 0x6, 0x7, 0x1
_ENHANCE_YOUR_CALM = 0xB


def _frame(kind: int, flags: int = 0, payload: bytes = b"") -> bytes:
    """An HTTP/2 frame on stream 0, the connection's own (SETTINGS, PING and GOAWAY are)."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + bytes(4) + payload


async def _pinger(target: str, every_s: float, for_s: float) -> tuple[bool, tuple[int, bytes] | None]:
    """A bare HTTP/2 connection to ``target`` that pings every ``every_s`` seconds for ``for_s`` or until
    the server closes it, and opens no stream: the server sends it nothing that clears ping strikes.
    Whether it is still open, and the server's GOAWAY (error code, debug data) if one came.

    Not a gRPC channel: gRPC clients pace their own pings (one a second at most, whatever their
    keepalive_time_ms), so a flood comes from a peer that is not one."""
    host, _, port = target.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    goaway: tuple[int, bytes] | None = None

    async def read() -> None:  # acknowledges the server's SETTINGS and pings, as a client must
        nonlocal goaway
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readexactly(9)
                payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
                kind, flags = head[3], head[4]
                if kind == _SETTINGS and not flags & _ACK:
                    writer.write(_frame(_SETTINGS, _ACK))
                elif kind == _PING and not flags & _ACK:
                    writer.write(_frame(_PING, _ACK, payload))
                elif kind == _GOAWAY:
                    goaway = (int.from_bytes(payload[4:8], "big"), payload[8:])

    writer.write(_PREFACE + _frame(_SETTINGS))
    reading = asyncio.create_task(read())
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(for_s):
                while not reading.done():
                    writer.write(_frame(_PING, payload=bytes(8)))
                    await asyncio.sleep(every_s)
        return not reading.done(), goaway
    finally:
        writer.transport.abort()
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading


@pytest.mark.parametrize("side", ["engine", "admin"])
async def test_a_client_flooding_the_sidecar_with_pings_is_sent_away_and_engines_are_not(
    tmp_path: Path, side: str
) -> None:
    # Before, the sidecar permitted unlimited ping strikes: a client on either socket pinging without
    # pause was answered forever. A peer pinging every 0.75 s (the links' 1 s here, a quarter early
    # for jitter) and the link itself are never struck.
    async with _linked(tmp_path, "ka", keepalive_s=1.0) as (sc, _, link):
        await until(lambda: link.stats().connected)
        target = sc.engine_target if side == "engine" else sc.admin_target
        flood, polite = await asyncio.gather(
            _pinger(target, every_s=0.02, for_s=3 * WAIT_S), _pinger(target, every_s=0.75, for_s=3.5)
        )
        assert flood == (False, (_ENHANCE_YOUR_CALM, b"too_many_pings"))
        assert polite == (True, None)
        assert link.stats().connected and link.stats().disconnects == 0
