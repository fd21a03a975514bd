"""Hostile arguments to ``controllerctl demo`` and ``sim autoscale|tune|replay`` (a subprocess).

Each case failed the CLI contract before it was fixed: a usage error is ONE line on stderr naming the
flag, exit 2, before any work and with nothing written; sizes beyond what the machine can hold or
finish are refused up front rather than killed for memory or left running for days.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CTL = str(Path(sys.executable).parent / "controllerctl")
#: A directory that exists but where no file can be made, even by root (a permission bit cannot say).
UNWRITABLE = "/proc"


def ctl(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CTL, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False)


def one_line_error(out: subprocess.CompletedProcess[str], says: str, code: int = 2) -> None:
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == code, (out.returncode, out.stderr[-2000:])
    assert out.stderr.count("\n") == 1, out.stderr
    assert says in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("demo", "--seconds", "1e308"), "controllerctl demo: error: argument --seconds: must be a number"),
        (("sim", "autoscale", "--concurrency", "1e3"), "argument --concurrency: must be an integer 1..4096"),
        (("sim", "tune", "--policy", "default", "--jobs", "0"), "argument --jobs: must be an integer"),
        (("sim", "replay", "--trace", "a", "--scenario", "b", "--policy", "x"), "not allowed with"),
        ((), "the following arguments are required: COMMAND"),
    ],
)
def test_a_bad_flag_is_one_line_not_the_usage_block(argv: tuple[str, ...], says: str) -> None:
    # argparse printed its usage first: up to 13 lines, the one naming the flag last.
    one_line_error(ctl(*argv), says)


@pytest.mark.parametrize(
    "argv",
    [
        ("demo", "--seconds", "30", "--plot", f"{UNWRITABLE}/goodput.png"),
        ("sim", "autoscale", "--out", f"{UNWRITABLE}/report"),
        ("sim", "autoscale", "--json", f"{UNWRITABLE}/a.json"),
        ("sim", "tune", "--policy", "default", "--scenario", "chat", "--param", "explore=0,0.1",
         "--out", f"{UNWRITABLE}/t.yaml"),
        ("sim", "replay", "--scenario", "chat", "--policy", "default", "--json", f"{UNWRITABLE}/r.json"),
        ("config", "reference", "--out", f"{UNWRITABLE}/c.md"),
    ],
    ids=["demo --plot", "autoscale --out", "autoscale --json", "tune --out", "replay --json", "config --out"],
)  # fmt: skip
def test_an_output_where_no_file_can_be_made_is_refused_before_the_run(argv: tuple[str, ...]) -> None:
    # The directory exists, so the check passed; the run went its full length, then exit 1.
    out = ctl(*argv, timeout=60)
    one_line_error(out, f"cannot write in {UNWRITABLE}")
    assert out.stdout == ""


@pytest.mark.parametrize("json_name", ["SAME", "SAME/autoscale.json", "SAME/autoscale.md"])
def test_autoscale_refuses_json_where_out_writes(tmp_path: Path, json_name: str) -> None:
    # --json d --out d wrote the file d, then failed on mkdir d (exit 1, the JSON left behind);
    # --json d/autoscale.json was overwritten by --out's own.
    out_dir = tmp_path / "report"
    if json_name != "SAME":
        out_dir.mkdir()
    json_path = json_name.replace("SAME", str(out_dir))
    out = ctl("sim", "autoscale", "--duration", "20", "--triple-at", "10", "--out", str(out_dir),
              "--json", json_path)  # fmt: skip
    one_line_error(out, f"--json {json_path}: --out {out_dir}")
    assert not out_dir.exists() or not list(out_dir.iterdir())


@pytest.mark.parametrize("command", ["autoscale", "tune", "replay"])
@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--policy", "", "--policy '': not a policy file"), ("--profile", "nope", "--profile: unknown profile")],
)
def test_policy_and_profile_errors_name_their_flag(command: str, flag: str, value: str, says: str) -> None:
    # --policy '' said ": not a regular file" (the path '.'), --profile nope "unknown profile 'nope'".
    argv = {
        "autoscale": ["sim", "autoscale"],
        "tune": ["sim", "tune", "--scenario", "chat", "--param", "explore=0"],
        "replay": ["sim", "replay", "--scenario", "chat"],
    }[command]
    if flag != "--policy" and command != "autoscale":
        argv += ["--policy", "default"]
    one_line_error(ctl(*argv, flag, value), says)


def test_tune_refuses_a_param_of_no_values(tmp_path: Path) -> None:
    # "explore= ," parsed as no values: "no candidates", exit 0; with --out an IndexError traceback.
    out = ctl("sim", "tune", "--policy", "default", "--scenario", "chat", "--requests", "5",
              "--concurrency", "1", "--param", "explore= , ", "--out", str(tmp_path / "t.yaml"))  # fmt: skip
    one_line_error(out, "--param 'explore= , ': no values")
    assert not list(tmp_path.iterdir())


def test_tune_names_an_algorithm_parameter_as_it_names_a_rule_one() -> None:
    out = ctl("sim", "tune", "--policy", "default", "--scenario", "chat", "--requests", "5",
              "--param", "explore=nan")  # fmt: skip
    one_line_error(out, "--param explore: must be finite, got nan")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # a million generated requests was killed for memory (about 30 kB each)
        (("sim", "replay", "--scenario", "chat", "--policy", "default", "--requests", "1000000"),
         "argument --requests: must be an integer 1..100000"),
        (("trace", "generate", "--scenario", "chat", "--requests", "1000000", "--out", "OUT/t.jsonl"),
         "argument --requests: must be an integer 1..100000"),
        (("sim", "tune", "--policy", "default", "--scenario", "chat,code", "--requests", "60000",
          "--param", "explore=0"), "--requests: 120000 requests over 2 scenarios; at most 100000"),
        # every level replays the whole trace
        (("sim", "replay", "--scenario", "chat", "--policy", "default", "--concurrency",
          ",".join(str(c) for c in range(1, 101))), "--concurrency: 100 levels; at most 64"),
        # 10000 grid points x 64 levels ran for days
        (("sim", "tune", "--policy", "default", "--scenario", "chat", "--concurrency",
          ",".join(str(c) for c in range(1, 65)), "--param", "explore=" + ",".join(str(i / 100) for i in range(100)),
          "--param", "rule.min_run=1,2,3,4,5,6,7,8"), "output tokens; at most 2e+09 per sweep"),
    ],
    ids=["replay --requests 1e6", "trace generate --requests 1e6", "tune requests in all", "levels", "budget"],
)  # fmt: skip
def test_sizes_beyond_the_machine_are_refused_up_front(
    tmp_path: Path, argv: tuple[str, ...], says: str
) -> None:
    out = ctl(*(a.replace("OUT", str(tmp_path)) for a in argv), timeout=60)
    one_line_error(out, says)
    assert not list(tmp_path.iterdir())


def test_autoscale_writes_its_report_whole(tmp_path: Path) -> None:
    # Directories --out makes (with their parents) hold the three files, and --json its own copy.
    out_dir = tmp_path / "a" / "b"
    out = ctl("sim", "autoscale", "--duration", "20", "--triple-at", "10", "--requests", "256", "--out",
              str(out_dir), "--json", str(tmp_path / "a.json"), cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == ["autoscale.json", "autoscale.md", "autoscale.png"]
    assert (out_dir / "autoscale.json").read_bytes() == (tmp_path / "a.json").read_bytes()
    assert "Generated by `controllerctl sim autoscale --duration 20" in (out_dir / "autoscale.md").read_text()
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".speccontrol-probe-")]


@pytest.mark.parametrize(
    "argv",
    [("sim", "tune", "--policy", "default", "--scenario", "chat", "--requests", "5", "--concurrency", "1",
      "--param", "explore=0", "--jobs", "1"),
     ("sim", "replay", "--scenario", "chat", "--requests", "5", "--concurrency", "1", "--policy", "default"),
     ("sim", "autoscale", "--duration", "20", "--triple-at", "10", "--requests", "256")],
    ids=["tune", "replay", "autoscale"],
)  # fmt: skip
def test_no_progress_in_a_stderr_that_is_a_file(tmp_path: Path, argv: tuple[str, ...]) -> None:
    with open(tmp_path / "err", "w") as err:
        p = subprocess.run([CTL, *argv], stdout=subprocess.PIPE, stderr=err, cwd=tmp_path, check=False,
                           timeout=120, text=True)  # fmt: skip
    assert p.returncode == 0
    assert (tmp_path / "err").read_text() == ""
