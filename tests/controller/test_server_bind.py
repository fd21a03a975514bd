"""The sidecar's listeners bound for real: a Unix socket path as long as the kernel and the config
take (107 bytes) serves its clients."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.client import AdminClient
from controller.config import SidecarConfig
from controller.server import SidecarServer
from controller.wire.address import MAX_UNIX_PATH
from tests.controller.test_sidecar_unit import info


@pytest.mark.parametrize("length", [105, 106, MAX_UNIX_PATH])
async def test_a_socket_path_as_long_as_the_kernel_takes_serves(short_tmp_path: Path, length: int) -> None:
    # The config takes paths of up to 107 bytes (the kernel's limit); the sidecar bound them as
    # unix://PATH, which gRPC's server refuses past 105: a config `config validate` passed failed its
    # start with gRPC's "Failed to bind" (sim_vs_engine under a long TMPDIR).
    base = short_tmp_path
    sockets = {}
    for side in ("engine", "admin"):
        tail = "x" * (length - len(str(base)) - len(side) - 7)
        sockets[side] = f"{base}/{side}-{tail}.sock"
        assert len(sockets[side].encode()) == length
    cfg = SidecarConfig(state_dir=str(base / "state"), engine_listen=f"unix://{sockets['engine']}",
                        admin_listen=f"unix://{sockets['admin']}", metrics_listen="")  # fmt: skip
    sc = SidecarServer(config=cfg, registry=CollectorRegistry())
    await sc.start()
    try:
        sc.attach(info("pod-1"))
        async with AdminClient(target=sc.admin_target) as client:
            assert [e.engine_id for e in await client.engines()] == ["pod-1"]
    finally:
        await sc.stop(snapshot=False)
