"""Regression tests for the hostile-input review of the sidecar's config (findings 9 and 10).

``config validate`` must refuse what ``serve`` cannot use, naming the key, and every config error
must carry its line and field.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from controller.cli import main
from controller.config import load_config, parse_config
from controller.errors import ConfigError


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_config_validate_refuses_a_state_dir_that_cannot_be_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /proc is a directory (writable by root), so "its ancestor is a directory" passed it, and serve
    # then failed at start with "[Errno 2] No such file or directory: '/proc/nonexist'", exit 1
    cfg = tmp_path / "c.yaml"
    cfg.write_text('state_dir: /proc/nonexist/x\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ""\n')
    assert main(["config", "validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{cfg}: state_dir: cannot make /proc/nonexist/x in /proc" in err
    with pytest.raises(ConfigError, match="state_dir: cannot make"):
        load_config(str(cfg)).check_files()


def test_a_state_dir_that_can_be_made_passes_and_nothing_is_left(tmp_path: Path) -> None:
    cfg = parse_config(f"state_dir: {tmp_path}/a/b\n")
    cfg.check_files()
    assert list(tmp_path.iterdir()) == []  # the probe is removed, and nothing is made ahead of serve


@pytest.mark.parametrize("key", ["~", "null", "Null"])
def test_a_null_key_is_named_with_its_line(key: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(f"log_level: INFO\n{key}: a\n", source="c.yaml")
    assert str(e.value).startswith("c.yaml:2: null: unknown setting"), str(e.value)


def test_an_integer_too_long_to_convert_has_its_line_and_field() -> None:
    # was "invalid value: Exceeds the limit (4300 digits) ...; use sys.set_int_max_str_digits()"
    text = "log_level: INFO\nsnapshot_interval_s: " + "9" * 5000 + "\n"
    with pytest.raises(ConfigError) as e:
        parse_config(text, source="c.yaml")
    limit = sys.get_int_max_str_digits()
    assert str(e.value) == f"c.yaml:2: snapshot_interval_s: an integer longer than {limit} digits"


@pytest.mark.parametrize(
    ("field", "config"),
    [
        ("admin_token_file", ""),
        ("mqtt_password_file", "mqtt_url: mqtt://u@127.0.0.1:1883\n"),
        ("engine_tls_cert_file", "engine_listen: 127.0.0.1:0\nengine_tls_key_file: {key}\n"),
        ("mqtt_ca_file", "mqtt_url: mqtts://127.0.0.1:8883\n"),
    ],
)
@pytest.mark.parametrize("command", ["config validate", "serve"])
def test_a_token_password_or_tls_file_that_is_a_fifo_is_refused_before_it_is_opened(
    field: str,
    config: str,
    command: str,
    fifo_without_writer: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # open() of a FIFO without a writer blocks until one comes: `serve` and `config validate` hung at
    # start, for good (mqtt_ca_file: the fleet link's connect blocked the event loop, as serve never
    # read it before).
    import controller.serve

    started: list[bool] = []

    async def serve(*_: object, **__: object) -> None:  # (serve would run until stopped)
        started.append(True)

    monkeypatch.setattr(controller.serve, "serve", serve)
    key = tmp_path / "key.pem"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"state_dir: {tmp_path / 'state'}\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\n"
        f"{config.format(key=key)}{field}: {fifo_without_writer}\n"
    )
    argv = (
        ["config", "validate", str(cfg)] if command == "config validate" else ["serve", "--config", str(cfg)]
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    said = f"{cfg}: {field}: {fifo_without_writer}: is a FIFO, not a regular file\n"
    assert err == (said if command == "config validate" else f"error: {said}"), err
    assert not started and not (tmp_path / "state").exists()
