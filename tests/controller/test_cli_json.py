"""``controllerctl`` status/engines/policy against a real sidecar (loopback gRPC, engines attached over
real streams): what scripts and terminals read.

What must hold: ``--json`` is one strict JSON document (no NaN/Infinity), numbers are numbers, and
every document of a kind has the same keys in the same order whatever the state (no engines,
hundreds, one detached, overrides, after a rollback); human tables keep one line per engine, with
what does not print escaped and wide characters aligned; stdout that is closed, full or not UTF-8
ends in a one-line error or escaped text, never a traceback or a silent exit 0; the exit code says
whether a retry may help (1) or the command is wrong (2).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import unicodedata
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.cli import main
from controller.config import SidecarConfig
from controller.server import SidecarServer
from controller.sidecar import POLICY_CHANGE_BURST
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.wire.codec import request_steps
from policies.presets import resolve_policy_text
from tests.spawn import limited

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CTL = str(Path(sys.executable).parent / "controllerctl")
#: Ids a careless or hostile fleet gives its engines (all accepted by the sidecar).
ODD_IDS = ["引擎-🚀-ünï", "zw\u200bspace", "x" * 128, "a b"]


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in --json output")

    return json.loads(text, parse_constant=refuse)


class Engine:
    """One engine on its own connection (a shared one allows only 256 streams)."""

    def __init__(self, target: str, engine_id: str) -> None:
        self.id = engine_id
        self.channel = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        self.out: asyncio.Queue[pb.EngineMessage | None] = asyncio.Queue()
        arms = [pb.Arm(method="eagle3", k=k) for k in (1, 2, 3, 4)] + [pb.Arm(method="off")]
        self.out.put_nowait(
            pb.EngineMessage(
                hello=pb.Hello(
                    engine_id=engine_id,
                    model="tiny",
                    max_k=4,
                    arms=arms,
                    granularity=pb.GRANULARITY_BATCH_STEP,
                    max_batch_size=64,
                    engine_version="test 0",
                    protocol_version=1,
                )
            )
        )
        stub = pb_grpc.EngineServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.call = stub.Attach(self._messages())

    async def _messages(self) -> AsyncIterator[pb.EngineMessage]:
        while (m := await self.out.get()) is not None:
            yield m

    def report(self) -> None:
        n = 4
        step = pb.StepReport(
            time_s=1000.0,
            duration_s=0.02,
            batch_size=n,
            queue_length=1,
            queue_wait_s=0.1,
            scheduled_k=2,
            requests=request_steps(
                request_ids=[f"r{i}" for i in range(n)],
                classes=["default"] * n,
                methods=["eagle3"] * n,
                ks=[2] * n,
                drafted=[2] * n,
                accepted=[2, 1, 0, 2],
            ),
        )
        self.out.put_nowait(pb.EngineMessage(reports=pb.StepReportBatch(sequence=1, steps=[step])))

    async def close(self) -> None:
        self.out.put_nowait(None)
        await self.channel.close(None)


class Live:
    """A sidecar on an event loop in a thread (the CLI runs its own loop, or its own process)."""

    def __init__(self, state_dir: Path, **config: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.cfg = SidecarConfig(
            engine_listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            metrics_listen="",
            state_dir=str(state_dir),
            **config,
        )
        self.engines: dict[str, Engine] = {}

    def call(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    async def _start(self) -> None:
        self.sidecar = SidecarServer(config=self.cfg)
        await self.sidecar.start()

    def attach(self, ids: list[str], *, report: bool = True) -> None:
        async def go() -> None:
            for eid in ids:
                self.engines[eid] = e = Engine(self.sidecar.engine_target, eid)
                if report:
                    e.report()
            for _ in range(1000):  # bounded
                held = self.sidecar.engines()
                if all(eid in held and (not report or held[eid].loop.totals.steps) for eid in ids):
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("the engines did not attach")

        self.call(go())

    def detach(self, eid: str) -> None:
        async def go() -> None:
            await self.engines.pop(eid).close()
            for _ in range(1000):
                if not self.sidecar.engines()[eid].connected:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("the engine stayed connected")

        self.call(go())

    def set_policies(self, engine_ids: list[str], yaml_text: str) -> None:
        """Per-engine policies set in the sidecar itself (no rate limit), written through as usual."""

        async def go() -> None:
            for eid in engine_ids:
                self.sidecar.set_policy(yaml_text, source="test", engine_id=eid)

        self.call(go())

    async def _stop(self) -> None:
        for e in self.engines.values():
            await e.close()
        await self.sidecar.stop(snapshot=False)

    def __enter__(self) -> Live:
        self.thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    # The smallest message limit: engines page (a quarter of it: about 60 per page), the policy list
    # is cut (half of it).
    with Live(tmp_path / "state", max_message_bytes=128 * 1024) as s:
        yield s


def ctl_in(live: Live, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["--admin", live.sidecar.admin_target, *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def ctl(live: Live, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    opts: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 120, "cwd": ROOT, **kw}
    return subprocess.run([CTL, "--admin", live.sidecar.admin_target, *argv], check=False, **opts)


def _shape(doc: Any) -> Any:
    """The keys of a document, in order, nested (list items: every item's shape, deduplicated)."""
    if isinstance(doc, dict):
        return [(k, _shape(v)) for k, v in doc.items()]
    if isinstance(doc, list):
        shapes: list[Any] = []
        for x in doc:
            s = _shape(x)
            if s not in shapes:
                shapes.append(s)
        return shapes
    return type(doc).__name__ if not isinstance(doc, bool | int | float) else "number/bool"


_INT64 = {"directive_version", "steps", "rejected", "revision"}


def _numbers_are_numbers(doc: Any) -> None:
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k in _INT64:
                assert type(v) is int, (k, v)
            if k.endswith("_s") or k in ("acceptance_rate", "goodput_tok_s", "k", "max_k"):
                assert isinstance(v, int | float) and not isinstance(v, bool), (k, v)
            _numbers_are_numbers(v)
    elif isinstance(doc, list):
        for x in doc:
            _numbers_are_numbers(x)


def test_json_has_the_same_keys_in_the_same_order_in_every_state(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = [("status",), ("engines",), ("policy", "get"), ("policy", "list")]
    seen: dict[tuple[str, ...], dict[str, Any]] = {c: {} for c in commands}

    def snapshot(state: str) -> None:
        for c in commands:
            rc, out, err = ctl_in(live, capsys, *c, "--json")
            assert rc == 0 and err == "", (c, state, err)
            doc = _strict(out)
            _numbers_are_numbers(doc)
            seen[c][state] = doc

    snapshot("no engines")
    live.attach([f"pod-{i:03d}" for i in range(3)], report=False)  # attached, nothing reported yet
    live.attach(["pod-100", "pod-101"])
    snapshot("some engines")
    live.detach("pod-100")
    live.set_policies(["pod-101"], resolve_policy_text("static-off")[0])
    snapshot("detached, override")
    rc, _, err = ctl_in(live, capsys, "policy", "rollback", "--engine", "pod-101")
    assert rc == 0, err
    snapshot("after rollback")

    engine_shapes = set()
    for c in commands:
        docs = seen[c]
        if c == ("status",):
            docs = {s: {**d, "engines": d["engines"][:0]} for s, d in docs.items()}  # engines: below
            for d in seen[c].values():
                engine_shapes.update(json.dumps(_shape(e)) for e in d["engines"])
        if c == ("engines",):
            for d in seen[c].values():
                engine_shapes.update(json.dumps(_shape(e)) for e in d["engines"])
            continue
        shapes = {s: _shape(d) for s, d in docs.items()}
        assert all(v == shapes["no engines"] for v in shapes.values()), (c, shapes)
    # Every engine, attached or detached, reporting or not, in status or in engines: one shape.
    assert len(engine_shapes) == 1, engine_shapes
    assert [k for k, _ in json.loads(engine_shapes.pop())][:4] == [
        "engine_id",
        "model",
        "connected",
        "directive_version",
    ]
    assert seen[("engines",)]["detached, override"]["engines"][0]["connected"] is True
    assert any(not e["connected"] for e in seen[("engines",)]["detached, override"]["engines"])


def test_hundreds_of_engines_page_whole_one_line_each(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    ids = [f"pod-{i:04d}" for i in range(300)] + ODD_IDS
    live.attach(ids)
    rc, out, _ = ctl_in(live, capsys, "engines", "--json")
    assert rc == 0 and [e["engine_id"] for e in _strict(out)["engines"]] == sorted(ids)
    rc, out, _ = ctl_in(live, capsys, "status", "--json")
    doc = _strict(out)
    assert doc["engines_total"] == len(ids) and doc["engines_truncated"] is True
    assert 0 < len(doc["engines"]) < len(ids)
    rc, out, _ = ctl_in(live, capsys, "engines")
    assert rc == 0 and len(out.splitlines()) == 2 + len(ids)  # head, rule, one per engine
    rc, out, _ = ctl_in(live, capsys, "status")
    # How many fit is counted in bytes, which change from call to call (an engine's directive age, 0
    # on the wire until it is not): the page below the line, not the JSON call's, is the count.
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("engines: "))
    shown = len(lines) - at - 3  # head, rule, one per engine
    assert rc == 0 and 0 < shown < len(ids)
    assert lines[at].startswith(f"engines: {len(ids)} (the first {shown} below")


def _engine_table(live: Live, capsys: pytest.CaptureFixture[str]) -> list[str]:
    live.attach(["pod-1", *ODD_IDS])
    rc, out, _ = ctl_in(live, capsys, "engines")
    assert rc == 0
    return out.splitlines()


def test_engine_table_escapes_what_does_not_print(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    # A zero-width space was written as is: "zw\u200bspace" looked like "zwspace", which no engine is.
    lines = _engine_table(live, capsys)
    assert any(line.startswith("zw\\u200bspace ") for line in lines), lines
    assert all(c.isprintable() for line in lines for c in line)


def test_engine_table_aligns_wide_characters(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    # Widths were len(): a row with Chinese or an emoji in its id ran two columns per such character
    # past the others.
    lines = _engine_table(live, capsys)

    def column(line: str, end: int) -> int:  # terminal columns before the character index `end`
        return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line[:end])

    starts = {column(line, line.index("  yes  ") + 2) for line in lines[2:]}
    assert starts == {column(lines[0], lines[0].index("connected"))}, lines


def test_policy_list_says_when_the_sidecar_left_engine_policies_out(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = [f"pod-{i:03d}" for i in range(60)]  # 60 policies of ~1.5 kB: beyond half of 128 KiB
    live.set_policies(ids, resolve_policy_text("default")[0])
    rc, out, _ = ctl_in(live, capsys, "policy", "list", "--json")
    doc = _strict(out)
    assert rc == 0 and 1 < len(doc["active"]) < 1 + len(ids)
    # (the list said nothing: a script counted fewer engines with a policy of their own than there were)
    assert doc["truncated"] is True
    rc, out, _ = ctl_in(live, capsys, "policy", "list")
    assert rc == 0 and "policy get --engine ID" in out.splitlines()[-1], out.splitlines()[-3:]


def test_a_list_beyond_4_mib_from_a_sidecar_allowed_it_is_read(tmp_path: Path) -> None:
    # A sidecar with max_message_bytes 32 MiB lists policies up to 16 MiB; the client refused
    # anything over gRPC's 4 MiB default: "resource_exhausted: Received message larger than max", exit 2.
    text, _ = resolve_policy_text("default")
    big = "".join(f"# padding {i:05d} {'x' * 48}\n" for i in range(900)) + text  # ~60 kB
    with Live(tmp_path / "state", max_message_bytes=32 * 1024 * 1024) as live:
        ids = [f"pod-{i:03d}" for i in range(80)]  # ~4.8 MB in all
        live.set_policies(ids, big)
        out = ctl(live, "policy", "list", "--json")
        assert out.returncode == 0, out.stderr
        doc = _strict(out.stdout)
        assert len(doc["active"]) == 1 + len(ids) and not doc["truncated"]


def test_a_rate_limited_change_is_a_runtime_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "policy changes are limited to ...; retry later" exited 2, the code for "your command is wrong".
    with Live(tmp_path / "state", max_policy_changes_per_s=0.01) as live:
        codes = []
        for _ in range(int(POLICY_CHANGE_BURST) + 1):
            rc, _, err = ctl_in(live, capsys, "policy", "set", "static-off")
            codes.append(rc)
        assert codes == [0] * int(POLICY_CHANGE_BURST) + [1], (codes, err)
        assert err.count("\n") == 1 and "retry later" in err


@pytest.mark.parametrize("argv", [("status", "--json"), ("engines",), ("config", "reference")])
def test_a_closed_stdout_is_a_one_line_error(live: Live, argv: tuple[str, ...]) -> None:
    # `>&-`: status said nothing with exit 0; config reference raised AttributeError.
    out = subprocess.run(
        ["bash", "-c", 'exec "$@" >&-', "-", CTL, "--admin", live.sidecar.admin_target, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr == "error: stdout is closed; controllerctl writes its output there\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_full_stdout_is_said_once(live: Live) -> None:
    with open("/dev/full", "w") as full:
        out = ctl(live, "engines", capture_output=False, stdout=full, stderr=subprocess.PIPE)
    assert out.returncode == 1 and out.stderr == "error: No space left on device\n"  # was "errorNo space"


@pytest.mark.parametrize("env", [{"LC_ALL": "C", "PYTHONUTF8": "0"}, {"PYTHONIOENCODING": "ascii"}])
def test_a_stdout_that_cannot_write_an_id_escapes_it(live: Live, env: dict[str, str]) -> None:
    # An id the encoding cannot write ended the table in a UnicodeEncodeError traceback, exit 1.
    live.attach(ODD_IDS)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "PYTHONIO", "PYTHONUTF8"))}
    out = ctl(live, "engines", env={**base, **env})
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    assert "\\u5f15\\u64ce" in out.stdout and len(out.stdout.splitlines()) == 2 + len(ODD_IDS)
    out = ctl(live, "engines", "--json", env={**base, **env})
    assert out.returncode == 0 and "引擎-🚀-ünï" in {e["engine_id"] for e in _strict(out.stdout)["engines"]}


def test_status_shows_the_snapshot_time_as_a_date(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = ctl_in(live, capsys, "status")
    line = next(x for x in out.splitlines() if x.startswith("snapshot: "))
    assert rc == 0 and line.endswith(" UTC)") and "(last 20" in line, line  # was "(last at 1796568955)"


def test_admin_tls_files_are_checked_and_good_ones_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.security.certs import make_certs

    certs = make_certs(tmp_path / "certs")
    with Live(
        tmp_path / "state",
        admin_tls_cert_file=str(certs.server_cert),
        admin_tls_key_file=str(certs.server_key),
        admin_tls_client_ca_file=str(certs.ca),
    ) as live:
        good = ["--admin-ca-file", str(certs.ca), "--admin-cert-file", str(certs.client_cert),
                "--admin-key-file", str(certs.client_key)]  # fmt: skip
        rc, out, err = ctl_in(live, capsys, *good, "status", "--json")
        assert rc == 0 and _strict(out)["engines"] == [], err
        # A file that is no CA bundle: gRPC logged "Update handshaker factory failed" and the call
        # ended "cannot reach the sidecar ... Failed to create security handshaker", exit 1.
        not_pem = tmp_path / "ca.txt"
        not_pem.write_text("not a certificate\n")
        rc, _, err = ctl_in(live, capsys, *good[2:], "--admin-ca-file", str(not_pem), "status")
        assert (
            rc == 2
            and err
            == f"--admin-ca-file {not_pem}: not a CA certificate bundle (NO_CERTIFICATE_OR_CRL_FOUND)\n"
        )
        rc, _, err = ctl_in(live, capsys, *good[:4], "--admin-key-file", str(certs.rogue_key), "status")
        assert rc == 2 and err.startswith(f"--admin-cert-file {certs.client_cert} with --admin-key-file ")
        assert err.count("\n") == 1 and "not a certificate and its own unencrypted key" in err
        rc, _, err = ctl_in(live, capsys, *good[:4], "--admin-key-file", str(tmp_path), "status")
        assert rc == 2 and err == f"--admin-key-file: {tmp_path}: is a directory, not a regular file\n"


@pytest.mark.parametrize("argv", [("config", "validate", "/dev/zero"), ("serve", "--config", "/dev/urandom")])
def test_a_config_that_is_a_device_is_refused_unread(argv: tuple[str, ...]) -> None:
    # It was read whole: 10 GB of /dev/zero in 6 s, until the process was killed for memory.
    out = subprocess.run(  # memory capped: a reader gone wrong fails fast instead of eating the machine
        limited([CTL, *argv], limit="RLIMIT_AS", value=4 << 30),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.endswith(f"{argv[-1]}: not a config file (a device or socket): name a YAML file\n")
    assert out.stderr.count("\n") == 1
