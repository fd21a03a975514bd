"""A local sweep in a process that runs gRPC (every test worker after a gRPC test) loses no worker.

What must hold: with gRPC's fork support set (tests/conftest.py), forked pool workers never crash in
its fork handlers. With the variable unset, 6-10 of 100 two-worker sweeps beside a live gRPC server
lost a worker ("a worker process of the sweep died"), and this test failed 3 runs of 3.
"""

from __future__ import annotations

import os
from concurrent import futures

import grpc
import pytest

from sim.executor import make_executor

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork start method")


def test_sweeps_beside_a_live_grpc_server_lose_no_worker() -> None:
    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "0"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            ex = make_executor("local", jobs=2)
            for _ in range(40):
                assert ex.map(abs, [-1, -2, -3, -4]) == [1, 2, 3, 4]
    finally:
        server.stop(grace=None)
