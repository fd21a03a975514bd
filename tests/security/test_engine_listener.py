"""The engine telemetry listener: a 0600 Unix socket by default, mTLS for TCP beyond loopback."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from controller.auth import ClientTLS
from controller.config import SidecarConfig
from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import demo_workload
from controller.errors import ConfigError
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.vllm.link import SidecarLink
from controller.vllm.settings import PluginSettings
from tests.integration.test_sidecar_grpc import WAIT_S, TestEngine, hello, until
from tests.security.certs import Certs, make_certs

pytestmark = pytest.mark.integration


async def test_default_engine_listener_is_a_0600_unix_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the default state_dir is relative: ./.state
    cfg = SidecarConfig(admin_listen="127.0.0.1:0", metrics_listen="")
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    old = os.umask(0o000)  # even a permissive umask must not widen the socket
    try:
        await sc.start()
    finally:
        os.umask(old)
    try:
        sock = tmp_path / ".state" / "engine.sock"
        assert sc.engine_target == f"unix://{sock}"
        mode = os.stat(sock).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700  # created by the sidecar
        eng = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello("uds")))
        try:
            assert (await eng.directive()).policy == "default"
        finally:
            await eng.close()
    finally:
        await sc.stop(snapshot=False)


async def test_socket_mode_is_configurable(tmp_path: Path) -> None:
    cfg = SidecarConfig(
        engine_listen=f"unix://{tmp_path}/s/engine.sock",
        engine_socket_mode=0o660,
        admin_listen="127.0.0.1:0",
        metrics_listen="",
        state_dir=str(tmp_path / "state"),
    )
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc.start()
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "s" / "engine.sock").st_mode) == 0o660
    finally:
        await sc.stop(snapshot=False)


def test_tcp_engine_listener_beyond_loopback_needs_mtls(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="engine_listen: a TCP listener beyond loopback needs mTLS"):
        SidecarConfig(engine_listen="0.0.0.0:50061", state_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="engine_listen: a TCP listener beyond loopback needs mTLS"):
        SidecarConfig(
            engine_listen="0.0.0.0:50061",
            state_dir=str(tmp_path),
            engine_tls_cert_file="/c",
            engine_tls_key_file="/k",
        )
    SidecarConfig(engine_listen="127.0.0.1:0", state_dir=str(tmp_path))  # loopback: the demo, tests


def test_socket_path_too_long_is_a_clear_error(tmp_path: Path) -> None:
    # Refused with the config (so `config validate` says it too), not at the bind.
    long_dir = "/tmp/" + "d" * 120
    with pytest.raises(ConfigError, match=r"engine_listen: socket path .* is longer than 107 bytes"):
        SidecarConfig(
            engine_listen=f"unix://{long_dir}/engine.sock", admin_listen="127.0.0.1:0", metrics_listen="",
            state_dir=str(tmp_path / "state"),
        )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def mtls_only(tmp_path: Path, certs: Certs) -> Sidecar:
    """A sidecar whose engine listener takes every interface and only clients of the test CA."""
    cfg = SidecarConfig(
        engine_listen="0.0.0.0:0",
        engine_tls_cert_file=str(certs.server_cert),
        engine_tls_key_file=str(certs.server_key),
        engine_tls_client_ca_file=str(certs.ca),
        admin_listen="127.0.0.1:0",
        metrics_listen="",
        state_dir=str(tmp_path / "state"),
        decision_tick_s=0.02,
    )
    return Sidecar(config=cfg, registry=CollectorRegistry())


async def test_engines_attach_over_mtls_and_strangers_do_not(tmp_path: Path, certs: Certs) -> None:
    sc = mtls_only(tmp_path, certs)
    await sc.start()
    try:
        tls = ClientTLS(
            ca_file=str(certs.ca), cert_file=str(certs.client_cert), key_file=str(certs.client_key)
        )
        engine = EmbeddedEngine(
            target=sc.engine_target,
            settings=EngineSettings(engine_id="tls"),
            workload=demo_workload(seed=0, duration_s=0.3),
            link=LinkSettings(time_scale=1.0, flush_interval_s=0.01),
            tls=tls,
        )
        await engine.start()
        await engine.wait()
        assert sc.engines()["tls"].loop.totals.steps == engine.totals.steps > 0
        # Plaintext, and a certificate from another CA, get nowhere.
        for channel in (
            grpc.aio.insecure_channel(sc.engine_target),
            grpc.aio.secure_channel(
                sc.engine_target,
                grpc.ssl_channel_credentials(
                    certs.ca.read_bytes(), certs.rogue_key.read_bytes(), certs.rogue_cert.read_bytes()
                ),
            ),
        ):
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError):
                    await _attach(channel)
        await until(lambda: sorted(sc.engines()) == ["tls"])
    finally:
        await sc.stop(snapshot=False)


async def _attach(channel: grpc.aio.Channel) -> None:
    async def msgs() -> AsyncIterator[pb.EngineMessage]:
        yield pb.EngineMessage(hello=hello("stranger"))

    call = pb_grpc.EngineServiceStub(channel).Attach(msgs(), timeout=WAIT_S / 5)  # type: ignore[no-untyped-call]
    await call.read()


async def test_the_plugin_link_attaches_over_mtls_from_its_settings(tmp_path: Path, certs: Certs) -> None:
    """SPECCONTROL_TLS_* reach the vLLM plugin's link: it attaches to an mTLS-only sidecar."""
    sc = mtls_only(tmp_path, certs)
    await sc.start()
    try:
        settings = PluginSettings.from_env(
            {
                "SPECCONTROL_SIDECAR": sc.engine_target,
                "SPECCONTROL_TLS_CA": str(certs.ca),
                "SPECCONTROL_TLS_CERT": str(certs.client_cert),
                "SPECCONTROL_TLS_KEY": str(certs.client_key),
            }
        )
        link = SidecarLink(
            target=settings.sidecar, hello=hello("plugin-tls"), credentials=settings.credentials()
        )
        link.start()
        try:
            await until(lambda: link.directive() is not None)
            received = link.directive()
            assert received is not None and received.directive.policy == "default"
            assert "plugin-tls" in sc.engines()
        finally:
            link.close()
    finally:
        await sc.stop(snapshot=False)


def test_tls_files_that_do_not_belong_together_are_named_before_the_bind(
    tmp_path: Path, certs: Certs
) -> None:
    # serve said only "Failed to bind to address ..." (exit 1) for all of these, config validate OK
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    cases = [
        (certs.server_cert, certs.client_key, certs.ca, "engine_tls_key_file", "KEY_VALUES_MISMATCH"),
        (
            garbage,
            certs.server_key,
            certs.ca,
            "engine_tls_key_file",
            "not a certificate and its own private key",
        ),
        (
            certs.server_cert,
            certs.server_key,
            garbage,
            "engine_tls_client_ca_file",
            "not a CA certificate bundle",
        ),
    ]
    for cert, key, ca, field, says in cases:
        cfg = SidecarConfig(
            engine_listen="127.0.0.1:0", engine_tls_cert_file=str(cert), engine_tls_key_file=str(key),
            engine_tls_client_ca_file=str(ca), admin_listen="127.0.0.1:0", metrics_listen="",
            state_dir=str(tmp_path / "state"),
        )  # fmt: skip
        with pytest.raises(ConfigError) as e:
            cfg.check_files()
        assert e.value.field == field and says in str(e.value), str(e.value)
    good = SidecarConfig(
        engine_listen="127.0.0.1:0", engine_tls_cert_file=str(certs.server_cert),
        engine_tls_key_file=str(certs.server_key), engine_tls_client_ca_file=str(certs.ca),
        admin_listen="127.0.0.1:0", metrics_listen="", state_dir=str(tmp_path / "state"),
    )  # fmt: skip
    good.check_files()
