from __future__ import annotations

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


@pytest.mark.parametrize(
    ("env", "where"),
    [
        ({}, "SPECCONTROL_SIDECAR"),
        ({"SPECCONTROL_SIDECAR": "nowhere"}, "SPECCONTROL_SIDECAR"),
        ({"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_SAFE_DEFAULT": "eagle9:1"}, "SPECCONTROL_SAFE_DEFAULT"),
        ({"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_QUEUE_SIZE": "x"}, "SPECCONTROL_QUEUE_SIZE"),
        ({"SPECCONTROL_SIDECAR": "h:1", "SPECCONTROL_QUEUE_SIZE": "1"}, "SPECCONTROL_QUEUE_SIZE"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], where: str) -> None:
    with pytest.raises(SettingsError, match=where):
        PluginSettings.from_env(env)
