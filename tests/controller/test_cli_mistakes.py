"""Plausible user mistakes against the real ``controllerctl`` (a subprocess): one line, no traceback.

The contract (controller/cli.py, sim/cli.py): exit 2 for usage and input errors, 1 for runtime errors
(unreachable sidecar, unwritable output), 130 for Ctrl-C; stderr never holds a Python traceback.
MISTAKES lists each mistake with the exit code and what the message must name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.serve_process import serve_process

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CTL = str(Path(sys.executable).parent / "controllerctl")
BINARY = bytes(range(256)) * 4  # not UTF-8, not YAML, not JSON


def ctl(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CTL, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def no_traceback(out: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr[-3000:]


@dataclass(frozen=True)
class Mistake:
    name: str
    argv: tuple[str, ...]
    code: int
    says: str  # a substring stderr must hold (FILE is replaced by the scratch file's path)


def _mistakes() -> list[Mistake]:
    closed = f"127.0.0.1:{_closed_port()}"
    return [
        Mistake("no command", (), 2, "the following arguments are required: COMMAND"),
        # a port beyond 65535 wrapped around to another port: the change (and the token) went there
        Mistake(
            "admin port 116603",
            ("--admin", "127.0.0.1:116603", "policy", "get"),
            2,
            "--admin: port must be 1..65535, got '127.0.0.1:116603'",
        ),
        Mistake("admin port 0", ("--admin", "127.0.0.1:0", "status"), 2, "--admin: port must be 1..65535"),
        Mistake("admin no port", ("--admin", "sidecar", "status"), 2, "--admin: expected 'host:port'"),
        Mistake("unknown command", ("frobnicate",), 2, "invalid choice"),
        Mistake("unknown flag", ("status", "--jsn"), 2, "unrecognized arguments"),
        Mistake("policy file is binary", ("policy", "validate", "FILE"), 2, "FILE"),
        Mistake(
            "policy file missing", ("policy", "validate", "/nonexistent/p.yaml"), 2, "/nonexistent/p.yaml"
        ),
        Mistake("unknown preset", ("policy", "set", "no-such-preset"), 2, "no-such-preset"),
        Mistake("clear without --fleet", ("policy", "clear"), 2, "--fleet is required"),
        Mistake(
            "clear, broker without scheme",
            ("policy", "clear", "--fleet", "--broker", "127.0.0.1:1"),
            2,
            "--broker: broker URL: expected mqtt://host[:port]",
        ),
        Mistake(
            "sidecar unreachable",
            ("--admin", closed, "--timeout", "2", "status"),
            1,
            "cannot reach the sidecar",
        ),
        Mistake(
            "sidecar unreachable, json", ("--admin", closed, "--timeout", "2", "engines", "--json"), 1, closed
        ),
        Mistake("demo --seconds nan", ("demo", "--seconds", "nan"), 2, "--seconds"),
        Mistake("demo --seconds inf", ("demo", "--seconds", "inf"), 2, "--seconds"),
        Mistake("demo --seconds -1", ("demo", "--seconds", "-1"), 2, "--seconds"),
        Mistake("demo --seconds word", ("demo", "--seconds", "soon"), 2, "--seconds: must be a number"),
        Mistake(
            "negative seed",
            ("sim", "replay", "--scenario", "chat", "--policy", "default", "--seed", "-5"),
            2,
            "--seed: must be an integer 0..4294967295",
        ),
        Mistake("timeout nan", ("--timeout", "nan", "status"), 2, "--timeout: must be a number"),
        Mistake("autoscale duration nan", ("sim", "autoscale", "--duration", "nan"), 2, "--duration"),
        Mistake(
            "autoscale requests below 8 a slot",
            ("sim", "autoscale", "--requests", "255"),
            2,
            "--requests 255: at least 8 per slot, 256 at --concurrency 32",
        ),
        Mistake(
            "autoscale requests zero",
            ("sim", "autoscale", "--requests", "0"),
            2,
            "--requests: must be an integer",
        ),
        Mistake("sidecar config is binary", ("serve", "--config", "FILE"), 2, "FILE"),
        Mistake("config validate binary", ("config", "validate", "FILE"), 2, "FILE"),
        Mistake(
            "config reference unwritable",
            ("config", "reference", "--out", "/nonexistent/c.md"),
            2,
            "/nonexistent/c.md",
        ),
        # a bare errno with exit 1 once the sidecar had started
        Mistake(
            "serve --record-steps in a missing directory",
            ("serve", "--record-steps", "/nonexistent/s.jsonl"),
            2,
            "--record-steps /nonexistent/s.jsonl: no directory /nonexistent to write it in",
        ),
        Mistake(
            "serve --record-steps under a file",
            ("serve", "--record-steps", "FILE/s.jsonl"),
            2,
            "--record-steps FILE/s.jsonl: no directory FILE to write it in",
        ),
        # the format is the extension: x.xyz failed after the run, x became x.png
        Mistake(
            "demo --plot x.xyz",
            ("demo", "--seconds", "1", "--plot", "x.xyz"),
            2,
            "--plot x.xyz: must name a .png file",
        ),
        Mistake("trace validate binary", ("trace", "validate", "FILE"), 2, "FILE"),
        Mistake(
            "replay a binary trace", ("sim", "replay", "--trace", "FILE", "--policy", "default"), 2, "FILE"
        ),
        Mistake(
            "replay an unknown scenario",
            ("sim", "replay", "--scenario", "nope", "--policy", "default"),
            2,
            "nope",
        ),
        Mistake(
            "replay an unknown policy", ("sim", "replay", "--scenario", "chat", "--policy", "nope"), 2, "nope"
        ),
        Mistake(
            "bad concurrency",
            ("sim", "compare", "--scenario", "chat", "--concurrency", "0"),
            2,
            "--concurrency",
        ),
        # exit 1 after the work; '' and / were ValueError tracebacks
        Mistake(
            "trace generate unwritable",
            ("trace", "generate", "--scenario", "chat", "--requests", "3", "--out", "/nonexistent/t.jsonl"),
            2,
            "--out /nonexistent/t.jsonl: no directory /nonexistent to write it in",
        ),
        Mistake(
            "trace generate --out ''",
            ("trace", "generate", "--scenario", "chat", "--requests", "3", "--out", ""),
            2,
            "--out '': not a file name",
        ),
        Mistake(
            "trace import --out /", ("trace", "import", "FILE", "--out", "/"), 2, "--out /: is a directory"
        ),
        Mistake(
            "replay --json ''",
            ("sim", "replay", "--scenario", "chat", "--policy", "default", "--json", ""),
            2,
            "--json '': not a file name",
        ),
        Mistake(
            "profile fit --plot p.xyz",
            ("profile", "fit", "FILE", "--out", "/tmp/never-written.jsonl", "--plot", "p.xyz"),
            2,
            "--plot p.xyz: must name a .png file",
        ),
        Mistake(
            "trace import binary", ("trace", "import", "FILE", "--out", "/tmp/never-written.jsonl"), 2, "FILE"
        ),
        Mistake("autoscale unknown engine", ("sim", "autoscale", "--engine", "nope"), 2, "nope"),
        Mistake(
            "tune without a grid", ("sim", "tune", "--policy", "default", "--scenario", "chat"), 2, "--param"
        ),
        Mistake(
            "observe a non-http URL",
            ("observe", "--metrics-url", "ftp://x/metrics", "--sidecar", closed, "--engine-id", "e"),
            2,
            "metrics-url",
        ),
        Mistake(
            "observe: /metrics unreachable",
            (
                "observe",
                "--metrics-url",
                f"http://127.0.0.1:{_closed_port()}/metrics",
                "--sidecar",
                closed,
                "--engine-id",
                "e",
                "--retries",
                "1",
                "--interval",
                "0.1",
            ),
            1,
            "gave up after 2 attempts",
        ),
    ]


MISTAKES = _mistakes()


@pytest.mark.parametrize("command", [("serve", "--config"), ("config", "validate")])
@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("state_dir: FILE", "state_dir: FILE exists and is not a directory"),
        ("engine_listen: unix://FILE/e.sock", "engine_listen: FILE exists and is not a directory"),
        ("admin_token_file: DIR", "admin_token_file: DIR: is a directory, not a regular file"),
        (
            "admin_tls_cert_file: FILE\nadmin_tls_key_file: FILE",
            "admin_tls_cert_file: FILE: not a PEM certificate",
        ),
    ],
)
def test_serve_and_config_validate_read_the_files_a_config_names_alike(
    command: tuple[str, ...], setting: str, says: str, tmp_path: Path
) -> None:
    # config validate said OK to what serve then refused with a bare errno (exit 1, no key, or
    # "Failed to bind" for a file that is not a certificate)
    scratch = tmp_path / "input.bin"
    scratch.write_bytes(BINARY)
    cfg = tmp_path / "c.yaml"
    body = setting.replace("FILE", str(scratch)).replace("DIR", str(tmp_path))
    state = "" if setting.startswith("state_dir") else f"state_dir: {tmp_path}/state\n"
    cfg.write_text(f"admin_listen: 127.0.0.1:0\nmetrics_listen: ''\n{state}{body}\n")
    out = ctl(*command, str(cfg), timeout=60)
    no_traceback(out)
    assert out.returncode == 2, out.stderr[-2000:]
    want = f"{cfg}: " + says.replace("FILE", str(scratch)).replace("DIR", str(tmp_path))
    assert want in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "state").exists()  # nothing was started or made


@pytest.mark.parametrize("m", MISTAKES, ids=[m.name for m in MISTAKES])
def test_mistake(m: Mistake, tmp_path: Path) -> None:
    scratch = tmp_path / "input.bin"
    scratch.write_bytes(BINARY)
    out = ctl(*(a.replace("FILE", str(scratch)) for a in m.argv))
    no_traceback(out)
    assert out.returncode == m.code, (out.returncode, out.stderr[-2000:])
    assert m.says.replace("FILE", str(scratch)) in out.stderr, out.stderr[-2000:]
    assert not Path("/tmp/never-written.jsonl").exists()


@pytest.mark.parametrize(
    "argv",
    [("sim", "compare", "--trace", "FILE"), ("sim", "replay", "--policy", "default", "--trace", "FILE"),
     ("policy", "validate", "FILE"), ("trace", "validate", "FILE")],
    ids=["sim compare", "sim replay", "policy validate", "trace validate"],
)  # fmt: skip
@pytest.mark.parametrize("exists", [True, False], ids=["bad", "missing"])
def test_a_file_name_with_a_newline_is_named_whole(
    tmp_path: Path, argv: tuple[str, ...], exists: bool
) -> None:
    # Messages were cut at the first line break: "error: /tmp/.../bad" and nothing else.
    bad = tmp_path / "bad\nname.jsonl"
    if exists:
        bad.write_text("garbage\n")
    out = ctl(*(a.replace("FILE", str(bad)) for a in argv))
    no_traceback(out)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()  # one per error (trace validate lists every error it found)
    assert lines and all(f"{tmp_path}/bad\\nname.jsonl" in line for line in lines), out.stderr


def test_version() -> None:
    out = ctl("--version")
    assert out.returncode == 0 and out.stdout.startswith("controllerctl 0.")


def test_a_closed_pipe_is_quiet() -> None:
    # The reader is gone before controllerctl writes (`controllerctl ... | head -0`).
    p = subprocess.Popen(
        [CTL, "config", "reference"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_compare_checks_for_matplotlib_before_the_run(tmp_path: Path) -> None:
    fake = tmp_path / "nompl" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.monotonic()
    out = ctl("sim", "compare", "--scenario", "chat", "--out", str(tmp_path / "report"), env=env)
    no_traceback(out)
    assert out.returncode == 2 and "matplotlib" in out.stderr and "--json" in out.stderr
    assert not (tmp_path / "report").exists()
    # Nothing ran: no progress, no result (the check comes before the replay, not after it).
    assert out.stdout == "" and time.monotonic() - t0 < 120


def test_tune_writes_integers_as_integers_under_a_new_name(tmp_path: Path) -> None:
    dest = tmp_path / "tuned.yaml"
    out = ctl(
        "sim", "tune", "--policy", "default", "--scenario", "chat", "--requests", "12",
        "--concurrency", "1", "--param", "rule.min_run=2,3", "--out", str(dest), timeout=300,
    )  # fmt: skip
    no_traceback(out)
    assert out.returncode == 0, out.stderr[-2000:]
    text = dest.read_text()
    doc = yaml.safe_load(text)
    assert doc["metadata"]["name"] == "default-tuned"
    assert "rule.min_run=" in doc["metadata"]["description"]
    assert isinstance(doc["spec"]["rule"]["params"]["min_run"], int)
    assert isinstance(doc["spec"]["algorithm"]["params"]["memory_steps"], int)
    assert not any(line.rstrip().endswith(".0") for line in text.splitlines()), text
    assert ctl("policy", "validate", str(dest)).returncode == 0


# -- against a running sidecar ---------------------------------------------------------------------


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[str]:
    with serve_process(tmp_path) as endpoints:
        yield endpoints["admin"]


def test_policy_get_for_an_engine_that_never_attached_says_so(sidecar: str) -> None:
    """A mistyped id printed the default policy, exit 0, as if that engine were following it."""
    out = ctl("--admin", sidecar, "policy", "get", "--engine", "pod-typo")
    no_traceback(out)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == (
        f"note: no engine 'pod-typo' has attached to the sidecar at {sidecar} (see controllerctl engines); "
        "this is the default policy, which it would follow"
    ), out.stderr
    assert out.stdout.startswith("# ") and "for default" in out.stdout.splitlines()[0], out.stdout
    plain = ctl("--admin", sidecar, "policy", "get")
    assert plain.returncode == 0 and plain.stderr == "", plain.stderr


def test_policy_set_refuses_an_unknown_engine(sidecar: str) -> None:
    out = ctl("--admin", sidecar, "policy", "set", "static-off", "--engine", "pod-typo")
    no_traceback(out)
    assert out.returncode == 2 and "no engine 'pod-typo' has attached" in out.stderr, out.stderr
    # Nothing changed: the engine has no policy of its own.
    listed = json.loads(ctl("--admin", sidecar, "policy", "list", "--json").stdout)
    assert [p for p in listed["active"] if p["engine_id"]] == []


def test_json_numbers_are_numbers(sidecar: str) -> None:
    doc = json.loads(ctl("--admin", sidecar, "policy", "get", "--json").stdout)
    assert isinstance(doc["revision"], int) and doc["revision"] >= 1
    status = json.loads(ctl("--admin", sidecar, "status", "--json").stdout)
    assert isinstance(status["uptime_s"], int | float) and isinstance(status["policy"]["revision"], int)


def test_serve_names_the_port_that_is_taken(tmp_path: Path, sidecar: str) -> None:
    cfg = tmp_path / "second.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'second'}\nadmin_listen: {sidecar}\nmetrics_listen: ''\n")
    out = ctl("serve", "--config", str(cfg), timeout=60)
    no_traceback(out)
    assert out.returncode == 1
    assert f"admin_listen {sidecar} is taken" in out.stderr, out.stderr
    # One line: gRPC's own "E... add_port.cc:83] Failed to add port to server: ..." came first.
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


# -- Ctrl-C ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("presses", [1, 2])
def test_demo_stops_on_ctrl_c(presses: int, tmp_path: Path) -> None:
    # Its state directory goes in tmp_path: a second press ends the process before it is removed
    # (each run of the suite left one in /tmp).
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    p = subprocess.Popen(
        [CTL, "demo", "--seconds", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert p.stdout is not None
    try:
        for _ in range(200):  # the demo is running once it prints its live lines (bounded)
            line = p.stdout.readline()
            if "t=" in line or not line:
                break
        for _ in range(presses):
            p.send_signal(signal.SIGINT)
            time.sleep(0.2)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    # 130 (handled), or killed by the second SIGINT itself (the default action once interrupted).
    assert p.returncode in (130, -signal.SIGINT), (p.returncode, err[-2000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    if presses == 1:  # the clean-up ran: the demo's temporary state directory is gone
        assert list(tmp_path.iterdir()) == []
