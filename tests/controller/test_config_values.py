"""Property tests of the sidecar config's setting VALUES, through the public parser.

For every field of ``SidecarConfig``, a document setting that one field to a hostile or ordinary
value either parses to a config whose field holds a value of the field's type within its documented
range (``controller.config_reference.field_ranges``, the reference's range column), every other
field at its default, or raises ``ConfigError`` whose ``str()`` is one line ``c.yaml:LINE: FIELD:
message`` naming that field (or the field it clashes with, whose message names it); never another
exception. Int fields take no floats, not even ``2.0`` or ``1e3``; float fields take ints. What the
parser accepts, dumped back with ``yamldoc.Dumper``, parses to the same config. The parser never opens
the files a config names (``config validate --no-files``); ``check_files`` does, and fails with a
``ConfigError`` naming the setting.
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from controller._mqtt import BrokerSettings
from controller.cli import main
from controller.config import (
    LOG_LEVELS,
    MAX_CONFIG_BYTES,
    MAX_FLEET_NAME,
    MAX_TOKEN_BYTES,
    MIN_TOKEN_CHARS,
    SidecarConfig,
    load_config,
    parse_config,
)
from controller.config_reference import field_ranges
from controller.errors import ConfigError
from controller.wire.address import parse_address
from policies import yamldoc
from policies.presets import preset_names
from policies.text import has_control, name_problem

SOURCE = "c.yaml"
HEAD = "# one setting\n"
LINE = 2  # the setting's line, after HEAD
DEFAULTS = SidecarConfig()
KINDS: dict[str, str] = {f.name: str(f.type) for f in fields(SidecarConfig)}
PER_FIELD = settings(max_examples=80, deadline=None, database=None)


def _documented_ranges() -> dict[str, tuple[Any, Any]]:
    """``lo, hi`` of each number field as the reference documents it (``1..1,000,000``, ``1..1e+07``)."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, text in field_ranges(SidecarConfig).items():
        lo, hi = (s.replace(",", "") for s in text.split(".."))
        out[name] = (int(lo), int(hi)) if KINDS[name] == "int" else (float(lo), float(hi))
    out["engine_socket_mode"] = (0, 0o777)  # a file mode, checked on its own; documented as octal
    return out


RANGES = _documented_ranges()
ADDRESS_FIELDS = ("engine_listen", "admin_listen", "metrics_listen")
FILE_FIELDS = tuple(n for n in KINDS if n.endswith("_file"))
#: Settings that need a partner (the certificate's key, the key's certificate): alone, always refused.
NEVER_ALONE = tuple(n for n in FILE_FIELDS if n.startswith(("engine_tls_", "admin_tls_")))

# -- values ------------------------------------------------------------------------------------------

#: YAML scalars as written after ``key: ``: numbers' edges and forms (YAML 1.1 and 1.2), the other
#: types, tags, escapes, and text that is no YAML at all.
RAW = [
    *("0", "-0", "1", "-1", "0.0", "-0.0", "2.0", "1.5"),
    *(".nan", ".NaN", ".NAN", ".inf", "-.inf", "+.inf", ".Inf", "-.INF"),
    *("1e308", "-1e308", "1e309", "1.7976931348623157e308", "1e-400", "-1e-400", "5e-324"),
    *("1e-3", "1E+2", "1.0e3", "1.5E-2", "+1e1", ".5e1", "1e0", "1e3", "2e0", "6E1"),
    *(str(2**63), str(2**63 - 1), str(-(2**63)), str(2**64), str(2**64 + 1), "9" * 400, "9" * 5000),
    *("true", "false", "True", "FALSE", "yes", "no", "on", "off", "y", "n"),
    *("~", "null", "Null", "", "[]", "{}", "[1, 2]", "{a: 1}", "[[[[[[[[[[1]]]]]]]]]]", "\n  - 1\n  - 2"),
    *("0x1F", "-0x1", "0o17", "0b101", "0600", "0777", "01000", "0644", "1_000", "1:30", "190:20:30"),
    *("2001-12-14", "2001-12-14t21:59:43.10-05:00", "!!binary aGVsbG8=", "!!set {a, b}", "!!omap [a: 1]"),
    *("!!str 5", "!!int '7'", "!!float '1'", "!!bool yes", "!!null ''", "&a 5", "*nowhere"),
    *("!!python/object:os.system x", "!!python/name:os.system ''", "[", "{", "'unclosed", '"\\q"', "- x"),
    *("'quoted'", '"tab\\there"', '"\\x00"', '"nul\\0"', '"\\n"', '"a\\u2028b"', '"\\x85"', '"\\u202e"'),
    *('"\\ud800"', '"/tmp/\\udfff"', '"\\U0001F600"', "ünïcödé", "'  spaced  '", "'#x'", "a # comment"),
    *("|\n  block\n  text\n", ">\n  folded\n", "'" + "x" * 5000 + "'", "x" * 70_000),
    *("127.0.0.1:0", "unix:///tmp/s.sock", "mqtt://b", "mqtts://b:8883", "INFO", "debug", "pod-1"),
    *("127.0.0.1:" + "1" * 5000, "'[::1]:" + "0" * 4400 + "1'", "mqtt://b:" + "1" * 5000),  # int()'s limit
]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=40)
    | st.text(min_size=200, max_size=3000)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def _int_forms(v: int) -> list[str]:
    sign = "-" if v < 0 else ""
    return [str(v), f"{v:_}", f"{sign}{abs(v):#x}", f"{sign}0{abs(v):o}", f"{v}.0", f"{v}e0", f"+{v}"]


def _float_forms(v: float) -> list[str]:
    forms = [repr(v), f"{v:e}", f"{v:E}", f"{v:.17g}", f"{v:+.3e}"]
    return [*forms, str(int(v))] if v.is_integer() else forms


def _numbers(name: str) -> st.SearchStrategy[str]:
    lo, hi = RANGES[name]
    if KINDS[name] == "int":
        ints = (
            st.sampled_from([lo, hi, lo - 1, hi + 1, 0, -1, -hi, 2**63, 2**64])
            | st.integers(lo, hi)
            | st.integers(-(2**65), 2**65)
        )
        return ints.flatmap(lambda v: st.sampled_from(_int_forms(v)))
    edges = [lo, hi, math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf), lo / 2, hi * 2]
    floats = (
        st.sampled_from([*edges, 0.0, -0.0, -lo, 1e308, 5e-324])
        | st.floats(lo, hi)
        | st.floats(allow_nan=False, allow_infinity=False)
    )
    return floats.flatmap(lambda v: st.sampled_from(_float_forms(v)))


def _words(alphabet: str, max_size: int) -> st.SearchStrategy[str]:
    return st.text(alphabet=alphabet, max_size=max_size)


_NAME_CHARS = "abcXYZ019._-/ ü:"
_PATH_CHARS = "ab/._-~ ü\\:"
_hosts = st.sampled_from(
    [
        *("127.0.0.1", "localhost", "0.0.0.0", "::1", "[::1]", "[::1", "::", "[::]", "10.0.0.1"),
        *("example.com", "", "LOCALHOST", "127.1", "ĥøst", "[127.0.0.1]", "a b"),
    ]
)
_ports = st.integers(-2, 70_000).map(str) | st.sampled_from(
    ["", "0", "65535", "65536", "00080", "+80", "٣", "²", "99999999999999999999", "1" * 5000]
)
_unix = st.builds(
    lambda pre, path: f"unix:{pre}{path}",
    st.sampled_from(["//", "", "///", "/"]),
    _words(_PATH_CHARS, 130) | st.sampled_from(["", "/", "/run/s.sock", "/" + "a" * 120]),
)
_addresses = st.builds(lambda h, p: f"{h}:{p}", _hosts, _ports) | _unix | _words("0123456789.:[]a", 20)
_mqtt_urls = st.builds(
    lambda *parts: "".join(parts),
    st.sampled_from(["mqtt://", "mqtts://", "MQTT://", "http://", "", "mqtt:", "mqtt:///"]),
    st.sampled_from(["", "u@", "u:p@", ":p@", "@", "u%40x:p%3A@"]),
    st.sampled_from(["b", "broker.example", "[::1]", "[::1", "127.0.0.1", " ", "", "ℂ", "h h"]),
    st.sampled_from(["", ":1883", ":0", ":65535", ":65536", ":-1", ":x", ":", ":" + "1" * 5000]),
    st.sampled_from(["", "/", "/x", "?q", "#f"]),
)
_paths = (
    _words(_PATH_CHARS, 60)
    | st.sampled_from(["", "/", ".", "..", "~/x", "C:\\x", "a" * 300, "/tmp/" + "a" * 300])
    | st.integers(80, 130).map(lambda n: "/tmp/" + "a" * n)  # the socket path's 107 bytes
)
_names = _words(_NAME_CHARS, 140) | st.sampled_from(
    [".", "..", "-", "a" * 64, "a" * 65, "a" * 128, "a" * 129]
)

STRINGS: dict[str, st.SearchStrategy[str]] = {
    **dict.fromkeys(ADDRESS_FIELDS, _addresses),
    **dict.fromkeys(FILE_FIELDS, _paths),
    "state_dir": _paths,
    "default_policy": st.sampled_from(preset_names()) | _words(_NAME_CHARS, 40),
    "fleet": _names,
    "node_id": _names,
    "mqtt_url": _mqtt_urls,
    "mqtt_username": _words(_NAME_CHARS, 40),
    "log_level": st.sampled_from(
        [*LOG_LEVELS, *(s.lower() for s in LOG_LEVELS), "Info", "warn", "ınfo", "FATAL", " INFO", "INFO "]
    )
    | st.text(max_size=10),
}

_NAME_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
_loopback = st.builds(
    lambda h, p: f"{h}:{p}", st.sampled_from(["127.0.0.1", "localhost", "[::1]"]), st.integers(0, 65535)
)
_mixed_case = st.builds(
    lambda level, upper: "".join(c.upper() if u else c.lower() for c, u in zip(level, upper, strict=False)),
    st.sampled_from(LOG_LEVELS),
    st.lists(st.booleans(), min_size=8, max_size=8),
)
#: Values each setting takes (alone), so that every field is accepted often enough to check what it holds.
VALID: dict[str, st.SearchStrategy[str]] = {
    "engine_listen": _loopback | st.from_regex(r"\Aunix:///[a-z]{1,20}(/[a-z.]{1,20}){0,3}\Z"),
    "admin_listen": _loopback,
    "metrics_listen": _loopback | st.just("0.0.0.0:0") | st.just(""),
    "fleet": st.text(_NAME_ALPHABET, min_size=1, max_size=MAX_FLEET_NAME),
    "node_id": st.text(_NAME_ALPHABET, max_size=128),
    "mqtt_url": st.builds(
        lambda scheme, host, port: f"{scheme}://{host}{port}",
        st.sampled_from(["mqtt", "mqtts"]),
        st.sampled_from(["b", "broker.example", "[::1]", "10.0.0.1", "u@b", "u:p@b"]),
        st.sampled_from(["", ":1", ":1883", ":65535", "/"]),
    ),
    "log_level": _mixed_case,
    "mqtt_tls_insecure": st.sampled_from(["true", "false", "True", "FALSE", "yes", "no", "on", "off"]),
}


def _render(name: str, s: str, how: str) -> str:
    """``name: s`` as a YAML line: plain (as written), quoted, or as the Dumper writes it."""
    if how == "plain":
        return f"{name}: {s}\n"
    if how == "single" and "\n" not in s:
        return f"{name}: '{s.replace(chr(39), chr(39) * 2)}'\n"
    return yaml.dump({name: s}, Dumper=yamldoc.Dumper, allow_unicode=how == "unicode", width=1_000_000)


def documents(name: str) -> st.SearchStrategy[str]:
    """YAML documents setting only ``name``, on line 2."""
    raw = st.sampled_from(RAW).map(lambda v: f"{name}: {v}\n")
    dumped = st.builds(
        lambda v, unicode, flow: yaml.dump(
            {name: v}, Dumper=yamldoc.Dumper, allow_unicode=unicode, default_flow_style=flow
        ),
        _values,
        st.booleans(),
        st.booleans(),
    )
    kinds = [raw, dumped]
    if name in RANGES:
        kinds.append(_numbers(name).map(lambda v: f"{name}: {v}\n"))
    how = st.sampled_from(["plain", "single", "dump", "unicode"])
    if name in STRINGS:
        kinds.append(st.builds(lambda s, h: _render(name, s, h), STRINGS[name], how))
    if name in VALID:  # a boolean written as such (quoted, it is a string)
        valid_how = st.just("plain") if KINDS[name] == "bool" else how
        kinds.append(st.builds(lambda s, h: _render(name, s, h), VALID[name], valid_how))
    return st.one_of(kinds).map(lambda doc: HEAD + doc)


# -- what must hold ----------------------------------------------------------------------------------


def _check_string(name: str, value: str) -> None:
    """What an accepted string setting holds, by field (each rule as the reference states it)."""
    assert not has_control(value), value
    value.encode("utf-8")  # no lone surrogate: it is a path, an address or a name
    if name == "log_level":
        assert value in LOG_LEVELS
    elif name == "fleet":
        assert name_problem(value, longest=MAX_FLEET_NAME) is None
    elif name == "node_id":
        assert value == "" or name_problem(value) is None
    elif name in ("state_dir", "default_policy"):
        assert value
    elif name == "metrics_listen":
        assert value == "" or not value.startswith("unix:")
    elif name == "mqtt_url":
        assert value == "" or BrokerSettings.from_url(value)
    elif name in NEVER_ALONE:
        assert value == ""
    if name in ADDRESS_FIELDS and value:
        parse_address(value, field=name)  # raises when it is no address


def check_accepted(name: str, doc: str, cfg: SidecarConfig) -> None:
    data, lines = yamldoc.load(doc, max_depth=8, max_nodes=10_000)
    given, value, kind = data[name], getattr(cfg, name), KINDS[name]
    if kind == "str" and isinstance(given, float):  # `fleet: 1e3`: the text as written (YAML 1.1's)
        given = lines.yaml12_float_text(name)
    assert type(value).__name__ == kind, (name, value)
    if kind == "bool":
        assert value is given
    elif kind == "int":
        assert type(given) is int and value == given
    elif kind == "float":
        assert type(given) in (int, float) and value == float(given) and math.isfinite(value)
    else:
        assert isinstance(given, str)
        assert value == (given.upper() if name == "log_level" else given)
        _check_string(name, value)
    if name in RANGES:
        lo, hi = RANGES[name]
        assert lo <= value <= hi, (name, value)
    assert all(getattr(cfg, n) == getattr(DEFAULTS, n) for n in KINDS if n != name)
    assert SidecarConfig(**asdict(cfg)) == cfg  # what it holds passes its own checks again
    # rendered back (the project's Dumper), it reads the same
    again = yaml.dump(asdict(cfg), Dumper=yamldoc.Dumper, allow_unicode=True, sort_keys=False)
    assert parse_config(again, source=SOURCE) == cfg, again


def check_refused(name: str, doc: str, e: ConfigError) -> None:
    msg = str(e)
    assert len(msg.splitlines()) == 1 and "\n" not in msg and not has_control(msg), msg
    msg.encode("utf-8")  # printable on any UTF-8 terminal: no lone surrogate
    if len(doc.encode("utf-8", "replace")) > MAX_CONFIG_BYTES:
        assert msg == f"{SOURCE}: larger than {MAX_CONFIG_BYTES} bytes"
        return
    if e.message.startswith("invalid YAML"):  # no YAML document at all: where the parser stopped
        assert e.field == "" and msg.startswith(f"{SOURCE}:"), msg
        return
    assert e.field and msg.startswith(f"{SOURCE}:{e.line}: {e.field}: "), msg
    # the setting's line, or its value's (a block list starts on the next line)
    assert e.line is not None and LINE <= e.line <= doc.count("\n"), msg
    if e.field.startswith((f"{name}[", f"{name}.")):  # nested too deeply: where, inside the value
        return
    # the setting itself, or the one it clashes with (engine_listen for a state_dir whose socket path
    # is too long, the certificate's key file), whose message names the setting
    assert e.field == name or (e.field in KINDS and name in e.message), msg


def check_document(name: str, doc: str) -> SidecarConfig | None:
    try:
        cfg = parse_config(doc, source=SOURCE)
    except ConfigError as e:
        check_refused(name, doc, e)
        return None
    check_accepted(name, doc, cfg)
    return cfg


# -- the tests ---------------------------------------------------------------------------------------


def test_every_number_field_has_a_documented_range() -> None:
    numbers = {n for n, kind in KINDS.items() if kind in ("int", "float")}
    assert numbers == set(RANGES)
    assert set(KINDS.values()) == {"str", "int", "float", "bool"}


@pytest.mark.parametrize("name", list(KINDS))
def test_one_setting_holds_a_valid_value_or_is_refused_naming_it(name: str) -> None:
    @PER_FIELD
    @given(documents(name))
    def run(doc: str) -> None:
        check_document(name, doc)

    run()


@pytest.mark.parametrize("name", list(KINDS))
def test_every_raw_value_every_field(name: str) -> None:
    """The RAW list whole, for each field (hypothesis draws from it, this walks it)."""
    for v in RAW:
        check_document(name, f"{HEAD}{name}: {v}\n")


@pytest.mark.parametrize("name", [n for n in RANGES if KINDS[n] == "float"])
def test_a_float_field_takes_ints_and_yaml_12_exponents(name: str) -> None:
    lo, hi = RANGES[name]
    for text in (f"{lo:e}", f"{hi:E}", f"{hi:.0f}", repr(lo)):
        cfg = parse_config(f"{name}: {text}\n", source=SOURCE)
        assert getattr(cfg, name) == float(text) and type(getattr(cfg, name)) is float
    for text in (f"{math.nextafter(lo, 0):.17e}", f"{math.nextafter(hi, math.inf):.17E}", ".nan", "-.inf"):
        with pytest.raises(ConfigError, match=rf"^{SOURCE}:1: {name}: must be between "):
            parse_config(f"{name}: {text}\n", source=SOURCE)


@pytest.mark.parametrize("name", [n for n in RANGES if KINDS[n] == "int"])
@given(v=st.data())
@settings(max_examples=20, deadline=None, database=None)
def test_an_int_field_refuses_every_float_even_an_integral_one(name: str, v: st.DataObject) -> None:
    # decided by _integer (and the mode's own check): 2.0, 1e3 and 1.0e3 are floats, refused like 1.5
    # (a float field takes 2)
    lo, hi = RANGES[name]
    n = v.draw(st.integers(lo, hi))
    text = v.draw(st.sampled_from([f"{n}.0", f"{n}e0", f"{n:e}", f"{float(n)!r}"]))
    with pytest.raises(ConfigError) as e:
        parse_config(f"{name}: {text}\n", source=SOURCE)
    if name == "engine_socket_mode":
        assert str(e.value) == f"{SOURCE}:1: {name}: expected a file mode 0000..0777, got {float(text)!r}"
    else:
        assert str(e.value) == f"{SOURCE}:1: {name}: expected an integer, got float {float(text)!r}"


# -- files: named, not read, until check_files --------------------------------------------------------

#: A document around one file setting, so that the setting is allowed (TLS on TCP, a broker for mqtt_*).
_FILE_CONTEXT = {
    "engine_tls_cert_file": "engine_listen: 127.0.0.1:0\nengine_tls_key_file: {base}/other\n",
    "engine_tls_key_file": "engine_listen: 127.0.0.1:0\nengine_tls_cert_file: {base}/other\n",
    "engine_tls_client_ca_file": (
        "engine_listen: 127.0.0.1:0\nengine_tls_cert_file: {base}/o1\nengine_tls_key_file: {base}/o2\n"
    ),
    "admin_tls_cert_file": "admin_listen: 127.0.0.1:0\nadmin_tls_key_file: {base}/other\n",
    "admin_tls_key_file": "admin_listen: 127.0.0.1:0\nadmin_tls_cert_file: {base}/other\n",
    "admin_tls_client_ca_file": (
        "admin_listen: 127.0.0.1:0\nadmin_tls_cert_file: {base}/o1\nadmin_tls_key_file: {base}/o2\n"
    ),
    "mqtt_password_file": "mqtt_url: mqtt://broker.example\nmqtt_username: u\n",
    "mqtt_ca_file": "mqtt_url: mqtts://broker.example\n",
    "mqtt_cert_file": "mqtt_url: mqtts://broker.example\n",
    "mqtt_key_file": "mqtt_url: mqtts://broker.example\nmqtt_cert_file: {base}/other\n",
}
_file_names = st.text(
    st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp", "Cf"), blacklist_characters="/\\:#'\""),
    min_size=1,
    max_size=300,
).filter(lambda s: s not in (".", "..") and s.strip() == s)


def _validate(path: Path, *options: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["config", "validate", *options, str(path)])
    return rc, err.getvalue()


@given(
    name=st.sampled_from([*FILE_FIELDS, "state_dir"]),
    file=_file_names | st.sampled_from(["a" * 256, "ü" * 200, "x"]),  # beyond NAME_MAX (255 bytes)
    content=st.none() | st.binary(max_size=200) | st.sampled_from([b"-----BEGIN CERTIFICATE-----\n"]),
)
@settings(max_examples=150, deadline=None, database=None)
def test_files_are_named_by_the_document_and_read_only_by_check_files(
    tmp_path_factory: pytest.TempPathFactory, name: str, file: str, content: bytes | None
) -> None:
    base = tmp_path_factory.mktemp("files")
    path = base / file
    if content is not None:
        with contextlib.suppress(OSError):  # a name too long for this file system stays a name
            path.write_bytes(content)
    context = _FILE_CONTEXT.get(name, "engine_listen: 127.0.0.1:0\n")
    state = "" if name == "state_dir" else f"state_dir: {base}/state\n"
    doc = context.format(base=base) + state + f"{name}: '{path}'\n"
    cfg = parse_config(doc, source=SOURCE)  # the document is fine: nothing named is opened
    assert getattr(cfg, name) == str(path)
    (base / "c.yaml").write_text(doc)
    assert _validate(base / "c.yaml", "--no-files") == (0, "")
    try:
        cfg.check_files()
    except ConfigError as e:
        assert len(str(e).splitlines()) == 1 and e.field, str(e)
        assert e.field in {line.partition(":")[0] for line in doc.splitlines()}, e  # one of its settings
    rc, err = _validate(base / "c.yaml")
    assert rc in (0, 2) and err.count("\n") == (rc == 2), err
    assert rc == 0 or err.startswith(f"{base / 'c.yaml'}:"), err


@given(content=st.binary(max_size=64) | st.text(max_size=40).map(str.encode) | st.just(b"t" * 5000))
@settings(max_examples=100, deadline=None, database=None)
def test_the_admin_token_file_holds_a_token_or_is_refused_naming_it(
    tmp_path_factory: pytest.TempPathFactory, content: bytes
) -> None:
    base = tmp_path_factory.mktemp("token")
    (base / "token").write_bytes(content)
    cfg = parse_config(f"state_dir: {base}/s\nadmin_token_file: {base}/token\n", source=SOURCE)
    try:
        token = content.decode("utf-8").strip()
    except UnicodeDecodeError:
        token = None
    valid = (
        token is not None
        and len(content) <= MAX_TOKEN_BYTES
        and len(token) >= MIN_TOKEN_CHARS
        and token.isascii()
        and token.isprintable()
        and " " not in token
    )
    if valid:
        cfg.check_files()
        assert cfg.admin_token() == token
    else:
        with pytest.raises(ConfigError, match=r"^<config>: admin_token_file: "):
            cfg.check_files()


@pytest.mark.parametrize("url", ["mqtt://broker.example", "mqtts://broker.example:8883"])
def test_a_password_file_without_a_user_name_is_refused_by_the_document(tmp_path: Path, url: str) -> None:
    # was: parsed and `config validate --no-files` said OK; check_files (`config validate`, `serve`)
    # then raised ValueError "broker password: given without a username", a traceback
    (tmp_path / "pw").write_text("secret\n")
    doc = f"mqtt_url: {url}\nmqtt_password_file: {tmp_path}/pw\nstate_dir: {tmp_path}/s\n"
    with pytest.raises(ConfigError) as e:
        parse_config(doc, source=SOURCE)
    assert (
        str(e.value) == f"{SOURCE}:2: mqtt_password_file: given without mqtt_username (or a user in mqtt_url)"
    )
    for named in ("mqtt_username: u\n", ""):  # a user name in the setting or in the URL
        at = url.replace("://", "://u@") if not named else url
        cfg = parse_config(f"mqtt_url: {at}\nmqtt_password_file: {tmp_path}/pw\n{named}", source=SOURCE)
        broker = cfg.broker_settings()
        assert broker is not None and (broker.username, broker.password) == ("u", "secret")


@given(st.sampled_from([n for n in KINDS if n != "default_policy"]).flatmap(lambda n: documents(n)))
@settings(max_examples=120, deadline=None, database=None)
def test_config_validate_no_files_agrees_with_the_parser(
    tmp_path_factory: pytest.TempPathFactory, doc: str
) -> None:
    # (default_policy is left out: a random one may name a file of this machine, which validate reads)
    path = tmp_path_factory.mktemp("cli") / "c.yaml"
    path.write_text(doc, encoding="utf-8")
    try:
        load_config(str(path))  # parse_config of the file's text ("\r" read as a line break)
    except ConfigError as e:
        assert _validate(path, "--no-files") == (2, f"{e}\n")
    else:
        assert _validate(path, "--no-files") == (0, "")
