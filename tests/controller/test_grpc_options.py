"""Every gRPC channel or server option our code passes is one the installed gRPC knows.

gRPC ignores an option key it does not know, silently: the sidecar once passed
``grpc.http2.min_recv_ping_interval_without_data_ms`` (the C macro's name, not its key), so the
5-minute default applied, hidden by unlimited ping strikes. The keys are the core library's strings.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
KEY = re.compile(r"""["'](grpc\.[a-z0-9_.]+)["']""")


def _keys_in_code() -> dict[str, str]:
    keys: dict[str, str] = {}
    for package in ("controller", "sim", "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "/v1/" in str(path):  # generated stubs
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for key in KEY.findall(line):
                    keys.setdefault(key, f"{path.relative_to(ROOT)}:{n}")
    return keys


def test_every_grpc_option_key_in_the_code_is_known_to_grpc() -> None:
    (core,) = (Path(grpc.__file__).parent / "_cython").glob("cygrpc*.so")  # gRPC core, linked in
    library = core.read_bytes()
    keys = _keys_in_code()
    assert "grpc.http2.max_ping_strikes" in keys  # the scan finds the server's options
    # NUL-terminated (a key the linker merged into a longer string has no NUL before it)
    unknown = {k: where for k, where in keys.items() if k.encode() + b"\0" not in library}
    assert unknown == {}
