"""SidecarServer's start and stop under a hostile or careless caller, over real sockets on loopback.

What must hold: a start that is cancelled at any await, or that fails to bind, raises what stopped it
(CancelledError for a cancel, never gRPC's InvalidStateError), leaves no port open and the state
directory free; ``stop`` after it, or a second ``stop``, is a no-op that writes nothing into the state
directory; server reflection is served only on listeners only this host can reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.server import SidecarServer
from controller.state_dir import StateDirLock
from controller.wire.address import parse_address

pytestmark = pytest.mark.integration

#: Only a guard against hangs; nothing asserts on how fast anything happens.
WAIT_S = 10.0
#: Enough event-loop turns to get past every await of a start on loopback without a broker (it takes
#: about six); cancelling after each of them lands the cancel at every await once.
START_STEPS = 12


def _config(tmp_path: Path, **overrides: object) -> SidecarConfig:
    fields: dict[str, object] = {
        "engine_listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "metrics_listen": "",
        "state_dir": str(tmp_path / "state"),
        "decision_tick_s": 0.02,
        **overrides,
    }
    return SidecarConfig(**fields)  # type: ignore[arg-type]


def _port_open(target: str) -> bool:
    addr = parse_address(target, field="target")
    assert not isinstance(addr, str)  # (TCP targets only)
    with socket.socket() as s:
        s.settimeout(WAIT_S)
        return s.connect_ex(addr) == 0


@contextlib.contextmanager
def _dir_free(state_dir: Path) -> Iterator[None]:
    """Asserts the state directory can be taken (nobody, this process included, holds its lock)."""
    lock = StateDirLock.acquire(state_dir)
    try:
        yield
    finally:
        lock.release()


@pytest.mark.parametrize("turns", range(START_STEPS))
async def test_a_start_cancelled_at_any_await_leaves_nothing_and_stop_is_a_no_op(
    tmp_path: Path, turns: int
) -> None:
    sc = SidecarServer(config=_config(tmp_path), registry=CollectorRegistry())
    start = asyncio.create_task(sc.start())
    for _ in range(turns):
        await asyncio.sleep(0)
    start.cancel()
    try:
        await asyncio.wait_for(start, WAIT_S)
    except asyncio.CancelledError:
        cancelled = True
    else:
        cancelled = False  # it had finished before the cancel: then it serves, and stop stops it
    if cancelled:
        for target in (sc.engine_target, sc.admin_target):
            if target:
                assert not _port_open(target), f"{target} still listening after a cancelled start"
        with _dir_free(tmp_path / "state"):
            pass
    snap = tmp_path / "state" / "sidecar-state.json"
    before = snap.stat().st_mtime_ns if snap.exists() else None
    await asyncio.wait_for(sc.stop(), WAIT_S)
    if cancelled:
        assert (snap.stat().st_mtime_ns if snap.exists() else None) == before, "stop wrote a snapshot"
    await asyncio.wait_for(sc.stop(), WAIT_S)  # a second stop: nothing more
    with _dir_free(tmp_path / "state"):
        pass


async def test_stop_after_a_start_that_could_not_bind_writes_nothing(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sc = SidecarServer(
            config=_config(tmp_path, admin_listen=f"127.0.0.1:{port}"), registry=CollectorRegistry()
        )
        with pytest.raises((OSError, RuntimeError)):
            await sc.start()
        assert not _port_open(sc.engine_target)
        snap = tmp_path / "state" / "sidecar-state.json"
        # Another sidecar takes the directory and serves from it: the failed one's stop must not
        # write its state over the new one's.
        other = SidecarServer(config=_config(tmp_path), registry=CollectorRegistry())
        await other.start()
        try:
            await other.save_snapshot_async()
            theirs = snap.read_bytes()
            await sc.stop()
            await sc.stop()
            assert snap.read_bytes() == theirs
        finally:
            await other.stop()


async def test_a_second_stop_writes_no_snapshot_into_a_directory_it_let_go(tmp_path: Path) -> None:
    sc = SidecarServer(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    await sc.stop()
    other = SidecarServer(config=_config(tmp_path), registry=CollectorRegistry())
    await other.start()
    snap = tmp_path / "state" / "sidecar-state.json"
    try:
        mtime = snap.stat().st_mtime_ns
        await asyncio.sleep(0.01)  # (a write after this would show a newer mtime on any file system)
        await sc.stop()
        assert snap.stat().st_mtime_ns == mtime
    finally:
        await other.stop()


async def _list_services(target: str, metadata: tuple[tuple[str, str], ...] = ()) -> list[str]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)  # type: ignore[no-untyped-call]
        call = stub.ServerReflectionInfo(metadata=metadata)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await asyncio.wait_for(call.read(), WAIT_S)
        await call.done_writing()
        assert isinstance(resp, reflection_pb2.ServerReflectionResponse)
        return [s.name for s in resp.list_services_response.service]


async def test_reflection_on_loopback_listeners_lists_the_services(tmp_path: Path) -> None:
    sc = SidecarServer(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    try:
        assert "controller.v1.EngineService" in await _list_services(sc.engine_target)
        assert "controller.v1.AdminService" in await _list_services(sc.admin_target)
    finally:
        await sc.stop()


async def test_reflection_on_a_unix_socket_lists_the_services(tmp_path: Path) -> None:
    sc = SidecarServer(config=_config(tmp_path, engine_listen=""), registry=CollectorRegistry())
    await sc.start()
    try:
        assert sc.engine_target.startswith("unix://")
        assert "controller.v1.EngineService" in await _list_services(sc.engine_target)
    finally:
        await sc.stop()


async def test_no_reflection_on_a_listener_beyond_loopback(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token-value\n")
    sc = SidecarServer(
        config=_config(tmp_path, admin_listen="0.0.0.0:0", admin_token_file=str(token)),
        registry=CollectorRegistry(),
    )
    await sc.start()
    try:
        # Neither without the token nor with it: the listener is reachable beyond this host.
        for md in ((), (("authorization", "Bearer s3cret-token-value"),)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _list_services(sc.admin_target, md)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # The loopback engine listener of the same sidecar still has it.
        assert "controller.v1.EngineService" in await _list_services(sc.engine_target)
    finally:
        await sc.stop()
