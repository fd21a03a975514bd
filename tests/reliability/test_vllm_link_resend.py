"""The vLLM plugin's link (threads, sync gRPC) against the real sidecar through a cuttable proxy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.vllm.link import SidecarLink
from tests.controller.vllm.test_link import _record
from tests.integration.test_sidecar_grpc import until
from tests.reliability.proxy import CuttableProxy
from tests.reliability.test_reconnect_accounting import _config

pytestmark = pytest.mark.integration


async def test_vllm_link_resends_what_a_cut_stream_lost(tmp_path: Path) -> None:
    sc = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    proxy = CuttableProxy(upstream=sc.engine_target)
    await proxy.start()
    hello = pb.Hello(
        engine_id="v", model="m", max_k=4, arms=[pb.Arm(method="eagle3", k=2)], protocol_version=1
    )
    link = SidecarLink(target=proxy.target, hello=hello, flush_s=0.005, batch_max=4, backoff_s=(0.02, 0.1))
    assert link.hello.instance_id  # the link names its process
    n = 0
    try:
        link.start()
        for _ in range(5):
            await until(lambda: link.stats().connected)
            for _ in range(40):
                assert link.offer(_record(n))
                n += 1
                await asyncio.sleep(0.001)
            proxy.cut()
        await until(lambda: "v" in sc.engines() and sc.engines()["v"].loop.totals.steps == n)
        await until(lambda: link.stats().unacked_batches == 0)
        assert sc.engines()["v"].loop.totals.steps == n == 200
        assert sc.engines()["v"].loop.totals.accepted == n  # one accepted token per record
        assert link.stats().dropped_steps == 0 and link.stats().evicted_steps == 0
        assert sc.registry.get_sample_value("speccontrol_lost_report_batches_total", {"engine": "v"}) in (
            None,
            0.0,
        )
    finally:
        await asyncio.to_thread(link.close)
        await proxy.stop()
        await sc.stop(snapshot=False)
