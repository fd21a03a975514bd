"""Admin API authentication: bearer token and mTLS, and the refusal to expose it without either."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from controller.auth import ClientTLS
from controller.client import AdminClient
from controller.config import SidecarConfig
from controller.errors import ConfigError
from controller.server import SidecarServer as Sidecar
from tests.integration.test_sidecar_grpc import STATIC_EAGLE3_2, WAIT_S, loopback_config
from tests.security.certs import Certs, make_certs

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOKEN = "0123456789abcdef0123456789abcdef"


def _config(tmp_path: Path, **kw: object) -> SidecarConfig:
    return loopback_config(tmp_path, **kw)


def _token_file(tmp_path: Path, token: str = TOKEN) -> str:
    p = tmp_path / "admin-token"
    p.write_text(token + "\n")
    p.chmod(0o600)
    return str(p)


async def _started(cfg: SidecarConfig) -> Sidecar:
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc.start()
    return sc


def rejected(sc: Sidecar, reason: str) -> float:
    return (
        sc.registry.get_sample_value("speccontrol_rejected_admin_requests_total", {"reason": reason}) or 0.0
    )


@pytest.fixture
async def token_sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    sc = await _started(_config(tmp_path, admin_token_file=_token_file(tmp_path)))
    try:
        yield sc
    finally:
        await sc.stop(snapshot=False)


async def test_mutating_calls_need_the_token_on_loopback(token_sidecar: Sidecar) -> None:
    sc = token_sidecar
    async with AdminClient(target=sc.admin_target) as anon:
        # Read-only calls stay open on loopback.
        assert (await anon.get_policy()).name == "default"
        await anon.status()
        for call in (lambda: anon.set_policy(STATIC_EAGLE3_2, source="s.yaml"), anon.rollback_policy):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with AdminClient(target=sc.admin_target, token="wrong-token-wrong-token") as wrong:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await wrong.set_policy(STATIC_EAGLE3_2, source="s.yaml")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert rejected(sc, "token_missing") == 2
    assert rejected(sc, "token_invalid") == 1
    assert (sc.policy_store.default.spec.name, sc.policy_store.default.revision) == ("default", 1)
    async with AdminClient(target=sc.admin_target, token=TOKEN) as admin:
        info = await admin.set_policy(STATIC_EAGLE3_2, source="s.yaml")
        assert (info.name, info.revision) == ("static-eagle3-2", 2)
        assert (await admin.rollback_policy()).name == "default"


async def test_cli_sends_the_token_from_a_file_or_the_environment(
    token_sidecar: Sidecar, tmp_path: Path
) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(STATIC_EAGLE3_2)
    base = [sys.executable, "-m", "controller.cli", "--admin", token_sidecar.admin_target]
    env = {k: v for k, v in os.environ.items() if k != "SPECCONTROL_ADMIN_TOKEN"} | {"PYTHONPATH": str(REPO)}

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *args], capture_output=True, text=True, timeout=WAIT_S * 3, env=env | extra, cwd=REPO
        )

    import asyncio

    denied = await asyncio.to_thread(run, "policy", "set", str(policy))
    assert denied.returncode == 2
    assert denied.stderr.startswith("unauthenticated: token missing")
    assert "--token-file" in denied.stderr and len(denied.stderr.splitlines()) == 1
    ok = await asyncio.to_thread(run, "--token-file", _token_file(tmp_path), "policy", "set", str(policy))
    assert ok.returncode == 0, ok.stderr
    back = await asyncio.to_thread(run, "policy", "rollback", SPECCONTROL_ADMIN_TOKEN=TOKEN)
    assert back.returncode == 0, back.stderr


async def test_beyond_loopback_every_admin_call_needs_the_token_but_health_stays_open(tmp_path: Path) -> None:
    sc = await _started(_config(tmp_path, admin_listen="0.0.0.0:0", admin_token_file=_token_file(tmp_path)))
    try:
        async with AdminClient(target=sc.admin_target) as anon:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await anon.status()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in anon.watch_decisions():
                    pass
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with grpc.aio.insecure_channel(sc.admin_target) as ch:  # kubelet probes
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        async with AdminClient(target=sc.admin_target, token=TOKEN) as admin:
            assert (await admin.status()).policy.name == "default"
    finally:
        await sc.stop(snapshot=False)


def test_admin_beyond_loopback_without_auth_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="admin_listen: the admin API beyond loopback needs authentication"):
        _config(tmp_path, admin_listen="0.0.0.0:50062")
    for ok in ("127.0.0.1:0", "[::1]:0", "localhost:0", f"unix://{tmp_path}/admin.sock"):
        _config(tmp_path, admin_listen=ok)


def test_serve_refuses_to_start_with_an_open_admin_api(tmp_path: Path) -> None:
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\nadmin_listen: 0.0.0.0:0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "controller.serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=WAIT_S * 3,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {cfg}:2: admin_listen: the admin API beyond loopback needs")
    assert len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "state").exists()  # refused before anything was created


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("short", "at least 16 printable ASCII characters"),
        ("with a space in it 12345", "without spaces"),
        # (gRPC clients refuse such bytes in a header: every mutating call failed on the client side)
        ("tökén-nöt-äscii-1234567", "printable ASCII"),
        ("bell\x07-in-the-token-123456", "printable ASCII"),
        (None, "cannot read"),
    ],
)
async def test_a_bad_token_file_fails_the_start(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "tok"
    if content is not None:
        path.write_text(content)
    sc = Sidecar(config=_config(tmp_path, admin_token_file=str(path)), registry=CollectorRegistry())
    with pytest.raises(ConfigError, match=f"admin_token_file: .*{match}"):
        await sc.start()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


async def test_admin_mtls_beyond_loopback(tmp_path: Path, certs: Certs) -> None:
    cfg = _config(
        tmp_path,
        admin_listen="0.0.0.0:0",
        admin_tls_cert_file=str(certs.server_cert),
        admin_tls_key_file=str(certs.server_key),
        admin_tls_client_ca_file=str(certs.ca),
    )
    sc = await _started(cfg)
    try:
        good = ClientTLS(
            ca_file=str(certs.ca), cert_file=str(certs.client_cert), key_file=str(certs.client_key)
        )
        async with AdminClient(target=sc.admin_target, tls=good, timeout=WAIT_S) as admin:
            assert (await admin.set_policy(STATIC_EAGLE3_2, source="s.yaml")).revision == 2
        for bad in (
            ClientTLS(ca_file=str(certs.ca)),  # no client certificate
            ClientTLS(ca_file=str(certs.ca), cert_file=str(certs.rogue_cert), key_file=str(certs.rogue_key)),
        ):
            async with AdminClient(target=sc.admin_target, tls=bad, timeout=2.0) as admin:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await admin.status()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails
        async with AdminClient(target=sc.admin_target, timeout=2.0) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError):
                await plaintext.status()
    finally:
        await sc.stop(snapshot=False)


def test_tls_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match="admin_tls_key_file: admin_tls_cert_file and admin_tls_key_file go"
    ):
        _config(tmp_path, admin_tls_cert_file="/x.crt")
    with pytest.raises(ConfigError, match="admin_tls_client_ca_file: needs admin_tls_cert_file"):
        _config(tmp_path, admin_tls_client_ca_file="/ca.crt")
    with pytest.raises(ConfigError, match="engine_tls_cert_file: TLS is for TCP listeners"):
        _config(
            tmp_path, engine_listen="unix:///tmp/x.sock", engine_tls_cert_file="/a", engine_tls_key_file="/b"
        )


@pytest.mark.parametrize("method", ["GetStatus", "ListEngines", "SetPolicy"])
async def test_a_body_that_is_no_message_is_invalid_argument_counted_and_changes_nothing(
    token_sidecar: Sidecar, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Through the sidecar's own servers (the guard wired in controller.server): it was UNKNOWN,
    # "Unexpected DecodeError", with an ERROR and a traceback in the log per request.
    sc = token_sidecar
    async with grpc.aio.insecure_channel(sc.admin_target) as ch:
        call = ch.unary_unary(f"/controller.v1.AdminService/{method}")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(b"\xff\xff\xff\xff", metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(f"{method}: the request is not a valid message")
    assert rejected(sc, "malformed_request") == 1
    assert "Traceback" not in caplog.text
    assert (sc.policy_store.default.spec.name, sc.policy_store.default.revision) == ("default", 1)
