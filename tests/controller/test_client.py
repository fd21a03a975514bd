"""controller.client against a real sidecar's admin API: what one page of engines holds is bounded by the
sidecar's message limit, and the client reads every page (a sidecar of 607 engines at the 128 KiB limit
listed 331 of them through `controllerctl engines`, and said nothing of the rest)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.client import AdminClient
from controller.config import SidecarConfig
from controller.server import SidecarServer
from tests.controller.test_sidecar_unit import info

ENGINES = 700


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SidecarServer]:
    """A sidecar on Unix sockets at its smallest message limit (128 KiB: a page holds few engines)."""
    cfg = SidecarConfig(state_dir=str(tmp_path / "state"), engine_listen=f"unix://{tmp_path}/engine.sock",
                        admin_listen=f"unix://{tmp_path}/admin.sock", metrics_listen="",
                        max_message_bytes=128 * 1024)  # fmt: skip
    sc = SidecarServer(config=cfg, registry=CollectorRegistry())
    await sc.start()
    yield sc
    await sc.stop(snapshot=False)


async def test_engines_reads_every_page_and_status_says_it_shows_the_first(
    server: SidecarServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from controller import cli

    admin = server.admin_target
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


async def test_engines_attaching_between_pages_shift_nothing(server: SidecarServer) -> None:
    """Pages were positions in the sorted ids: engines attaching (or evicted) between two pages shifted
    the rest, so some came twice and others never (695 rows for 687 engines; 9 missed at the 1024 cap).
    Each page starts after the previous page's last id now: every engine held throughout comes once."""
    admin = server.admin_target
    held = [f"m-{i:04d}-" + "x" * 60 for i in range(600)]
    passing = [f"a-{i:04d}" for i in range(200)]  # sort before every held engine
    for eid in passing + held:
        server.attach(info(eid))
    page = server.engine_page
    calls = [0]

    def churn(offset: int, limit: int, after: str = "") -> object:
        out = page(offset, limit, after)
        calls[0] += 1
        for _ in range(40):  # between two pages, engines ahead of them leave (evicted at the cap)
            if passing:
                server._engines.pop(passing.pop())
        for j in range(10):  # and others arrive
            server.attach(info(f"b-{calls[0]:02d}-{j:02d}"))
        return out

    server.engine_page = churn  # type: ignore[method-assign]
    async with AdminClient(target=admin) as client:
        listed = [e.engine_id for e in await client.engines()]
    assert calls[0] > 1  # several pages
    assert len(listed) == len(set(listed))
    assert set(held) <= set(listed)
