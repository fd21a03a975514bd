"""The plugin's entry point (controller/vllm/plugin.py) under a hostile environment: ``register``
never raises, and a bad setting is one ERROR line naming the variable with nothing installed."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.vllm import engine_hooks, plugin, worker
from controller.vllm.settings import PluginSettings
from controller.wire.names import has_control
from tests.controller.vllm.test_settings import VARIABLES, assert_startable, values


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _register_with(env: dict[str, str]) -> Iterator[tuple[_Lines, list[PluginSettings]]]:
    """``plugin.register()`` run over exactly ``env``, with the vLLM patches replaced by a recorder
    (no vLLM engine, nothing patched): yields the log lines and the settings it would install."""
    installed: list[PluginSettings] = []

    def install(s: PluginSettings) -> bool:
        installed.append(s)
        return False  # stop there: the worker hook and the CPU switch need vLLM

    lines = _Lines()
    log = logging.getLogger("vllm.speccontrol")
    log.addHandler(lines)
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        with (
            mock.patch.dict(os.environ, env, clear=True),
            mock.patch.object(engine_hooks, "install", install),
            mock.patch.object(worker, "install_worker_hook", lambda s: pytest.fail("worker hook")),
        ):
            plugin.register()
            yield lines, installed
    finally:
        log.removeHandler(lines)
        log.setLevel(level)


@settings(max_examples=300, deadline=None)
@given(env=st.dictionaries(st.sampled_from(VARIABLES), values, max_size=len(VARIABLES)))
def test_register_never_raises_and_says_one_line_or_installs_startable_settings(env: dict[str, str]) -> None:
    env = {k: v for k, v in env.items() if _environ_holds(v)}
    with _register_with({"SPECCONTROL_PLUGIN": "1", "SPECCONTROL_SIDECAR": "127.0.0.1:5", **env}) as (
        lines,
        installed,
    ):
        pass
    if installed:
        assert not lines.records
        assert_startable(installed[0])
        return
    assert len(lines.records) == 1 and lines.records[0].levelno == logging.ERROR
    message = lines.records[0].getMessage()
    assert message.startswith("speccontrol: plugin not started: SPECCONTROL_"), message
    assert not has_control(message)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        # before: the plugin stayed off without a word
        ({"SPECCONTROL_PLUGIN": "ture"}, "SPECCONTROL_PLUGIN: expected 1/true/yes/on or 0/false/no/off, got 'ture'"),
        ({"SPECCONTROL_PLUGIN": "1", "SPECCONTROL_FLUSH_S": "nan"}, "SPECCONTROL_FLUSH_S: expected a number"),
        ({"SPECCONTROL_PLUGIN": "1", "SPECCONTROL_COMPOSITE": "fasle"}, "SPECCONTROL_COMPOSITE: expected"),
        # before: "ValueError: embedded null byte", naming no variable (a NUL cannot reach os.environ,
        # so a newline stands in: the log line stays one line)
        ({"SPECCONTROL_PLUGIN": "1", "SPECCONTROL_TLS_CA": "ca\n.pem"}, "SPECCONTROL_TLS_CA: holds control"),
        ({"SPECCONTROL_PLUGIN": "1", "SPECCONTROL_TRACE": "/"}, "SPECCONTROL_TRACE: '/' is a directory"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_one_line_and_nothing_installed(env: dict[str, str], says: str) -> None:
    env = {"SPECCONTROL_SIDECAR": "127.0.0.1:5", **env}
    with _register_with(env) as (lines, installed):
        pass
    assert not installed
    assert len(lines.records) == 1 and lines.records[0].levelno == logging.ERROR
    assert lines.records[0].getMessage().startswith(f"speccontrol: plugin not started: {says}")


def test_an_escaping_error_is_shown_on_one_line() -> None:
    def boom(settings: Any) -> bool:
        raise RuntimeError("line one\nline two")

    with (
        mock.patch.dict(
            os.environ, {"SPECCONTROL_PLUGIN": "1", "SPECCONTROL_SIDECAR": "127.0.0.1:5"}, clear=True
        ),
        mock.patch.object(engine_hooks, "install", boom),
    ):
        lines = _Lines()
        logging.getLogger("vllm.speccontrol").addHandler(lines)
        try:
            plugin.register()
        finally:
            logging.getLogger("vllm.speccontrol").removeHandler(lines)
    assert [r.getMessage() for r in lines.records] == [
        "speccontrol: plugin not started, vLLM left as configured: RuntimeError: line one\\nline two"
    ]


def _environ_holds(value: str) -> bool:
    """What a process environment can hold: no NUL, and surrogates only as os.environ's stand-ins
    for bytes that are not UTF-8 (U+DC80..U+DCFF); those it does hold, and the plugin must refuse."""
    try:
        os.fsencode(value)
    except UnicodeEncodeError:
        return False
    return "\x00" not in value
