"""Policies and configs are data: safe YAML only, size limits, refused input counted, nothing changed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from controller.client import AdminClient
from controller.config import SidecarConfig, parse_config
from controller.errors import ConfigError
from controller.server import SidecarServer as Sidecar
from policies.spec import PolicyError, parse_policy
from tests.integration.test_sidecar_grpc import STATIC_EAGLE3_2

pytestmark = pytest.mark.integration

#: Would run a shell command under yaml.unsafe_load / full_load.
EXPLOIT = """\
apiVersion: speccontrol/v1
kind: Policy
metadata:
  name: !!python/object/apply:os.system ["touch {marker}"]
spec:
  algorithm: {{name: static, params: {{arm: "eagle3:2"}}}}
"""


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    cfg = SidecarConfig(
        engine_listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        metrics_listen="",
        state_dir=str(tmp_path / "s"),
    )
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop(snapshot=False)


def rejected(sc: Sidecar, reason: str) -> float:
    return (
        sc.registry.get_sample_value("speccontrol_rejected_admin_requests_total", {"reason": reason}) or 0.0
    )


def test_python_tags_are_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(PolicyError):
        parse_policy(EXPLOIT.format(marker=marker), source="x.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_config(f"fleet: !!python/object/apply:os.system ['touch {marker}']\n", source="c.yaml")
    assert not marker.exists()


async def test_an_exploit_policy_over_the_admin_api_is_refused_and_counted(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    async with AdminClient(target=sidecar.admin_target) as admin:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.set_policy(EXPLOIT.format(marker=marker), source="evil.yaml")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("evil.yaml:")
    assert not marker.exists()
    assert rejected(sidecar, "invalid_policy") == 1
    assert sidecar.policy_store.default.revision == 1


async def test_oversized_policies_are_refused(sidecar: Sidecar) -> None:
    async with AdminClient(target=sidecar.admin_target) as admin:
        # Over the policy document limit (64 KiB): a clear error.
        big = STATIC_EAGLE3_2 + "#" * (70 * 1024) + "\n"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.set_policy(big, source="big.yaml")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "larger than" in (err.value.details() or "")
        # Over the gRPC message limit (4 MiB): refused before any handler runs.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.set_policy("#" * (5 * 1024 * 1024), source="huge.yaml")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sidecar.policy_store.default.revision == 1


@pytest.mark.parametrize("source", ["a\x00b\nc", "\x1b[2Jfake.yaml", "x\u2028y", "lmay.\u202etxt"])
async def test_a_source_with_control_characters_is_refused_and_counted(sidecar: Sidecar, source: str) -> None:
    # It was stored and echoed raw by `policy list` / `policy get` (a terminal escape, a forged line).
    async with AdminClient(target=sidecar.admin_target) as admin:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.set_policy(STATIC_EAGLE3_2, source=source)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("source: holds control characters (")
    assert rejected(sidecar, "control_characters") == 1
    assert sidecar.policy_store.default.revision == 1


async def test_policy_changes_are_rate_limited(tmp_path: Path) -> None:
    cfg = SidecarConfig(
        engine_listen="127.0.0.1:0", admin_listen="127.0.0.1:0", metrics_listen="", state_dir=str(tmp_path / "s"),
        max_policy_changes_per_s=0.01,
    )  # fmt: skip
    sc = Sidecar(config=cfg, registry=CollectorRegistry())
    await sc.start()
    try:
        async with AdminClient(target=sc.admin_target) as admin:
            codes = []
            for _ in range(12):
                try:
                    await admin.set_policy(STATIC_EAGLE3_2, source="s.yaml")
                    codes.append("ok")
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code().name)
        assert codes == ["ok"] * 10 + ["RESOURCE_EXHAUSTED"] * 2  # a burst of 10, then the rate
        assert rejected(sc, "rate_limited") == 2
    finally:
        await sc.stop(snapshot=False)
