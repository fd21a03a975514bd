from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import MAX_CONFIG_BYTES, SidecarConfig, load_config, parse_config
from controller.errors import ConfigError


def test_defaults_need_no_file() -> None:
    c = load_config(None)
    assert c == SidecarConfig()
    assert (c.engine_listen, c.admin_listen, c.metrics_listen) == ("", "127.0.0.1:50062", "127.0.0.1:9464")
    # Engines attach over a Unix socket in the state directory by default (created 0600).
    assert c.engine_address == f"unix://{Path('.state').resolve() / 'engine.sock'}"
    assert c.engine_socket_mode == 0o600
    assert c.snapshot_path == Path(".state") / "sidecar-state.json"
    assert (c.snapshot_interval_s, c.decision_tick_s, c.max_message_bytes) == (30.0, 0.1, 4 * 1024 * 1024)


def test_file_values_are_typed(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(
        "engine_listen: unix:///run/sc.sock\nmetrics_listen: ''\nsnapshot_interval_s: 5\nlog_level: debug\n"
    )
    c = load_config(str(p))
    assert c.engine_listen == "unix:///run/sc.sock"
    assert c.metrics_listen == ""
    assert c.snapshot_interval_s == 5.0 and isinstance(c.snapshot_interval_s, float)
    assert c.log_level == "DEBUG"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "fleet: a\nsnapshot_interval_s: -1\n",
            "c.yaml:2: snapshot_interval_s: must be between 0.1 and 86400.0, got -1",
        ),
        (
            "\n\nengine_listen: nowhere\n",
            "c.yaml:3: engine_listen: expected 'host:port' or 'unix:///path', got 'nowhere'",
        ),
        (
            "admin_listen: 127.0.0.1:70000\n",
            "c.yaml:1: admin_listen: port must be 0..65535 (0: any free port), got 70000",
        ),
        ("max_steps_per_batch: 1.5\n", "c.yaml:1: max_steps_per_batch: expected an integer, got float 1.5"),
        (
            "metrics_listen: unix:///x\n",
            "c.yaml:1: metrics_listen: metrics are served over TCP: expected 'host:port' or ''",
        ),
        (
            "log_level: LOUD\n",
            "c.yaml:1: log_level: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'LOUD'",
        ),
        ("decision_tick_s: true\n", "c.yaml:1: decision_tick_s: expected a number, got bool True"),
        (
            "snapshot_interval_s: 1" + "0" * 400 + "\n",
            "c.yaml:1: snapshot_interval_s: must be between 0.1 and 86400.0, got an integer of 401 digits",
        ),
    ],
)
def test_errors_name_file_line_and_field(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(text, source="c.yaml")
    assert str(e.value) == expected


def test_unknown_field_and_bad_yaml() -> None:
    with pytest.raises(
        ConfigError, match=r"^c.yaml:2: engine_lisen: unknown setting \(known: engine_listen, "
    ):
        parse_config("fleet: x\nengine_lisen: 1\n", source="c.yaml")
    with pytest.raises(ConfigError, match=r"^c.yaml:2: invalid YAML"):
        parse_config("fleet: x\n  - : [\n", source="c.yaml")
    with pytest.raises(ConfigError, match=r"^c.yaml:1: expected a mapping of settings, got list"):
        parse_config("- 1\n", source="c.yaml")


def test_a_setting_given_twice_or_nested_too_deeply_is_refused() -> None:
    # PyYAML keeps the last of two equal keys (and the error, if any, named the first one's line)
    with pytest.raises(ConfigError) as e:
        parse_config("state_dir: /a\nadmin_listen: 127.0.0.1:0\nstate_dir: /b\n", source="c.yaml")
    assert str(e.value) == (
        "c.yaml:3: state_dir: duplicate key (first on line 1; YAML would keep only the last)"
    )
    with pytest.raises(ConfigError, match=r"^c.yaml: document nested too deeply"):
        parse_config("a: " + "[" * 20_000 + "]" * 20_000, source="c.yaml")
    with pytest.raises(ConfigError, match=r"^c.yaml:1: a\[0\]\[0\].*: nested deeper than 8 levels"):
        parse_config("a: " + "[" * 10 + "]" * 10, source="c.yaml")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope.yaml: cannot read"):
        load_config(str(tmp_path / "nope.yaml"))


def test_empty_file_gives_defaults() -> None:
    assert parse_config("", source="c.yaml") == SidecarConfig()


def test_fleet_link_settings(tmp_path: Path) -> None:
    assert SidecarConfig().broker_settings() is None  # no mqtt_url: the link is off
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    c = SidecarConfig(
        mqtt_url="mqtts://broker.example:8884",
        mqtt_username="fleet",
        mqtt_password_file=str(pw),
        mqtt_ca_file="/etc/ca.pem",
        node_id="pod-7",
        posteriors_interval_s=5,
    )
    b = c.broker_settings()
    assert b is not None
    assert (b.host, b.port, b.tls, b.username, b.password, b.ca_file) == (
        "broker.example",
        8884,
        True,
        "fleet",
        "s3cret",
        "/etc/ca.pem",
    )
    assert (c.fleet_node_id, c.posteriors_interval_s) == ("pod-7", 5.0)
    assert SidecarConfig().fleet_node_id  # the host name
    missing = SidecarConfig(mqtt_url="mqtt://b", mqtt_username="u", mqtt_password_file=str(tmp_path / "no"))
    with pytest.raises(ConfigError, match="mqtt_password_file: cannot read"):
        missing.broker_settings()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mqtt_url: http://b\n", "c.yaml:1: mqtt_url: broker URL: expected mqtt://host[:port]"),
        ("mqtt_url: mqtt://b:99999\n", "c.yaml:1: mqtt_url: broker URL: invalid port"),
        ("mqtt_url: mqtt://b\nmqtt_ca_file: ca.pem\n", "c.yaml:2: mqtt_ca_file: needs an mqtts:// mqtt_url"),
        ("mqtt_url: mqtts://b\nmqtt_key_file: k\n", "c.yaml:2: mqtt_key_file: given without mqtt_cert_file"),
        ("node_id: a/b\n", "c.yaml:1: node_id: must be 1-128 letters, digits"),
        (
            "node_id: '..'\n",
            "c.yaml:1: node_id: must be 1-128 letters, digits, '-', '_' or '.' (not '.' or '..')",
        ),
        (
            "fleet: flöte\n",
            "c.yaml:1: fleet: must be 1-64 letters, digits, '-', '_' or '.' (not '.' or '..'), got",
        ),
        ("mqtt_tls_insecure: 1\n", "c.yaml:1: mqtt_tls_insecure: expected true or false, got 1"),
        ("posteriors_interval_s: 0\n", "c.yaml:1: posteriors_interval_s: must be between 0.1 and 86400.0"),
    ],
)
def test_fleet_link_errors(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(text, source="c.yaml")
    assert str(e.value).startswith(expected), str(e.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a NUL broke open() later (a traceback at start), a newline forged log lines
        ('state_dir: "/tmp/n\\x00x"\n', "c.yaml:1: state_dir: holds control characters (/tmp/n\\x00x)"),
        (
            'admin_token_file: "/t\\nWARNING forged"\n',
            "c.yaml:1: admin_token_file: holds control characters (/t\\nWARNING forged)",
        ),
        # the admin API's answers did not fit: a policy alone is up to 64 KiB
        (
            "max_message_bytes: 1024\n",
            "c.yaml:1: max_message_bytes: must be between 131072 and 268435456, got 1024",
        ),
        (
            "engine_listen: 127.0.0.1:5000\nadmin_listen: 127.0.0.1:5000\n",
            "c.yaml:2: admin_listen: the same address as engine_listen",
        ),
        (
            "admin_listen: 127.0.0.1:5001\nmetrics_listen: 127.0.0.1:5001\n",
            "c.yaml:2: metrics_listen: the same address as admin_listen",
        ),
        (
            "state_dir: /tmp/" + "a" * 120 + "\n",
            "c.yaml:1: engine_listen: socket path /tmp/"
            + "a" * 120
            + "/engine.sock is longer than 107 bytes; "
            "use a shorter path (or a shorter state_dir)",
        ),
    ],
)
def test_what_only_the_bind_found_is_refused_with_the_config(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(text, source="c.yaml")
    assert str(e.value) == expected


def test_check_files_reads_what_serve_will_read(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    token = tmp_path / "token"
    token.write_text("t" * 32)
    cases = {
        f"state_dir: {afile}\n": f"state_dir: {afile} exists and is not a directory",
        f"state_dir: {tmp_path}/s\nengine_listen: unix://{afile}/x.sock\n": (
            f"engine_listen: {afile} exists and is not a directory"
        ),
        f"state_dir: {tmp_path}/s\nadmin_token_file: {tmp_path}\n": (
            f"admin_token_file: {tmp_path}: is a directory, not a regular file"
        ),
        f"state_dir: {tmp_path}/s\nadmin_listen: 127.0.0.1:0\nadmin_tls_cert_file: {afile}\n"
        f"admin_tls_key_file: {afile}\n": (
            f"admin_tls_cert_file: {afile}: not a PEM certificate (no '-----BEGIN ...CERTIFICATE-----' block)"
        ),
    }
    for text, says in cases.items():
        cfg = parse_config(text, source="c.yaml")  # the document itself is fine
        with pytest.raises(ConfigError) as e:
            cfg.check_files()
        assert str(e.value).endswith(says), str(e.value)
    ok = parse_config(f"state_dir: {tmp_path}/new/s\nadmin_token_file: {token}\n", source="c.yaml")
    ok.check_files()  # a state_dir still to be made is fine
    assert not (tmp_path / "new").exists()  # and checking makes nothing


def test_a_config_path_that_is_a_device_is_read_no_further_than_the_limit() -> None:
    # load_config is what serve (and its python -m entry) reads with: /dev/zero was read whole,
    # gigabytes a second, until the process was killed for memory. Run in a child process with its
    # memory capped, so that the old reader fails the test instead of taking the machine down.
    import subprocess
    import sys

    probe = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from controller.config import load_config\n"
        "from controller.errors import ConfigError\n"
        "try:\n"
        "    load_config('/dev/zero')\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stdout.strip() == f"/dev/zero: larger than {MAX_CONFIG_BYTES} bytes"
