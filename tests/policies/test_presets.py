"""The built-in presets and naming a policy by preset or file (policies/presets.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from policies.presets import load_preset, preset_names, preset_text, resolve_policy, resolve_policy_text
from policies.spec import PolicyError


def test_presets() -> None:
    assert {"default", "static-off", "epsilon-greedy"} <= set(preset_names())
    assert resolve_policy("static-off").name == "static-off"
    with pytest.raises(PolicyError, match=r"unknown policy preset 'nope' \(presets: default, "):
        resolve_policy("nope")
    with pytest.raises(PolicyError, match="no such policy file"):
        resolve_policy("missing.yaml")


def test_every_preset_parses_and_a_file_wins_over_a_preset(tmp_path: Path) -> None:
    for name in preset_names():
        assert load_preset(name).name == name
    f = tmp_path / "mine.yaml"
    f.write_text(preset_text("static-off").replace("name: static-off", "name: mine"), encoding="utf-8")
    assert resolve_policy(str(f)).name == "mine"
    with pytest.raises(PolicyError, match="unknown policy preset"):
        load_preset("../default")


def test_a_path_that_exists_but_is_no_file_is_named_as_such(tmp_path: Path) -> None:
    # a directory (or a FIFO, whose read would block) was "no such policy file"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p in (tmp_path, fifo):
        with pytest.raises(PolicyError, match="not a regular file"):
            resolve_policy_text(str(p))


def test_a_name_too_long_for_the_file_system_is_a_policy_error() -> None:
    # stat() raised OSError (File name too long): `default_policy` failed the sidecar's start, and
    # `policy set`, with an error naming no policy.
    with pytest.raises(PolicyError, match=r"cannot read policy file: File name too long"):
        resolve_policy_text("p" * 300 + ".yaml")
