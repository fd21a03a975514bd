"""controller.client against a real sidecar's admin API: what one page of engines holds is bounded by the
sidecar's message limit, and the client reads every page (a sidecar of 607 engines at the 128 KiB limit
listed 331 of them through `controllerctl engines`, and said nothing of the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.client import AdminClient
from controller.config import SidecarConfig
from controller.server import SidecarServer
from tests.controller.test_sidecar_unit import info

ENGINES = 700


async def test_engines_reads_every_page_and_status_says_it_shows_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from controller import cli

    admin = f"unix://{tmp_path}/admin.sock"
    cfg = SidecarConfig(state_dir=str(tmp_path / "state"), engine_listen=f"unix://{tmp_path}/engine.sock",
                        admin_listen=admin, metrics_listen="", max_message_bytes=128 * 1024)  # fmt: skip
    server = SidecarServer(config=cfg, registry=CollectorRegistry())
    await server.start()
    try:
        for i in range(ENGINES):
            server.attach(info(f"engine-{i:04d}-" + "x" * 60))
        async with AdminClient(target=admin) as client:
            engines = await client.engines()
            status = await client.status()
        assert sorted(e.engine_id for e in engines) == sorted(
            f"engine-{i:04d}-" + "x" * 60 for i in range(ENGINES)
        )
        assert status.engines_truncated and status.engines_total == ENGINES and len(status.engines) < ENGINES

        monkeypatch.setattr(cli, "_admin_call", lambda args, call: status)
        assert cli.main(["--admin", admin, "status"]) == 0
        out = capsys.readouterr().out
        assert (
            f"engines: {ENGINES} (the first {len(status.engines)} below; `controllerctl engines` lists all)"
            in out
        )
    finally:
        await server.stop(snapshot=False)


async def test_an_engine_listed_twice_while_others_attach_is_kept_once() -> None:
    """Pages are positions in the sorted ids: an engine attaching between two pages shifts the rest by
    one, so the last of one page comes again first on the next (695 rows for 687 engines)."""
    from controller.v1 import controller_pb2 as pb

    pages = {0: (["a", "b", "c"], 3), 3: (["c", "d"], 5), 5: (["e"], 0)}

    class Stub:
        async def ListEngines(self, req: pb.ListEnginesRequest, **kw: object) -> pb.ListEnginesResponse:
            ids, nxt = pages[req.offset]
            return pb.ListEnginesResponse(
                engines=[pb.EngineStatus(engine_id=i) for i in ids], next_offset=nxt
            )

    client = AdminClient(target="unix:///nowhere")
    client._stub = Stub()  # type: ignore[assignment]
    assert [e.engine_id for e in await client.engines()] == ["a", "b", "c", "d", "e"]
