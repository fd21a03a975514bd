"""The sidecar's addresses as both ends write them: ``host:port`` or ``unix:///path``.

Shared by the sidecar's configuration (its listeners) and the vLLM plugin (``SPECCONTROL_SIDECAR``), so
the plugin never imports the sidecar's config. A bad address raises ``ConfigError`` naming the field.
"""

from __future__ import annotations

import ipaddress

from controller.errors import ConfigError
from controller.wire.names import has_control

#: The longest Unix socket path the kernel takes (sun_path, 108 bytes with its NUL).
MAX_UNIX_PATH = 107


def parse_address(value: str, *, field: str, dial: bool = False) -> tuple[str, int] | str:
    """``host:port`` -> (host, port); ``unix:/path`` or ``unix:///path`` -> the path. Raises ConfigError.

    ``dial``: the address a client connects to (``controllerctl --admin``, the plugin's sidecar), so
    also one it can reach: port 1..65535 (0 only means "any free port" to a listener) and a socket
    path the kernel takes (a client would retry such an address forever)."""
    if has_control(value):  # gRPC would take a path up to a NUL: another socket
        raise ConfigError("holds control characters", field=field)
    if value.startswith("unix:"):
        path = value[len("unix:") :]
        path = path[2:] if path.startswith("//") else path
        if not path or not path.startswith("/"):
            raise ConfigError(
                "unix socket address needs an absolute path, e.g. unix:///run/sc.sock", field=field
            )
        if dial and len(path.encode()) > MAX_UNIX_PATH:
            raise ConfigError(
                f"the socket path is longer than {MAX_UNIX_PATH} bytes ({len(path.encode())})", field=field
            )
        return path
    scheme, sep, _ = value.partition("://")
    if sep and scheme and "[" not in scheme and ":" not in scheme:  # a URL: http://, grpc://, dns:///
        raise ConfigError(
            f"expected 'host:port' or 'unix:///path', without a scheme such as {scheme + sep!r}, got {value!r}",
            field=field,
        )
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):  # "²".isdigit(), and int() refuses it
        raise ConfigError(f"expected 'host:port' or 'unix:///path', got {value!r}", field=field)
    if len(port) > 30:  # int() of over 4,300 digits raises a bare ValueError (a traceback)
        lo = 1 if dial else 0
        raise ConfigError(f"port must be {lo}..65535, got a number of {len(port)} digits", field=field)
    if dial and not 1 <= int(port) <= 65535:
        raise ConfigError(f"port must be 1..65535, got {value!r}", field=field)
    if not 0 <= int(port) <= 65535:
        raise ConfigError(f"port must be 0..65535 (0: any free port), got {port}", field=field)
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if ":" in host and not bracketed:  # gRPC reads "::1:50051" as host "::1:50051", no port: never reached
        raise ConfigError(f"an IPv6 address goes in brackets, e.g. [::1]:50051, got {value!r}", field=field)
    if not host:
        raise ConfigError(f"missing host in {value!r} (use 0.0.0.0 for every interface)", field=field)
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (not for ``0.0.0.0``: that is every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_address(value: str, *, field: str) -> bool:
    """A Unix socket or a loopback TCP address: only processes on this host can connect."""
    addr = parse_address(value, field=field)
    return isinstance(addr, str) or is_loopback(addr[0])
