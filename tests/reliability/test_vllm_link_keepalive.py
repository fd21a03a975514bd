"""The vLLM plugin's link finds a connection whose peer vanished without a reset, and reconnects.

A real sidecar behind a proxy that freezes the link's connection (a partitioned network: bytes go
nowhere, no FIN or RST). Without keepalive pings the link's stream waited on that socket for the
kernel's TCP timeout (hours): no directive arrived, the engine ran on its safe default, and nothing it
reported reached the sidecar. With them the link declares the connection dead, reconnects (the proxy
forwards new connections) and resends what the sidecar did not acknowledge. The pings are permitted by
the sidecar: a healthy stream is never closed for them (gRPC's server default answers pings more often
than every 5 minutes with GOAWAY).
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
from tests.integration.test_sidecar_grpc import until
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
