"""Hostile admin clients over real gRPC: what reaches the admin API unauthenticated, malformed or at
its edges gets a clear status, changes nothing and leaves the sidecar serving.

What must hold: a call refused for its token is refused as UNAUTHENTICATED whatever its body holds (the
body of a refused call is never parsed, so a stranger's malformed bytes neither change the status
nor put a traceback in the sidecar's log); the policy is unchanged and the refusal counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from controller.admin_service import AdminService
from controller.auth import MalformedRequestGuard
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from tests.integration.test_sidecar_grpc import STATIC_EAGLE3_2, WAIT_S, loopback_config, until

pytestmark = pytest.mark.integration

TOKEN = "0123456789abcdef0123456789abcdef"
ADMIN = "/controller.v1.AdminService/"
#: Bodies no request message parses from: a field longer than the body, a tag cut short, tag 0, a
#: varint cut short.
MALFORMED = (b"\x0a\x10ab", b"\xff\xff\xff\xff", b"\x00", b"\x08\x80")
#: Field 1 as a string that is not UTF-8: malformed where field 1 is a string (yaml, engine_id).
BAD_UTF8 = b"\x0a\x02\xff\xfe"
STRING_FIELD_1 = ("SetPolicy", "GetPolicy", "RollbackPolicy", "WatchDecisions")


@pytest.fixture
async def token_sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    sc = Sidecar(
        config=loopback_config(tmp_path, admin_token_file=str(token_file)), registry=CollectorRegistry()
    )
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop(snapshot=False)


def _raw(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    return channel.unary_unary(
        ADMIN + method, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )


@pytest.mark.parametrize("method", ["SetPolicy", "RollbackPolicy"])
async def test_a_refused_call_is_unauthenticated_whatever_its_body(
    token_sidecar: Sidecar, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    sc = token_sidecar
    before = sc.policy_store.default
    caplog.set_level(logging.WARNING)
    async with grpc.aio.insecure_channel(sc.admin_target) as ch:
        for body in (*MALFORMED, BAD_UTF8):
            for md in ((), (("authorization", "Bearer wrong-token-wrong-token"),)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _raw(ch, method)(body, metadata=md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    missing = sc.registry.get_sample_value(
        "speccontrol_rejected_admin_requests_total", {"reason": "token_missing"}
    )
    invalid = sc.registry.get_sample_value(
        "speccontrol_rejected_admin_requests_total", {"reason": "token_invalid"}
    )
    assert (missing, invalid) == (len(MALFORMED) + 1, len(MALFORMED) + 1)
    assert sc.policy_store.default is before
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


@pytest.fixture
async def guarded_admin(tmp_path: Path) -> AsyncIterator[tuple[str, Sidecar, list[tuple[str, str]]]]:
    """The sidecar's AdminService on a gRPC server with ``MalformedRequestGuard`` (as ``serve`` should
    install it: see the module docstring); yields its target, the sidecar and the refusals."""
    sc = Sidecar(config=loopback_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    refused: list[tuple[str, str]] = []
    server = grpc.aio.server(
        interceptors=[MalformedRequestGuard(on_reject=lambda m, why: refused.append((m, why)))]
    )
    pb_grpc.add_AdminServiceServicer_to_server(AdminService(sc), server)  # type: ignore[no-untyped-call]
    hs = health.aio.HealthServicer()  # type: ignore[attr-defined]
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", sc, refused
    finally:
        await server.stop(None)
        await sc.stop(snapshot=False)


@pytest.mark.parametrize(
    "method", ["SetPolicy", "GetPolicy", "RollbackPolicy", "ListEngines", "GetStatus", "ListPolicies"]
)
async def test_a_malformed_request_is_invalid_argument_and_changes_nothing(
    guarded_admin: tuple[str, Sidecar, list[tuple[str, str]]],
    method: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    target, sc, refused = guarded_admin
    before = sc.policy_store.default
    caplog.set_level(logging.WARNING)
    bodies = (*MALFORMED, BAD_UTF8) if method in STRING_FIELD_1 else MALFORMED
    async with grpc.aio.insecure_channel(target) as ch:
        for body in bodies:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _raw(ch, method)(body)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert (err.value.details() or "").startswith(f"{method}: the request is not a valid message")
            assert "\n" not in (err.value.details() or "")
        # the guard passes what parses (an empty body is every request with its defaults): the call
        # is answered as without it (an empty policy is refused by the handler, not the guard)
        try:
            await _raw(ch, method)(b"")
        except grpc.aio.AioRpcError as e:
            assert "not a valid message" not in (e.details() or "")
            assert method in ("SetPolicy", "RollbackPolicy"), e.details()
    assert refused == [(method, "malformed_request")] * len(bodies)
    assert sc.policy_store.default is before
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


async def test_a_malformed_watch_request_is_invalid_argument(
    guarded_admin: tuple[str, Sidecar, list[tuple[str, str]]],
) -> None:
    target, sc, refused = guarded_admin
    async with grpc.aio.insecure_channel(target) as ch:
        watch = ch.unary_stream(
            ADMIN + "WatchDecisions", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        call = watch(BAD_UTF8)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sc.watcher_count == 0
    assert refused == [("WatchDecisions", "malformed_request")]


async def test_concurrent_policy_changes_are_numbered_once_per_scope_and_survive_a_restart(
    tmp_path: Path,
) -> None:
    """Six clients set and roll back the default and three engines' policies at once: every
    acknowledged change has its own revision in its scope, the revisions of a scope have no gap, and a
    sidecar started from the state dir (no final snapshot: as after kill -9) holds the same policies."""
    cfg = loopback_config(tmp_path, max_policy_changes_per_s=1000.0)
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc.start()
    acked: list[tuple[str, int]] = []
    refused: list[grpc.StatusCode] = []

    async def client(i: int) -> None:
        async with grpc.aio.insecure_channel(sc.admin_target) as ch:
            stub = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            for j in range(30):
                scope = "" if (i + j) % 2 else f"engine-{i % 3}"
                try:
                    if j % 3 == 2:
                        info = await stub.RollbackPolicy(pb.RollbackPolicyRequest(engine_id=scope))
                    else:
                        info = await stub.SetPolicy(
                            pb.SetPolicyRequest(yaml=STATIC_EAGLE3_2, source=f"c{i}-{j}", engine_id=scope)
                        )
                except grpc.aio.AioRpcError as e:
                    refused.append(e.code())
                    continue
                # a rollback of an override's only revision removes it: the answer is the default's
                # current record, no new revision
                if info.engine_id == scope:
                    acked.append((scope, info.revision))

    try:
        await asyncio.gather(*(client(i) for i in range(6)))
        active = sorted((r.engine_id, r.revision, r.source) for r in sc.policy_store.overrides().values())
        default = sc.policy_store.default
        history = [(r.revision, r.source) for r in sc.policy_store.history()]
    finally:
        await sc.stop(snapshot=False)
    assert set(refused) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}
    assert {s for s, _ in acked} == {"", "engine-0", "engine-1", "engine-2"}
    assert len(acked) == len(set(acked)), "a revision acknowledged twice in one scope"
    for scope in {s for s, _ in acked}:
        revs = sorted(r for s, r in acked if s == scope)
        # an override removed and set again goes on numbering: still no gap and no repeat
        assert revs == list(range(revs[0], revs[0] + len(revs))), (scope, revs)
    sc2 = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc2.start()
    try:
        again = sorted((r.engine_id, r.revision, r.source) for r in sc2.policy_store.overrides().values())
        assert again == active
        d2 = sc2.policy_store.default
        assert (d2.revision, d2.source, d2.yaml) == (default.revision, default.source, default.yaml)
        assert [(r.revision, r.source) for r in sc2.policy_store.history()] == history
    finally:
        await sc2.stop(snapshot=False)


async def test_watcher_slots_are_given_back_when_watchers_leave(tmp_path: Path) -> None:
    """The watcher limit reached refuses the next one clearly; watchers that close, or connect and drop
    before reading, give their slots back (slots held by a client that vanished without a FIN are given
    back by the server's keepalive, not tested here: it takes ENGINE_KEEPALIVE_S x 1.5)."""
    sc = Sidecar(config=loopback_config(tmp_path, max_watchers=4), registry=CollectorRegistry())
    await sc.start()
    try:
        ch = grpc.aio.insecure_channel(sc.admin_target)
        stub = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
        calls = [stub.WatchDecisions(pb.WatchDecisionsRequest()) for _ in range(4)]
        await until(lambda: sc.watcher_count == 4)
        extra = stub.WatchDecisions(pb.WatchDecisionsRequest(engine_id="never-attached"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(extra.read(), WAIT_S)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 4 WatchDecisions streams" in (err.value.details() or "")
        await ch.close()
        assert calls  # closed with their channel
        await until(lambda: sc.watcher_count == 0)
        for _ in range(50):  # connect and drop, never reading
            async with grpc.aio.insecure_channel(sc.admin_target) as c:
                pb_grpc.AdminServiceStub(c).WatchDecisions(pb.WatchDecisionsRequest())  # type: ignore[no-untyped-call]
                await asyncio.sleep(0)
        await until(lambda: sc.watcher_count == 0)
        async with grpc.aio.insecure_channel(sc.admin_target) as c:
            s = pb_grpc.AdminServiceStub(c)  # type: ignore[no-untyped-call]
            again = [s.WatchDecisions(pb.WatchDecisionsRequest()) for _ in range(4)]
            await until(lambda: sc.watcher_count == 4)
            assert all(not call.done() for call in again)
    finally:
        await sc.stop(snapshot=False)


async def test_the_guard_leaves_health_checks_and_watches_working(
    guarded_admin: tuple[str, Sidecar, list[tuple[str, str]]],
) -> None:
    """Health's ``Watch`` is a coroutine writing with ``context.write``, not a generator: guarded, it
    still streams; a malformed health request is refused like an admin one."""
    target, _, refused = guarded_admin
    async with grpc.aio.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        ok = await stub.Check(health_pb2.HealthCheckRequest())
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest())
        first = await asyncio.wait_for(watch.read(), WAIT_S)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        check = ch.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(BAD_UTF8)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused == [("Check", "malformed_request")]
