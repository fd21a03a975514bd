"""The plugin's settings (controller/vllm/settings.py): what each SPECCONTROL_* variable takes, and
that a hostile environment gets one SettingsError naming the variable, never another exception and
never a setting outside its range."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.vllm.settings import (
    BATCH_MAX_RANGE,
    FLUSH_S_RANGE,
    MAX_CLASS_KEY,
    MAX_ENGINE_ID_SETTING,
    MAX_SIDECAR,
    QUEUE_SIZE_RANGE,
    WORKER_KERNELS,
    WORKER_NGRAM,
    PluginSettings,
    SettingsError,
    enabled,
    switch_problem,
)
from controller.wire.address import parse_address
from controller.wire.names import has_control
from policies.arms import Arm, Method
from policies.prompt_lookup import MAX_NGRAM

CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY_PEM = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


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
    ca, cert, key = _pem_files(tmp_path)
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
            "SPECCONTROL_TLS_CA: '/nonexistent/ca.pem' does not exist",
        ),
    ],
)
def test_bad_tls_settings_name_the_variable(tmp_path: Path, extra: dict[str, str], where: str) -> None:
    ca, cert, key = _pem_files(tmp_path)
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


def _pem_files(at: Path) -> tuple[Path, Path, Path]:
    ca, cert, key = (at / n for n in ("ca.pem", "c.pem", "k.pem"))
    ca.write_text(CA_PEM)
    cert.write_text(CA_PEM)
    key.write_text(KEY_PEM)
    return ca, cert, key


# -- hostile values ---------------------------------------------------------------------------------

#: Every variable PluginSettings.from_env reads.
VARIABLES = (
    "SPECCONTROL_SIDECAR",
    "SPECCONTROL_ENGINE_ID",
    "SPECCONTROL_SAFE_DEFAULT",
    "SPECCONTROL_QUEUE_SIZE",
    "SPECCONTROL_BATCH_MAX",
    "SPECCONTROL_FLUSH_S",
    "SPECCONTROL_COMPOSITE",
    "SPECCONTROL_CLASS_KEY",
    "SPECCONTROL_TRACE",
    "SPECCONTROL_NGRAM_MIN",
    "SPECCONTROL_NGRAM_MAX",
    "SPECCONTROL_TLS_CA",
    "SPECCONTROL_TLS_CERT",
    "SPECCONTROL_TLS_KEY",
    "SPECCONTROL_TEST_CPU_ASYNC",
    "SPECCONTROL_V2_COMPOSITE",
    "SPECCONTROL_WORKER_NGRAM",
    "SPECCONTROL_WORKER_KERNELS",
)
#: Values that are in range for a type and not for physics, or for no type at all.
HOSTILE = (
    "nan", "inf", "-inf", "1e300", "1e-300", "1e9999", str(2**63), str(10**12), "-1", "0", "", " ", "1_0",
    "+5", "0x10", "\u0661\u0662", "fasle", "2", "\x00", "a\x00b", "\udcff", "\u2028", "\u202e", "\x1b[31m",
    "9" * 5000, "e" * 5000, "/", "/tmp", "/dev/null", "/nonexistent/x", "/proc/self/mem", "off", "eagle3:2",
    "a b:5", "[::1]:5", ":5", "dns:///h:5", "unix:///tmp/\udcff.sock", "unix:///tmp/a.sock", "127.0.0.1:0",
    "127.0.0.1:5", "on", "device", "triton",
)  # fmt: skip
values = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(
        st.characters(exclude_categories=()), max_size=20
    ),  # surrogates too: os.environ's undecodable bytes
    st.from_regex(r"-?[0-9]{0,25}(\.[0-9]{0,5})?(e[+-]?[0-9]{1,4})?", fullmatch=True),
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths a TLS or trace variable may name: good PEM, a non-PEM file, a directory."""
    at = tmp_path_factory.mktemp("files")
    ca, _, key = _pem_files(at)
    (at / "junk").write_text("not a certificate")
    return {"ca": str(ca), "key": str(key), "junk": str(at / "junk"), "dir": str(at)}


def assert_startable(s: PluginSettings) -> None:
    """Every setting within its documented range: what the engine core is built with."""
    for name in ("sidecar", "engine_id", "class_key", "trace_path", "tls_ca", "tls_cert", "tls_key"):
        text = getattr(s, name)
        assert not has_control(text), name
        text.encode("utf-8")  # gRPC and protobuf encode it so
    assert len(s.sidecar) <= MAX_SIDECAR
    parse_address(s.sidecar, field="SPECCONTROL_SIDECAR", dial=True)
    assert len(s.engine_id) <= MAX_ENGINE_ID_SETTING
    assert 1 <= len(s.class_key) <= MAX_CLASS_KEY
    assert QUEUE_SIZE_RANGE[0] <= s.queue_size <= QUEUE_SIZE_RANGE[1]
    assert BATCH_MAX_RANGE[0] <= s.batch_max <= BATCH_MAX_RANGE[1]
    assert math.isfinite(s.flush_s) and FLUSH_S_RANGE[0] <= s.flush_s <= FLUSH_S_RANGE[1]
    assert 1 <= s.ngram_min <= s.ngram_max <= MAX_NGRAM
    assert s.worker_ngram in WORKER_NGRAM and s.worker_kernels in WORKER_KERNELS
    for b in (s.composite, s.cpu_async_for_tests, s.v2_composite):
        assert isinstance(b, bool)
    for path in (s.tls_ca, s.tls_cert, s.tls_key):
        assert not path or os.path.isfile(path)
    if s.trace_path:
        assert not os.path.isdir(s.trace_path)
        assert os.path.isdir(os.path.dirname(os.path.abspath(s.trace_path)))


def assert_refusal_is_one_clear_line(e: SettingsError) -> None:
    text = str(e)
    assert text.startswith("SPECCONTROL_"), text
    assert not has_control(text), text
    assert len(text) < 400, text  # a 5000-character value is shown cut
    text.encode("utf-8")


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(VARIABLES), value=values, data=st.data())
def test_any_value_of_any_variable_is_refused_by_name_or_startable(
    files: dict[str, str], name: str, value: str, data: st.DataObject
) -> None:
    env = {"SPECCONTROL_SIDECAR": "127.0.0.1:5", name: value}
    if name.startswith("SPECCONTROL_TLS_") and data.draw(st.booleans()):
        env = {
            "SPECCONTROL_SIDECAR": "sidecar.ns.svc:50061",
            "SPECCONTROL_TLS_CA": files["ca"],
            "SPECCONTROL_TLS_CERT": files["ca"],
            "SPECCONTROL_TLS_KEY": files["key"],
            name: data.draw(st.one_of(st.just(value), st.sampled_from(sorted(files.values())))),
        }
    try:
        s = PluginSettings.from_env(env)
    except SettingsError as e:
        assert_refusal_is_one_clear_line(e)
        return
    assert_startable(s)


@settings(max_examples=300, deadline=None)
@given(env=st.dictionaries(st.sampled_from(VARIABLES), values, max_size=len(VARIABLES)))
def test_any_environment_is_refused_by_name_or_startable(env: dict[str, str]) -> None:
    try:
        s = PluginSettings.from_env(env)
    except SettingsError as e:
        assert_refusal_is_one_clear_line(e)
        return
    assert_startable(s)


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        # before: taken, and the link's flush wait was that long or nothing (nan never elapses)
        ("SPECCONTROL_FLUSH_S", "nan", "SPECCONTROL_FLUSH_S: expected a number 0.001..10.0, got 'nan'"),
        ("SPECCONTROL_FLUSH_S", "inf", "SPECCONTROL_FLUSH_S: expected a number"),
        ("SPECCONTROL_FLUSH_S", "1e9999", "SPECCONTROL_FLUSH_S: must be 0.001..10.0, got '1e9999'"),
        ("SPECCONTROL_FLUSH_S", "1e300", "SPECCONTROL_FLUSH_S: must be 0.001..10.0"),
        ("SPECCONTROL_FLUSH_S", "0", "SPECCONTROL_FLUSH_S: must be 0.001..10.0, got 0.0"),
        ("SPECCONTROL_FLUSH_S", "1_0", "SPECCONTROL_FLUSH_S: expected a number"),  # before: 10.0
        ("SPECCONTROL_QUEUE_SIZE", str(2**63), "SPECCONTROL_QUEUE_SIZE: must be 16..1000000"),
        ("SPECCONTROL_QUEUE_SIZE", str(10**12), "SPECCONTROL_QUEUE_SIZE: must be 16..1000000"),
        ("SPECCONTROL_QUEUE_SIZE", "\u0661\u0662\u0663", "SPECCONTROL_QUEUE_SIZE: expected an integer"),  # before: 123
        # before: the whole 5000 digits quoted in the log line
        ("SPECCONTROL_QUEUE_SIZE", "9" * 4000, "SPECCONTROL_QUEUE_SIZE: expected an integer 16..1000000, got '999"),
        ("SPECCONTROL_QUEUE_SIZE", "9" * 5000, "SPECCONTROL_QUEUE_SIZE: longer than 4096 characters, got '999"),
        ("SPECCONTROL_BATCH_MAX", "0", "SPECCONTROL_BATCH_MAX: must be 1..1024, got 0"),
        ("SPECCONTROL_BATCH_MAX", "-1", "SPECCONTROL_BATCH_MAX: must be 1..1024, got -1"),
        ("SPECCONTROL_NGRAM_MIN", "1_0", "SPECCONTROL_NGRAM_MIN: expected an integer, got '1_0'"),
        # before: a typo left composite drafting on, and the opt-ins off, without a word
        ("SPECCONTROL_COMPOSITE", "fasle", "SPECCONTROL_COMPOSITE: expected 1/true/yes/on or 0/false/no/off"),
        ("SPECCONTROL_V2_COMPOSITE", "2", "SPECCONTROL_V2_COMPOSITE: expected"),
        ("SPECCONTROL_TEST_CPU_ASYNC", "enable", "SPECCONTROL_TEST_CPU_ASYNC: expected"),
        # before: taken; never matched a request (and a NUL or newline would reach the log)
        ("SPECCONTROL_CLASS_KEY", "tc\x00", "SPECCONTROL_CLASS_KEY: a vllm_xargs key of 1..128"),
        ("SPECCONTROL_CLASS_KEY", "k" * 129, "SPECCONTROL_CLASS_KEY: a vllm_xargs key of 1..128"),
        # before: taken, and the Hello could not be encoded when the scheduler was built (traceback)
        ("SPECCONTROL_ENGINE_ID", "pod-\udcff", "SPECCONTROL_ENGINE_ID: is not valid UTF-8, got 'pod-\\udcff'"),
        # before: UnicodeEncodeError out of from_env
        ("SPECCONTROL_SIDECAR", "unix:///tmp/\udcff.sock", "SPECCONTROL_SIDECAR: is not valid UTF-8"),
        ("SPECCONTROL_SIDECAR", "x" * 600 + ":5", "SPECCONTROL_SIDECAR: longer than 512 characters"),
        # before: ValueError (embedded null byte) out of from_env, naming no variable
        ("SPECCONTROL_TLS_CA", "a\x00b", "SPECCONTROL_TLS_CA: holds control characters, got 'a\\x00b'"),
        ("SPECCONTROL_TLS_KEY", "\x00", "SPECCONTROL_TLS_KEY: holds control characters"),
        # before: taken, and open() failed when the scheduler was built (traceback)
        ("SPECCONTROL_TRACE", "/nonexistent/t.jsonl", "SPECCONTROL_TRACE: the directory '/nonexistent' does not"),
        ("SPECCONTROL_TRACE", "/tmp", "SPECCONTROL_TRACE: '/tmp' is a directory"),
        # before: taken, and open() failed when the scheduler was built (IsADirectoryError, traceback)
        ("SPECCONTROL_TRACE", "/tmp/new/", "SPECCONTROL_TRACE: '/tmp/new/' is a directory"),
        ("SPECCONTROL_TRACE", "t\x00.jsonl", "SPECCONTROL_TRACE: holds control characters"),
        ("SPECCONTROL_ENGINE_ID", "e" * 5000, "SPECCONTROL_ENGINE_ID: longer than 4096 characters"),
        ("SPECCONTROL_SAFE_DEFAULT", "x" * 1000, "SPECCONTROL_SAFE_DEFAULT: not an arm, got 'xxx"),
    ],
)  # fmt: skip
def test_hostile_values_are_refused_by_name(name: str, value: str, says: str) -> None:
    with pytest.raises(SettingsError) as e:
        PluginSettings.from_env({"SPECCONTROL_SIDECAR": "127.0.0.1:5", name: value})
    assert str(e.value).startswith(says), str(e.value)
    assert_refusal_is_one_clear_line(e.value)


@pytest.mark.parametrize(
    ("sidecar", "says"),
    [
        # before: taken with TLS set, and the link retried an address gRPC cannot resolve forever
        ("a b:5", "SPECCONTROL_SIDECAR: 'a b' is no IP address or host name"),
        ("dns:///a b:5", "SPECCONTROL_SIDECAR: 'a b' is no IP address or host name"),
        ("dns:///unix:///tmp/s.sock", "SPECCONTROL_SIDECAR: dns:/// names a host:port, not a socket"),
        ("dns://1.1.1.1/h:1", "SPECCONTROL_SIDECAR: expected host:port, unix:///path or dns:///host:port"),
        # before: taken as host '::1' (loopback, no TLS asked), and gRPC could never dial it
        ("::1:5", "SPECCONTROL_SIDECAR: an IPv6 address goes in brackets, e.g. [::1]:50051, got '::1:5'"),
        ("-:5", "SPECCONTROL_SIDECAR: '-' is no IP address or host name"),
        ("[:5", "SPECCONTROL_SIDECAR: '[' is no IP address or host name"),
    ],
)
def test_a_sidecar_host_that_is_no_host_is_refused(tmp_path: Path, sidecar: str, says: str) -> None:
    ca, cert, key = _pem_files(tmp_path)
    tls = {"SPECCONTROL_TLS_CA": str(ca), "SPECCONTROL_TLS_CERT": str(cert), "SPECCONTROL_TLS_KEY": str(key)}
    with pytest.raises(SettingsError) as e:
        PluginSettings.from_env({"SPECCONTROL_SIDECAR": sidecar, **tls})
    assert str(e.value).startswith(says), str(e.value)
    for good in ("sidecar.ns.svc:50061", "sc_1.local.:5", "10.0.0.7:5", "[fd00::1]:5", "localhost:5",
                 "dns:///sidecar.ns.svc:50061"):  # fmt: skip
        assert PluginSettings.from_env({"SPECCONTROL_SIDECAR": good, **tls}).sidecar == good


@pytest.mark.parametrize(
    ("what", "says"),
    [
        # before: taken (os.access passes a directory, /dev/null, any file), and the link failed at the
        # scheduler's start (IsADirectoryError, traceback) or at every handshake after it
        ("dir", "is not a regular file"),
        ("/dev/null", "is not a regular file"),
        ("empty", "is not PEM"),
        ("junk", "is not PEM"),
        ("swapped", "is not PEM"),  # a certificate where the key goes
    ],
)
def test_tls_files_must_be_pem(tmp_path: Path, what: str, says: str) -> None:
    ca, cert, key = _pem_files(tmp_path)
    (tmp_path / "empty").write_text("")
    (tmp_path / "junk").write_text("hello")
    bad = {"dir": str(tmp_path), "/dev/null": "/dev/null", "swapped": str(cert)}.get(
        what, str(tmp_path / what)
    )
    env = {
        "SPECCONTROL_SIDECAR": "sidecar.ns.svc:50061",
        "SPECCONTROL_TLS_CA": str(ca),
        "SPECCONTROL_TLS_CERT": str(cert),
        "SPECCONTROL_TLS_KEY": bad,
    }
    with pytest.raises(SettingsError, match=f"^SPECCONTROL_TLS_KEY: .* {says}"):
        PluginSettings.from_env(env)
    env |= {"SPECCONTROL_TLS_KEY": str(key), "SPECCONTROL_TLS_CA": bad}
    if what != "swapped":
        with pytest.raises(SettingsError, match=f"^SPECCONTROL_TLS_CA: .* {says}"):
            PluginSettings.from_env(env)


def test_flags_take_yes_and_no_and_nothing_else() -> None:
    base = {"SPECCONTROL_SIDECAR": "127.0.0.1:5"}
    for off in ("0", "false", "No", " OFF "):
        assert not PluginSettings.from_env(base | {"SPECCONTROL_COMPOSITE": off}).composite
    for on in ("1", "true", "Yes", "on", ""):
        assert PluginSettings.from_env(base | {"SPECCONTROL_COMPOSITE": on}).composite
    assert PluginSettings.from_env(base | {"SPECCONTROL_V2_COMPOSITE": "yes"}).v2_composite
    assert not PluginSettings.from_env(base | {"SPECCONTROL_V2_COMPOSITE": "off"}).v2_composite


def test_a_trace_file_that_can_be_created_is_taken(tmp_path: Path) -> None:
    base = {"SPECCONTROL_SIDECAR": "127.0.0.1:5"}
    path = str(tmp_path / "trace.jsonl")
    assert PluginSettings.from_env(base | {"SPECCONTROL_TRACE": path}).trace_path == path
    assert not (tmp_path / "trace.jsonl").exists()  # checked, not created (every vLLM process reads it)
    assert PluginSettings.from_env(base | {"SPECCONTROL_TRACE": "/dev/null"}).trace_path == "/dev/null"


def test_a_trace_path_naming_a_fifo_is_refused_before_it_can_block_the_engine(tmp_path: Path) -> None:
    # before: taken (os.access passes a FIFO), and the engine core's open() for appending waited for
    # a reader that never came: the engine never finished starting, and nothing was raised
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    with pytest.raises(SettingsError) as e:
        PluginSettings.from_env({"SPECCONTROL_SIDECAR": "127.0.0.1:5", "SPECCONTROL_TRACE": str(fifo)})
    assert str(e.value).startswith("SPECCONTROL_TRACE: '/") and str(e.value).endswith(
        " is a FIFO without a reader or a socket, not a file"
    )
    # a pipe with a reader (a container's /dev/stdout) is taken, as before
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        env = {"SPECCONTROL_SIDECAR": "127.0.0.1:5", "SPECCONTROL_TRACE": str(fifo)}
        assert PluginSettings.from_env(env).trace_path == str(fifo)
    finally:
        os.close(reader)


def test_the_switch_says_when_it_is_no_yes_or_no() -> None:
    assert switch_problem({}) is None
    assert switch_problem({"SPECCONTROL_PLUGIN": " 0 "}) is None
    assert switch_problem({"SPECCONTROL_PLUGIN": "on"}) is None
    problem = switch_problem({"SPECCONTROL_PLUGIN": "ture\n"})
    assert problem is not None and problem.startswith("SPECCONTROL_PLUGIN: expected 1/true/yes/on")
    assert not enabled({"SPECCONTROL_PLUGIN": "ture"})
