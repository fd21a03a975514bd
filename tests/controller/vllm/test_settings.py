from __future__ import annotations

from pathlib import Path

import pytest

from controller.vllm.settings import PluginSettings, SettingsError, enabled
from policies.arms import Arm, Method


def test_opt_in_only() -> None:
    assert not enabled({})
    assert not enabled({"VLLM_PLUGINS": "other"})
    assert enabled({"VLLM_PLUGINS": "other, speccontrol"})
    assert enabled({"SPECCONTROL_PLUGIN": "1"})


def test_from_env() -> None:
    s = PluginSettings.from_env(
        {"SPECCONTROL_SIDECAR": "unix:///run/sc.sock", "SPECCONTROL_SAFE_DEFAULT": "ngram:2"}
    )
    assert s.sidecar == "unix:///run/sc.sock"
    assert s.safe_default == Arm(Method.NGRAM, 2)
    assert PluginSettings.from_env({"SPECCONTROL_SIDECAR": "127.0.0.1:5"}).safe_default is None
    assert PluginSettings.from_env({"SPECCONTROL_SIDECAR": "127.0.0.1:5"}).worker_ngram == "auto"
    dev = PluginSettings.from_env(
        {"SPECCONTROL_SIDECAR": "127.0.0.1:5", "SPECCONTROL_WORKER_NGRAM": " Device "}
    )
    assert dev.worker_ngram == "device"
    assert dev.worker_kernels == "auto"
    tri = PluginSettings.from_env(
        {"SPECCONTROL_SIDECAR": "127.0.0.1:5", "SPECCONTROL_WORKER_KERNELS": " Torch "}
    )
    assert tri.worker_kernels == "torch"


@pytest.mark.parametrize(
    ("env", "where"),
    [
        ({}, "SPECCONTROL_SIDECAR"),
        ({"SPECCONTROL_SIDECAR": "nowhere"}, "SPECCONTROL_SIDECAR"),
        ({"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_SAFE_DEFAULT": "eagle9:1"}, "SPECCONTROL_SAFE_DEFAULT"),
        ({"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_QUEUE_SIZE": "x"}, "SPECCONTROL_QUEUE_SIZE"),
        ({"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_QUEUE_SIZE": "1"}, "SPECCONTROL_QUEUE_SIZE"),
        ({"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_WORKER_NGRAM": "gpu"}, "SPECCONTROL_WORKER_NGRAM"),
        ({"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_WORKER_KERNELS": "cuda"}, "SPECCONTROL_WORKER_KERNELS"),
        # 64 was taken here, and then refused by the n-gram index (its positions keep 6 bits of n)
        (
            {"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_NGRAM_MAX": "64"},
            r"SPECCONTROL_NGRAM_MIN/MAX: need 1 <= min <= max <= 63, got 1, 64",
        ),
        # the sidecar refuses a Hello whose id is too long or holds control characters
        (
            {"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_ENGINE_ID": "e" * 121},
            "SPECCONTROL_ENGINE_ID: at most 120",
        ),
        (
            {"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_ENGINE_ID": "pod\n7"},
            "SPECCONTROL_ENGINE_ID: holds control",
        ),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], where: str) -> None:
    with pytest.raises(SettingsError, match=where):
        PluginSettings.from_env(env)


@pytest.mark.parametrize(
    ("sidecar", "says"),
    [
        # the link could never dial these, and retried forever without naming the variable
        (
            "unix:///tmp/" + "a" * 200 + ".sock",
            "SPECCONTROL_SIDECAR: the socket path is longer than 107 bytes",
        ),
        ("127.0.0.1:0", "SPECCONTROL_SIDECAR: port must be 1..65535, got '127.0.0.1:0'"),
        ("nowhere", "SPECCONTROL_SIDECAR: expected 'host:port'"),  # starts with the variable, no '<config>'
        ("127.0.0.1:99999", "SPECCONTROL_SIDECAR: port must be 1..65535, got '127.0.0.1:99999'"),
        ("unix:///tmp/a\x00b.sock", "SPECCONTROL_SIDECAR: holds control characters"),  # gRPC dialled /tmp/a
    ],
)
def test_a_sidecar_address_that_cannot_be_dialled_is_refused(sidecar: str, says: str) -> None:
    with pytest.raises(SettingsError) as e:
        PluginSettings.from_env({"SPECCONTROL_SIDECAR": sidecar})
    assert str(e.value).startswith(says), str(e.value)


def test_tls_settings(tmp_path: Path) -> None:
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "c.pem", "k.pem"))
    for f in (ca, cert, key):
        f.write_text("x")
    tls = {"SPECCONTROL_TLS_CA": str(ca), "SPECCONTROL_TLS_CERT": str(cert), "SPECCONTROL_TLS_KEY": str(key)}
    s = PluginSettings.from_env({"SPECCONTROL_SIDECAR": "sidecar.ns.svc:50061", **tls})
    assert (s.tls_ca, s.tls_cert, s.tls_key) == (str(ca), str(cert), str(key))
    assert PluginSettings.from_env({"SPECCONTROL_SIDECAR": "127.0.0.1:5"}).credentials() is None


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"SPECCONTROL_SIDECAR": "sidecar.ns.svc:50061"}, "SPECCONTROL_SIDECAR: .* beyond loopback"),
        ({"SPECCONTROL_TLS_KEY": ""}, "SPECCONTROL_TLS_CERT and SPECCONTROL_TLS_KEY go together"),
        ({"SPECCONTROL_SIDECAR": "unix:///run/sc.sock"}, "SPECCONTROL_TLS_CA: TLS is for a TCP sidecar"),
        (
            {"SPECCONTROL_TLS_CA": "/nonexistent/ca.pem"},
            "SPECCONTROL_TLS_CA: cannot read /nonexistent/ca.pem",
        ),
    ],
)
def test_bad_tls_settings_name_the_variable(tmp_path: Path, extra: dict[str, str], where: str) -> None:
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "c.pem", "k.pem"))
    for f in (ca, cert, key):
        f.write_text("x")
    env = {
        "SPECCONTROL_SIDECAR": "127.0.0.1:5",
        "SPECCONTROL_TLS_CA": str(ca),
        "SPECCONTROL_TLS_CERT": str(cert),
        "SPECCONTROL_TLS_KEY": str(key),
    }
    env.update(extra)
    if extra.get("SPECCONTROL_SIDECAR", "").endswith(":50061"):
        env = {"SPECCONTROL_SIDECAR": extra["SPECCONTROL_SIDECAR"]}
    with pytest.raises(SettingsError, match=where):
        PluginSettings.from_env(env)
