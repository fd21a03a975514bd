"""A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate (openssl)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    #: A client certificate from a CA the sidecar does not trust.
    rogue_cert: Path
    rogue_key: Path


def _openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        pytest.skip("openssl is not installed")
    subprocess.run([exe, *args], check=True, capture_output=True)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(crt), "-days", "2", "-subj", f"/CN={name}")  # fmt: skip
    return crt, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    crt, key, csr, extf = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    extf.write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(crt), "-days", "2", "-extfile", str(extf))  # fmt: skip
    return crt, key


def make_certs(d: Path) -> Certs:
    d.mkdir(parents=True, exist_ok=True)
    ca = _ca(d, "ca")
    rogue_ca = _ca(d, "rogue-ca")
    server = _leaf(
        d, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    client = _leaf(d, "client", ca, "extendedKeyUsage=clientAuth\n")
    rogue = _leaf(d, "rogue", rogue_ca, "extendedKeyUsage=clientAuth\n")
    return Certs(ca[0], server[0], server[1], client[0], client[1], rogue[0], rogue[1])
