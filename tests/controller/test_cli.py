import argparse
import json
import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.cli import _dump, build_parser, main
from controller.v1 import controller_pb2 as pb
from sim import cli_types

BROKEN = """apiVersion: speccontrol/v1
kind: Policy
metadata:
  name: broken
spec:
  algorithm:
    name: discounted_thompson
    params:
      discount: 7
"""


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_validate_ok_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "validate", "policies/library/default.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and out.count("\n") == 1 and "goodput_model" in out


def test_validate_broken_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(BROKEN)
    assert main(["policy", "validate", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{f}:9: spec.algorithm.params.discount:"), err
    assert "\n" not in err and "Traceback" not in err


def test_validate_unparsable_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("apiVersion: [\n")
    assert main(["policy", "validate", str(f)]) == 2
    assert capsys.readouterr().err.startswith(f"{f}:")


def test_set_of_a_broken_file_never_calls_the_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(BROKEN)
    # The admin address is unreachable: a call would exit 1, local validation exits 2 first.
    assert main(["--admin", _closed_port(), "policy", "set", str(f)]) == 2
    assert "spec.algorithm.params.discount" in capsys.readouterr().err


def test_unknown_preset_is_an_input_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "validate", "no-such-preset"]) == 2
    assert "unknown policy preset" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["", " ", "\t"])
@pytest.mark.parametrize("action", ["validate", "set"])
def test_a_blank_policy_name_is_named(action: str, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The error named nothing: ": not a regular file (...)" ('' is the path '.'), or " : unknown
    # policy preset ' '" (its source a blank).
    assert main(["--admin", _closed_port(), "policy", action, name]) == 2
    assert capsys.readouterr().err == f"{name!r}: not a policy file or preset name\n"


def test_fleet_needs_a_broker(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SPECCONTROL_MQTT_URL", raising=False)
    assert main(["policy", "set", "default", "--fleet"]) == 2
    err = capsys.readouterr().err
    assert "MQTT broker" in err and "SPECCONTROL_MQTT_URL" in err and err.count("\n") == 1


@pytest.mark.parametrize("action", [["set", "default"], ["clear"]])
def test_a_bad_broker_or_fleet_from_the_environment_is_named_as_such(
    action: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Neither flag was given: the errors blamed --broker and --fleet-name for the variables' values.
    monkeypatch.setenv("SPECCONTROL_MQTT_URL", "garbage")
    monkeypatch.delenv("SPECCONTROL_FLEET", raising=False)
    assert main(["policy", *action, "--fleet"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("$SPECCONTROL_MQTT_URL: broker URL: ") and "'garbage'" in err and err.count("\n") == 1
    )
    monkeypatch.setenv("SPECCONTROL_MQTT_URL", f"mqtt://{_closed_port()}")
    monkeypatch.setenv("SPECCONTROL_FLEET", "a/b")
    assert main(["policy", *action, "--fleet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("$SPECCONTROL_FLEET: ") and "'a/b'" in err and err.count("\n") == 1
    # The flags given: named as before.
    assert main(["policy", *action, "--fleet", "--broker", "garbage", "--fleet-name", "ok"]) == 2
    assert capsys.readouterr().err.startswith("--broker: broker URL: ")
    assert main(["policy", *action, "--fleet", "--fleet-name", "a/b"]) == 2
    assert capsys.readouterr().err.startswith("--fleet-name: ")


def test_fleet_set_of_a_broken_file_never_reaches_the_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(BROKEN)
    # The broker is unreachable: a publish would exit 1, local validation exits 2 first.
    assert main(["policy", "set", str(f), "--fleet", "--broker", f"mqtt://{_closed_port()}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{f}:9: spec.algorithm.params.discount:") and err.count("\n") == 1


def test_fleet_unreachable_broker_is_one_line_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPECCONTROL_MQTT_URL", f"mqtt://{_closed_port()}")
    assert main(["--timeout", "5", "policy", "set", "default", "--fleet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cannot reach the MQTT broker: ") and err.count("\n") == 1


def test_fleet_versions_used_up_is_a_runtime_error_of_the_fleet_not_of_the_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The retained policy carries the highest version a sidecar takes: the document is fine, the
    # fleet's state is not (exit 1, the fleet named, not the file).
    from controller import fleet

    async def used_up(**_: object) -> int:
        raise fleet.FleetVersionsUsedUp("the fleet's policy version is already 9007199254740991")

    monkeypatch.setattr(fleet, "publish_fleet_policy", used_up)
    monkeypatch.setenv("SPECCONTROL_MQTT_URL", "mqtt://127.0.0.1:1")
    assert main(["policy", "set", "default", "--fleet", "--fleet-name", "prod"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fleet prod: the fleet's policy version is already") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fleet", "--broker", "http://h"], "--broker: broker URL: expected mqtt://host[:port]"),
        (["--fleet", "--broker", "mqtt://h", "--ca-file", "ca.pem"], "--broker: broker TLS options"),
        (["--fleet", "--broker", "mqtt://h", "--fleet-name", "a/b"], "--fleet-name: must be 1-64 letters"),
        (["--broker", "mqtt://h"], "--broker, --fleet-name, --ca-file, --cert-file and --key-file go with"),
        # '' (an unset variable) was taken for no flag: --fleet-name '' published to the fleet
        # 'default' (every sidecar of it took the policy), --broker '' used $SPECCONTROL_MQTT_URL, and
        # the TLS files were dropped (the system's CAs, no client certificate).
        (["--fleet", "--broker", "mqtt://h", "--fleet-name", ""], "--fleet-name: must be 1-64 letters"),
        (["--fleet", "--broker", ""], "--broker '': not a broker URL"),
        (["--fleet", "--broker", "mqtts://h", "--ca-file", ""], "--ca-file '': not a file name"),
        (["--fleet", "--broker", "mqtts://h", "--cert-file", ""], "--cert-file '': not a file name"),
        (["--fleet", "--broker", "mqtts://h", "--key-file", ""], "--key-file '': not a file name"),
        (["--fleet-name", ""], "--broker, --fleet-name, --ca-file, --cert-file and --key-file go with"),
    ],
)
def test_fleet_bad_options_are_input_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["policy", "set", "default", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_unreachable_sidecar_is_one_line_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    addr = _closed_port()
    assert main(["--admin", addr, "--timeout", "2", "status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"cannot reach the sidecar at {addr}: ") and err.count("\n") == 1


def test_policy_list_works_without_a_sidecar(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--admin", _closed_port(), "--timeout", "2", "policy", "list"]) == 0
    out = capsys.readouterr().out
    assert "default" in out and "static-off" in out and "active: unknown" in out


def test_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCONTROL_ADMIN", "10.0.0.1:1234")
    p = build_parser()
    a = p.parse_args(["policy", "set", "x.yaml", "--engine", "e1"])
    assert (a.admin, a.policy, a.engine, a.fleet) == ("10.0.0.1:1234", "x.yaml", "e1", False)
    assert p.parse_args(["--admin", "h:1", "demo", "--seconds", "3", "--json"]).seconds == 3.0
    with pytest.raises(SystemExit):
        p.parse_args(["policy", "set", "x.yaml", "--engine", "e1", "--fleet"])
    with pytest.raises(SystemExit):
        p.parse_args(["policy"])


def test_demo_rejects_non_positive_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["demo", "--seconds", "0"])
    assert e.value.code == 2
    assert "argument --seconds: must be a number in (0, 3600], got '0'" in capsys.readouterr().err


def test_serve_with_an_unreadable_mqtt_password_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"state_dir: {tmp_path / 'state'}\nengine_listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n"
        f"metrics_listen: ''\nmqtt_url: mqtt://127.0.0.1:1\nmqtt_username: u\n"
        f"mqtt_password_file: {tmp_path / 'missing'}\n"
    )
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "mqtt_password_file: cannot read" in err and err.count("\n") == 1
    assert not (tmp_path / "state").exists()  # nothing started, nothing written


@pytest.mark.parametrize("policy", ["not-a-preset", "FILE"])
def test_serve_with_a_refused_default_policy_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    # It exited 2 with the reason, but had already created the state directory and its lock.
    bad = tmp_path / "p.yaml"
    bad.write_text("garbage: [\n")
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"state_dir: {tmp_path / 'state'}\nengine_listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n"
        f"metrics_listen: ''\ndefault_policy: {bad if policy == 'FILE' else policy}\n"
    )
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {cfg}: default_policy: ") and err.count("\n") == 1
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("flag", ["--config", "--record-steps"])
def test_serve_with_an_empty_file_name_is_refused_before_it_starts(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # '' (an unset variable) was taken for no flag: `--config ''` served the defaults, and
    # `--record-steps ''` recorded nothing, without a word.
    import controller.serve

    started: list[bool] = []

    async def serve(*_: object, **__: object) -> None:
        started.append(True)

    monkeypatch.setattr(controller.serve, "serve", serve)
    monkeypatch.chdir(tmp_path)  # (the defaults' state directory)
    assert main(["serve", flag, ""]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: '': not a file name\n"
        if flag == "--config"
        else "error: --record-steps '': not a file name\n"
    )
    assert not started


@pytest.mark.parametrize("names", ["--config", "default_policy", "admin_token_file", "state_dir"])
def test_serve_refuses_to_record_steps_into_a_file_it_reads_or_keeps(
    names: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The steps were appended to it: `--record-steps sidecar.yaml` left a config (or a policy, a token)
    # that the next start refused, and in the state directory the snapshot's rename dropped them.
    import controller.serve

    started: list[bool] = []

    async def serve(*_: object, **__: object) -> None:
        started.append(True)

    monkeypatch.setattr(controller.serve, "serve", serve)
    policy, token, state = tmp_path / "p.yaml", tmp_path / "token", tmp_path / "state"
    policy.write_text(Path("policies/library/default.yaml").read_text())
    token.write_text("0123456789abcdef0123456789abcdef\n")
    state.mkdir()
    (state / "sidecar-state.json").write_text("{}")  # (a restart: the default policy is not read)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(f"state_dir: {state}\ndefault_policy: {policy}\nadmin_token_file: {token}\n")
    target = {"--config": cfg, "default_policy": policy, "admin_token_file": token}.get(
        names, state / "sidecar-state.json"
    )
    before = target.read_bytes()
    assert main(["serve", "--config", str(cfg), "--record-steps", str(target)]) == 2
    assert capsys.readouterr().err == (
        f"error: --record-steps {target}: is the {names} file it reads; name another output\n"
    )
    assert not started and target.read_bytes() == before


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("sidecar.lock", "the state_dir's lock file (sidecar.lock)"),
        ("engine.sock", "the engine_listen socket"),
        ("admin.sock", "the admin_listen socket"),
        (".sidecar-state.json.x1.tmp", "a temporary file of the sidecar's writes in state_dir"),
        (".endpoints.json.x1.tmp", "a temporary file of the sidecar's writes in state_dir"),
    ],
)
def test_serve_refuses_to_record_steps_into_a_file_the_sidecar_owns_in_its_state_dir(
    name: str, what: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Only the snapshot and endpoints.json were refused: the steps went into the lock file (its pid
    # line, which a second sidecar reports, buried), a file where the engine socket is bound (the bind
    # then refused it), or a temporary file the next start removes.
    import controller.serve

    started: list[bool] = []

    async def serve(*_: object, **__: object) -> None:
        started.append(True)

    monkeypatch.setattr(controller.serve, "serve", serve)
    state = tmp_path / "state"
    state.mkdir()
    (state / "sidecar.lock").write_text("123\n")  # (left by an earlier run)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(f"state_dir: {state}\nadmin_listen: unix://{state / 'admin.sock'}\nmetrics_listen: ''\n")
    target = state / name
    before = target.read_bytes() if target.exists() else None
    assert main(["serve", "--config", str(cfg), "--record-steps", str(target)]) == 2
    assert capsys.readouterr().err == f"error: --record-steps {target}: is {what}; name another output\n"
    assert not started and (target.read_bytes() if target.exists() else None) == before


# -- --json numbers ----------------------------------------------------------------------------------


U64 = st.integers(min_value=0, max_value=2**64 - 1)


@given(revision=U64, version=U64, steps=st.lists(U64, max_size=5))
def test_json_int64_fields_are_numbers_at_every_size(revision: int, version: int, steps: list[int]) -> None:
    status = pb.Status(
        policy=pb.PolicyInfo(name="p", revision=revision),
        engines=[
            pb.EngineStatus(engine_id=f"e{i}", steps=s, directive_version=version)
            for i, s in enumerate(steps)
        ],
    )
    doc = _dump(status)
    assert doc["policy"]["revision"] == revision and isinstance(doc["policy"]["revision"], int)
    assert [e["steps"] for e in doc["engines"]] == steps
    assert all(e["directive_version"] == version for e in doc["engines"])
    assert json.loads(json.dumps(doc)) == doc  # plain JSON, numbers unquoted


def test_json_keeps_strings_strings() -> None:
    doc = _dump(pb.PolicyInfo(name="123", revision=7))
    assert doc["name"] == "123" and doc["revision"] == 7


#: Numeric flags that stay plain ints because their command checks them together with other values
#: (n-gram bounds against each other and max_k; the observer's settings), each exiting 2 naming the flag.
CHECKED_BY_THEIR_COMMAND = {
    ("observe", "--max-k"),
    ("observe", "--interval"),
    ("observe", "--retries"),
    ("trace import", "--min-n"),
    ("trace import", "--max-n"),
    ("trace import", "--max-k"),
    ("trace record", "--min-n"),
    ("trace record", "--max-n"),
}


def _numeric_flags(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, str, object]]:
    out = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += _numeric_flags(sub, (*path, name))
        elif a.type is not None and a.option_strings:
            out.append((" ".join(path), a.option_strings[-1], a.type))
    return out


def test_every_numeric_flag_checks_its_range_before_running() -> None:
    # A plain type=int/float let `--seed -5` or `--duration nan` into the run (a traceback from numpy).
    flags = _numeric_flags(build_parser())
    plain = {(cmd, flag) for cmd, flag, t in flags if t in (int, float)}
    assert plain == CHECKED_BY_THEIR_COMMAND
    seeds = [(cmd, t) for cmd, flag, t in flags if flag == "--seed"]
    assert len(seeds) >= 5 and all(t is cli_types.seed for _, t in seeds), seeds


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--timeout", "nan", "status"], "argument --timeout: must be a number in (0, 3600], got 'nan'"),
        (["demo", "--seed", "-1"], "argument --seed: must be an integer 0..4294967295, got '-1'"),
        (["sim", "autoscale", "--duration=-1"], "argument --duration: must be a number in [1, 604800]"),
        (
            ["sim", "tune", "--policy", "default", "--jobs", "0"],
            "argument --jobs: must be an integer 1..1024",
        ),
    ],
)
def test_out_of_range_flags_exit_2_before_anything_runs(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_observe_names_the_flag_not_the_settings_field(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["observe", "--metrics-url", "http://127.0.0.1:1/metrics", "--sidecar", _closed_port()]
    assert main([*argv, "--engine-id", "e", "--interval", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --interval: must be in (0, 3600] seconds"), err


def test_config_validate_loads_the_default_policy_as_serve_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It said OK for a default_policy that serve then refused at start.
    cfg = tmp_path / "sidecar.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN)
    text = tmp_path / "text.yaml"
    text.write_text("just a line of text\n")
    for target, says in (
        (str(bad), f"{cfg}: default_policy: {bad}:"),
        (str(tmp_path / "missing.yaml"), "missing.yaml"),
        (str(text), f"{text}:1: expected a mapping"),
    ):
        cfg.write_text(f"default_policy: {target}\n")
        assert main(["config", "validate", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    good = tmp_path / "mine.yaml"
    good.write_text(Path("policies/library/default.yaml").read_text().replace("name: default", "name: mine"))
    cfg.write_text(f"default_policy: {good}\n")
    assert main(["config", "validate", str(cfg)]) == 0
    assert f"default policy 'mine' ({good})" in capsys.readouterr().out


@pytest.mark.parametrize("action", [["set", "default"], ["get"], ["rollback"]])
@pytest.mark.parametrize(
    ("engine", "says"),
    [
        ("", "empty engine id (leave out --engine for the default policy)"),
        ("a\nb", "got 'a\\nb' (3 characters)"),
        ("e" * 129, "an engine id has 1-128 characters"),
    ],
)
def test_policy_engine_ids_are_checked_before_the_sidecar_is_called(
    action: list[str], engine: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # To the admin API an empty engine id means the default policy: `--engine "$UNSET"` rolled back or
    # set every engine's policy. The sidecar here is unreachable: only the argument check can answer.
    with pytest.raises(SystemExit) as e:
        main(["--admin", _closed_port(), "policy", *action, f"--engine={engine}"])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--token-file", "--admin-ca-file", "--admin-cert-file", "--admin-key-file"])
def test_an_empty_admin_file_is_refused_not_dropped(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    # '' (an unset variable) was taken for no flag: --admin-ca-file '' dialled the sidecar in plaintext
    # (the bearer token then sent unencrypted to whoever answered), --token-file '' sent
    # $SPECCONTROL_ADMIN_TOKEN instead; exit 1 here, the sidecar being unreachable.
    assert main(["--admin", _closed_port(), "--timeout", "2", flag, "", "status"]) == 2
    assert capsys.readouterr().err == f"{flag} '': not a file name\n"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--token-file", "FIFO", "status"], "--token-file"),
        (["--admin-ca-file", "FIFO", "status"], "--admin-ca-file"),
        (["--admin-cert-file", "FIFO", "--admin-key-file", "FILE", "status"], "--admin-cert-file"),
        (["--admin-cert-file", "FILE", "--admin-key-file", "FIFO", "status"], "--admin-key-file"),
        (["policy", "set", "default", "--fleet", "--broker", "mqtts://127.0.0.1:1", "--ca-file", "FIFO"],
         "--ca-file"),
        (["policy", "set", "default", "--fleet", "--broker", "mqtts://127.0.0.1:1", "--cert-file", "FIFO",
          "--key-file", "FILE"], "--cert-file"),
    ],
)  # fmt: skip
def test_a_token_or_tls_file_that_is_a_fifo_is_refused_before_it_is_opened(
    argv: list[str], flag: str, fifo_without_writer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # open() of a FIFO without a writer blocks until one comes: the command hung before it dialled.
    other = tmp_path / "other.pem"
    other.write_text("-----BEGIN CERTIFICATE-----\n")
    args = [str(fifo_without_writer) if a == "FIFO" else str(other) if a == "FILE" else a for a in argv]
    assert main(["--admin", _closed_port(), "--timeout", "2", *args]) == 2
    hint = " (a token from a pipe goes in $SPECCONTROL_ADMIN_TOKEN)" if flag == "--token-file" else ""
    assert capsys.readouterr().err == f"{flag}: {fifo_without_writer}: is a FIFO, not a regular file{hint}\n"


@pytest.mark.parametrize("token", ["abc\ndef", "t\u00f6ken", "a\x07b"])
@pytest.mark.parametrize("where", ["env", "file"])
def test_a_token_grpc_cannot_send_is_refused_naming_where_it_came_from(
    token: str,
    where: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # gRPC refuses a header value that is not printable ASCII: every command that dialled ended in
    # grpc's ExecuteBatchError traceback (exit 1), the sidecar reachable or not.
    flags: list[str] = []
    if where == "env":
        monkeypatch.setenv("SPECCONTROL_ADMIN_TOKEN", token)
        source = "$SPECCONTROL_ADMIN_TOKEN"
    else:
        f = tmp_path / "token"
        f.write_text(token + "\n")
        flags, source = ["--token-file", str(f)], f"--token-file {f}"
    assert main(["--admin", _closed_port(), "--timeout", "2", *flags, "status"]) == 2
    assert capsys.readouterr().err == f"{source}: the token must be printable ASCII characters\n"


def test_a_bad_admin_address_in_the_environment_only_stops_commands_that_dial_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # $SPECCONTROL_ADMIN was checked by argparse for every command: `policy validate` (and `sim`,
    # `config reference`, ...) refused to run, "argument --admin: port must be 1..65535".
    monkeypatch.setenv("SPECCONTROL_ADMIN", "bad:99999")
    assert main(["policy", "validate", "policies/library/default.yaml"]) == 0
    capsys.readouterr()
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert err == "$SPECCONTROL_ADMIN: port must be 1..65535, got 'bad:99999' (or give --admin ADDR)\n"
    assert main(["--admin", _closed_port(), "--timeout", "2", "status"]) == 1  # --admin wins
    with pytest.raises(SystemExit) as e:  # given as --admin, it is a usage error at once
        main(["--admin", "bad:99999", "policy", "validate", "policies/library/default.yaml"])
    assert e.value.code == 2


# -- policy clear --fleet --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "policy clear: --fleet is required"),
        (["--broker", "mqtt://h"], "policy clear: --fleet is required"),
        (["--fleet", "--broker", "http://h"], "--broker: broker URL: expected mqtt://host[:port]"),
        (["--fleet", "--broker", "mqtt://h", "--ca-file", "ca.pem"], "--broker: broker TLS options"),
        (["--fleet", "--broker", "mqtt://h", "--fleet-name", "a/b"], "--fleet-name: must be 1-64 letters"),
        (["--fleet", "--broker", "mqtt://h", "--fleet-name", ""], "--fleet-name: must be 1-64 letters"),
        (["--fleet", "--broker", ""], "--broker '': not a broker URL"),
        (["--fleet", "--broker", "mqtts://h", "--cert-file", ""], "--cert-file '': not a file name"),
        (["--fleet", "--engine", "e1"], "controllerctl: error: unrecognized arguments: --engine e1"),
    ],
)
def test_fleet_clear_bad_options_are_input_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECCONTROL_MQTT_URL", raising=False)
    try:
        code = main(["policy", "clear", *args])
    except SystemExit as e:  # argparse's own (one line: OneLineParser)
        code = int(str(e.code))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_fleet_clear_needs_a_broker_and_an_unreachable_one_is_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SPECCONTROL_MQTT_URL", raising=False)
    assert main(["policy", "clear", "--fleet"]) == 2
    err = capsys.readouterr().err
    assert "MQTT broker" in err and "SPECCONTROL_MQTT_URL" in err and err.count("\n") == 1
    monkeypatch.setenv("SPECCONTROL_MQTT_URL", f"mqtt://{_closed_port()}")
    assert main(["--timeout", "5", "policy", "clear", "--fleet", "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("cannot reach the MQTT broker: ") and err.count("\n") == 1


def test_fleet_clear_says_what_it_cleared_and_json_is_one_document(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller import fleet
    from tests.controller.test_fleet import FakeBroker, FakeConnection, policy_payload

    broker = FakeBroker()
    FakeConnection.broker = broker
    monkeypatch.setattr(fleet, "MqttConnection", FakeConnection)
    monkeypatch.setenv("SPECCONTROL_FLEET", "prod")
    broker.retained[fleet.Topics("prod").policy] = policy_payload(5)
    ctl = ["policy", "clear", "--fleet", "--broker", "mqtt://broker.example:1883"]
    assert main([*ctl, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert json.loads(out) == {
        "fleet": "prod",
        "broker": "mqtt://broker.example:1883",
        "version": 6,
        "previous": {"state": "policy", "version": 5},
    }
    assert main([*ctl, "--fleet-name", "prod"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "cleared fleet prod (its policy, already cleared as version 6, before) as version 7"
    )
    assert main([*ctl, "--fleet-name", "other", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["previous"] == {"state": "none", "version": 0}
    # The next policy set numbers above the clear.
    assert main(["policy", "set", "static-off", "--fleet", "--broker", "mqtt://broker.example:1883"]) == 0
    assert "to fleet prod as version 8" in capsys.readouterr().out
