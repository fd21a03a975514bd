"""The fleet link against a real mosquitto on loopback, started (and killed) by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from controller._mqtt import BrokerSettings, MqttConnection
from controller.fleet import FleetLink, Topics, publish_fleet_policy

pytestmark = [pytest.mark.integration, pytest.mark.mqtt]

REQUIRE = bool(os.environ.get("SPECCONTROL_REQUIRE_SYSTEM_DEPS"))


def _binary(name: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None
    )
    if path is None:
        if REQUIRE:
            pytest.fail(f"{name} not found but SPECCONTROL_REQUIRE_SYSTEM_DEPS is set")
        pytest.skip(f"{name} not installed (scripts/ci_system_deps.sh installs it)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Mosquitto:
    """One broker process on a fixed loopback port, so a restart is the same address."""

    def __init__(self, binary: str, workdir: Path, extra: str = "") -> None:
        self.binary, self.workdir, self.extra = binary, workdir, extra
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        conf = self.workdir / "mosquitto.conf"
        # As root mosquitto would drop to its own user, which cannot read the test's private tmp dir.
        user = pwd.getpwuid(os.geteuid()).pw_name
        conf.write_text(f"listener {self.port} 127.0.0.1\npersistence false\nuser {user}\n{self.extra}")
        log = open(self.workdir / "mosquitto.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen([self.binary, "-c", str(conf)], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mosquitto exited: {(self.workdir / 'mosquitto.log').read_text()[-2000:]}"
                )
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.02)
        raise RuntimeError("mosquitto did not start listening")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def mosquitto_factory(tmp_path: Path) -> Iterator[Callable[[str], Mosquitto]]:
    binary = _binary("mosquitto")
    started: list[Mosquitto] = []

    def make(extra: str = "") -> Mosquitto:
        m = Mosquitto(binary, tmp_path, extra)
        for attempt in range(3):  # the free port can be taken between probe and bind
            try:
                m.start()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                m.port = _free_port()
        started.append(m)
        return m

    yield make
    for m in started:
        m.kill()


@pytest.fixture
def mosquitto(mosquitto_factory: Callable[[str], Mosquitto]) -> Mosquitto:
    return mosquitto_factory("allow_anonymous true\n")


async def until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class Node:
    """What a sidecar does with its link: apply fleet policies, adopt shared posteriors."""

    def __init__(self, name: str, broker: BrokerSettings, fleet: str = "itest") -> None:
        self.policies: list[tuple[str, int]] = []
        self.posteriors: dict[str, dict[str, Any]] = {}
        self.registry = CollectorRegistry()
        self.link = FleetLink(
            broker=broker,
            fleet=fleet,
            node_id=name,
            registry=self.registry,
            on_policy=lambda y, v: self.policies.append((y, v)),
            on_posteriors=self._posteriors,
            backoff_min_s=0.05,
            backoff_max_s=0.3,
        )

    def _posteriors(self, model: str, state: Any) -> None:
        self.posteriors[model] = dict(state)

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


POSTERIORS = {"state_version": 1, "learner": {"tables": {"1/*": {"n": [3, 0], "mean": [41.5, None]}}}}


async def test_fleet_policy_late_replica_and_broker_restart(mosquitto: Mosquitto) -> None:
    broker = BrokerSettings(host="127.0.0.1", port=mosquitto.port)
    a, b = Node("sidecar-a", broker), Node("sidecar-b", broker)
    nodes = [a, b]
    try:
        for n in nodes:
            await n.link.start()
        for n in nodes:
            assert await n.link.wait_synced(10)

        # Two sidecars receive a fleet policy published the way `controllerctl policy set --fleet` does.
        v1 = await publish_fleet_policy(broker=broker, fleet="itest", yaml="name: p1\n", source="p1.yaml")
        assert v1 == 1
        await until(lambda: bool(a.policies and b.policies), "fleet policy v1 on both")
        assert a.policies == b.policies == [("name: p1\n", 1)]

        a.link.publish_posteriors("org/model-8b", POSTERIORS)
        a.link.publish_state("engine-a", {"directive_version": 3})
        await until(lambda: "org/model-8b" in b.posteriors, "posteriors at b")

        # A third replica started later gets the retained policy and the posteriors before it syncs.
        c = Node("sidecar-c", broker)
        nodes.append(c)
        await c.link.start()
        assert await c.link.wait_synced(10)
        assert c.policies == [("name: p1\n", 1)]
        assert c.posteriors == {"org/model-8b": POSTERIORS}
        assert c.link.latest_posteriors("org/model-8b") == POSTERIORS

        # The broker dies (SIGKILL, no persistence). Nobody crashes; publishing keeps working locally.
        mosquitto.kill()
        await until(lambda: not any(n.link.connected for n in nodes), "disconnects seen")
        a.link.publish_posteriors("org/model-8b", {**POSTERIORS, "rounds": 99})
        b.link.publish_state("engine-b", {"directive_version": 4})
        await asyncio.sleep(0.5)  # a few failed reconnects with backoff
        assert all(n.value("speccontrol_fleet_connection_errors_total") >= 2 for n in nodes)

        mosquitto.start()
        await until(
            lambda: all(n.value("speccontrol_fleet_connections_total") == 2 for n in nodes), "reconnects"
        )
        # Resync: the links restore the retained policy and posteriors the restarted broker lost.
        d = Node("sidecar-d", broker)
        nodes.append(d)
        await d.link.start()
        assert await d.link.wait_synced(10)
        await until(lambda: bool(d.policies) and "org/model-8b" in d.posteriors, "restored retained state")
        assert d.policies == [("name: p1\n", 1)]
        assert d.posteriors["org/model-8b"]["rounds"] == 99

        v2 = await publish_fleet_policy(broker=broker, fleet="itest", yaml="name: p2\n", source="p2.yaml")
        assert v2 == 2
        await until(lambda: all(n.policies[-1] == ("name: p2\n", 2) for n in nodes), "fleet policy v2")
        assert a.policies == b.policies == c.policies == [("name: p1\n", 1), ("name: p2\n", 2)]
        assert all(n.value("speccontrol_fleet_policy_version") == 2 for n in nodes)
        assert all(
            n.value("speccontrol_fleet_malformed_messages_total", kind="policy", reason="not_json") == 0
            for n in nodes
        )
    finally:
        for n in nodes:
            await n.link.stop()


async def test_malformed_retained_payload_is_counted_not_fatal(mosquitto: Mosquitto) -> None:
    broker = BrokerSettings(host="127.0.0.1", port=mosquitto.port)
    t = Topics("itest")
    async with MqttConnection(settings=broker, client_id="raw-writer") as raw:
        await raw.publish(t.policy, b"\x00not json", retain=True)
        await raw.publish(t.posteriors("m"), b'{"v": 9}', retain=True)
    n = Node("sidecar-x", broker)
    await n.link.start()
    try:
        assert await n.link.wait_synced(10)
        assert n.value("speccontrol_fleet_malformed_messages_total", kind="policy", reason="not_json") == 1.0
        assert (
            n.value("speccontrol_fleet_malformed_messages_total", kind="posteriors", reason="version") == 1.0
        )
        assert n.policies == [] and n.link.connected
        v = await publish_fleet_policy(broker=broker, fleet="itest", yaml="name: ok\n", source="ok.yaml")
        assert v == 1  # an unreadable retained policy does not block a new one
        await until(lambda: n.policies == [("name: ok\n", 1)], "the good policy")
    finally:
        await n.link.stop()


async def test_username_and_password(mosquitto_factory: Callable[[str], Mosquitto], tmp_path: Path) -> None:
    passwd = tmp_path / "passwd"
    subprocess.run([_binary("mosquitto_passwd"), "-b", "-c", str(passwd), "fleet", "s3cret"], check=True)
    m = mosquitto_factory(f"allow_anonymous false\npassword_file {passwd}\n")
    good = Node("good", BrokerSettings(host="127.0.0.1", port=m.port, username="fleet", password="s3cret"))
    bad = Node("bad", BrokerSettings(host="127.0.0.1", port=m.port, username="fleet", password="wrong"))
    try:
        await good.link.start()
        await bad.link.start()
        assert await good.link.wait_synced(10)
        await until(lambda: bad.value("speccontrol_fleet_connection_errors_total") >= 2, "refusals")
        assert not bad.link.connected and bad.value("speccontrol_fleet_connections_total") == 0
    finally:
        await good.link.stop()
        await bad.link.stop()


def _openssl(*args: str) -> None:
    subprocess.run([_binary("openssl"), *args], check=True, capture_output=True)


async def test_tls_with_a_private_ca(mosquitto_factory: Callable[[str], Mosquitto], tmp_path: Path) -> None:
    ca_key, ca, key, csr, crt = (tmp_path / f for f in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
             "-days", "1", "-subj", "/CN=test-ca")  # fmt: skip
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=localhost",
    )
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-out", str(crt), "-days", "1", "-extfile", str(ext))  # fmt: skip
    m = mosquitto_factory(f"allow_anonymous true\ncafile {ca}\ncertfile {crt}\nkeyfile {key}\n")
    ok = Node("tls-ok", BrokerSettings(host="127.0.0.1", port=m.port, tls=True, ca_file=str(ca)))
    untrusted = Node("tls-untrusted", BrokerSettings(host="127.0.0.1", port=m.port, tls=True))
    try:
        await ok.link.start()
        await untrusted.link.start()
        assert await ok.link.wait_synced(10)
        v = await publish_fleet_policy(
            broker=BrokerSettings(host="127.0.0.1", port=m.port, tls=True, ca_file=str(ca)),
            fleet="itest",
            yaml="name: tls\n",
            source="t",
        )
        await until(lambda: ok.policies == [("name: tls\n", v)], "policy over TLS")
        await until(lambda: untrusted.value("speccontrol_fleet_connection_errors_total") >= 1, "TLS refusal")
        assert not untrusted.link.connected
    finally:
        await ok.link.stop()
        await untrusted.link.stop()
