"""Sidecar addresses as the sidecar's config and the plugin read them: forms, edges and errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.errors import ConfigError
from controller.wire.address import is_local_address, is_loopback, parse_address


def test_parse_address() -> None:
    assert parse_address("0.0.0.0:0", field="x") == ("0.0.0.0", 0)
    assert parse_address("[::1]:50061", field="x") == ("::1", 50061)
    assert parse_address("unix:///tmp/s.sock", field="x") == "/tmp/s.sock"
    assert parse_address("unix:/tmp/s.sock", field="x") == "/tmp/s.sock"
    assert parse_address("localhost:65535", field="x") == ("localhost", 65535)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("unix:rel.sock", "absolute path"),
        ("unix:", "absolute path"),
        ("localhost", "host:port"),
        ("localhost:http", "host:port"),
        ("localhost:65536", "port must be 0..65535"),
        (":50061", "missing host"),
        ("localhost:²", "host:port"),  # a digit to isdigit(), not to int()
        ("localhost:٣", "host:port"),
    ],
)
def test_bad_addresses_name_the_field(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        parse_address(value, field="SPECCONTROL_SIDECAR")
    assert e.value.field == "SPECCONTROL_SIDECAR" and "SPECCONTROL_SIDECAR" in str(e.value)


def test_loopback() -> None:
    assert is_loopback("localhost") and is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")
    assert is_local_address("unix:///run/sc.sock", field="x") and is_local_address("127.0.0.1:1", field="x")
    assert not is_local_address("0.0.0.0:50061", field="x")


@given(st.text(max_size=40))
def test_any_text_parses_or_raises_config_error(value: str) -> None:
    try:
        out = parse_address(value, field="f")
    except ConfigError as e:
        assert str(e).startswith("<config>: f: ")
    else:
        assert (isinstance(out, str) and out.startswith("/")) or (
            isinstance(out, tuple) and 0 <= out[1] <= 65535
        )


def test_an_address_to_dial_is_one_a_client_can_reach_at_the_edges_of_each_range() -> None:
    # a listener may take port 0 (any free port); a client dialling it would retry forever
    assert parse_address("127.0.0.1:0", field="f") == ("127.0.0.1", 0)
    for port in ("1", "65535"):
        assert parse_address(f"127.0.0.1:{port}", field="f", dial=True) == ("127.0.0.1", int(port))
    for port in ("0", "65536", "116603", "9" * 30):
        with pytest.raises(ConfigError, match=r"^<config>: f: port must be 1\.\.65535, got '127\.0\.0\.1:"):
            parse_address(f"127.0.0.1:{port}", field="f", dial=True)
    longest = "/" + "s" * 106  # 107 bytes: what sun_path holds besides its NUL
    assert parse_address(f"unix://{longest}", field="f", dial=True) == longest
    with pytest.raises(ConfigError, match=r"the socket path is longer than 107 bytes \(108\)"):
        parse_address(f"unix://{longest}x", field="f", dial=True)
    for bad in ("unix:///tmp/a\x00b.sock", "127.0.0.1:5\n", "h\x1b:5"):  # gRPC dialled /tmp/a
        with pytest.raises(ConfigError, match="holds control characters"):
            parse_address(bad, field="f")


@pytest.mark.parametrize("value", ["::1:50061", "fd00::1:5", "::50061"])
def test_an_ipv6_address_without_brackets_is_refused(value: str) -> None:
    # gRPC reads "::1:50061" as a host with no port: a listener fails to bind, a client never connects
    # (the plugin took "::1" as loopback and retried it for ever).
    with pytest.raises(ConfigError, match=r"an IPv6 address goes in brackets, e\.g\. \[::1\]:50051"):
        parse_address(value, field="x", dial=True)


@pytest.mark.parametrize("dial", [False, True])
def test_a_port_of_thousands_of_digits_is_refused_as_a_port(dial: bool) -> None:
    # int() of over 4,300 digits raised a bare ValueError: a traceback from the config or the CLI.
    with pytest.raises(ConfigError, match=r"port must be [01]\.\.65535, got a number of 5000 digits"):
        parse_address("127.0.0.1:" + "9" * 5000, field="x", dial=dial)


@pytest.mark.parametrize(
    "value", ["http://127.0.0.1:50062", "https://sidecar:50062", "grpc://[::1]:50061", "dns:///127.0.0.1:1"]
)
@pytest.mark.parametrize("dial", [False, True])
def test_an_address_with_a_url_scheme_is_refused_as_such(value: str, dial: bool) -> None:
    # `controllerctl --admin http://127.0.0.1:50062` (the form a Prometheus or vLLM URL takes) was
    # refused as "an IPv6 address goes in brackets".
    with pytest.raises(ConfigError, match=r"expected 'host:port' or 'unix:///path', without a scheme") as e:
        parse_address(value, field="admin", dial=dial)
    assert "brackets" not in str(e.value) and repr(value) in str(e.value)
