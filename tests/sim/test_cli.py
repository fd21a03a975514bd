from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.cli import main
from tests.sim.conftest import HEADER, write_lines

KEYS = {
    "throughput_tok_s",
    "speedup_vs_no_spec",
    "acceptance_rate",
    "mean_accepted_per_step",
    "tpot_ms",
    "ttft_ms",
    "e2e_ms",
    "cost_usd_per_1m_output_tokens",
    "switches",
    "switches_per_1k_steps",
    "oracle",
}


def test_trace_validate_ok(hand_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "validate", str(hand_trace)]) == 0
    assert capsys.readouterr().out == f"{hand_trace}: ok\n"


def test_trace_validate_reports_file_line_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write_lines(
        tmp_path / "bad.jsonl",
        HEADER,
        {"id": "a", "output_tokens": 2, "acc": {"eagle3": [1, 0], "ngram": [0, "x"]}},
    )
    assert main(["trace", "validate", str(p)]) == 2
    err = capsys.readouterr().err
    assert err == f"{p}:2: acc.ngram[1]: must be an integer 0..2147483647, got 'x'\n"


def test_replay_writes_the_result_json(hand_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "sim",
                "replay",
                "--trace",
                str(hand_trace),
                "--policy",
                "default",
                "--concurrency",
                "1,2",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert {"policy", "profile", "trace", "concurrency"} <= set(data)
    assert (data["policy"], data["profile"], data["trace"]) == ("default", "llama-3.1-8b-h100", "hand")
    assert set(data["concurrency"]) == {"1", "2"}
    for block in data["concurrency"].values():
        assert set(block) >= KEYS
        assert set(block["tpot_ms"]) == {"p50", "p99"}
        assert {"throughput_tok_s", "ratio"} <= set(block["oracle"])
        assert block["oracle"]["ratio"] <= 1.0


def test_compare_writes_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    rc = main(
        [
            "sim",
            "compare",
            "--scenario",
            "code-edit",
            "--requests",
            "6",
            "--concurrency",
            "1,4",
            "--policy",
            "default",
            "--policy",
            "static:eagle3:3",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    md = (out / "report.md").read_text()
    assert "## Concurrency 4" in md and "default @ composite" in md and "default @ stock-vllm" in md
    assert "does not fit" in md
    for png in ("arms_over_time.png", "throughput_vs_concurrency.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "result.json").read_text())
    labels = {(r["policy"], r["engine"]) for r in data["runs"]}
    assert ("default", "composite") in labels and ("static-eagle3-3", "stock-vllm") in labels


@pytest.mark.filterwarnings("error")
def test_compare_at_one_concurrency_draws_no_empty_curve(tmp_path: Path) -> None:
    """A curve over concurrency needs two levels: with one, that plot is left out (matplotlib would
    warn about an empty legend and write a blank figure), and the report names only what was drawn."""
    out = tmp_path / "rep"
    args = [
        "sim",
        "compare",
        "--scenario",
        "chat",
        "--requests",
        "4",
        "--concurrency",
        "2",
        "--out",
        str(out),
    ]
    assert main([*args, "--policy", "static:eagle3:3", "--no-oracle", "--no-progress"]) == 0
    assert not (out / "throughput_vs_concurrency.png").exists()
    md = (out / "report.md").read_text()
    assert "throughput_vs_concurrency" not in md and "arms_over_time.png" in md


def test_a_report_rewritten_in_place_leaves_no_plot_of_the_earlier_run(tmp_path: Path) -> None:
    """Rerun into the same --out at one concurrency level: the earlier run's curve over concurrency
    used to stay beside the new report.md, which no longer names it (found replaying a recorded trace
    at 1,8,32, then at 1)."""
    out = tmp_path / "rep"
    args = ["sim", "compare", "--scenario", "chat", "--requests", "4", "--policy", "static:eagle3:3"]
    tail = ["--no-oracle", "--no-progress", "--out", str(out)]
    assert main([*args, "--concurrency", "1,2", *tail]) == 0
    assert (out / "throughput_vs_concurrency.png").is_file()
    (out / "mine.png").write_bytes(b"kept")
    assert main([*args, "--concurrency", "2", *tail]) == 0
    assert not (out / "throughput_vs_concurrency.png").exists()
    names = {p.name for p in out.iterdir()}
    assert {"latency_cdf.png", "mine.png", "report.md", "result.json"} <= names  # not its own: kept


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["sim", "replay", "--scenario", "nope", "--policy", "default"],
            "--scenario: unknown scenario 'nope'",
        ),
        (["sim", "replay", "--scenario", "chat", "--policy", "nope"], "nope"),
        (
            ["sim", "replay", "--scenario", "chat", "--policy", "default", "--concurrency", "0"],
            "--concurrency",
        ),
        (
            ["sim", "replay", "--scenario", "chat", "--policy", "default", "--profile", "nope"],
            "unknown profile",
        ),
        (["sim", "replay", "--scenario", "chat", "--policy", "default", "--open-loop"], "arrival_s"),
        (["sim", "replay", "--scenario", "chat", "--policy", "default", "--engine", "vllm9"], "--engine"),
    ],
)
def test_bad_input_is_one_line_and_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    out = tmp_path / "never.json"
    assert main([*argv, "--json", str(out)]) != 0
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_bad_trace_on_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write_lines(tmp_path / "t.jsonl", HEADER, '{"id": 3}')
    assert main(["sim", "replay", "--trace", str(p), "--policy", "default"]) == 2
    assert capsys.readouterr().err.startswith(f"{p}:2: id: ")


def test_trace_generate_round_trips(tmp_path: Path) -> None:
    p = tmp_path / "g.jsonl.gz"
    assert main(["trace", "generate", "--scenario", "load-ramp", "--requests", "5", "--out", str(p)]) == 0
    assert main(["trace", "validate", str(p)]) == 0


def test_registers_into_controllerctl(hand_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from controller.cli import main as ctl

    assert ctl(["trace", "validate", str(hand_trace)]) == 0
    assert "ok" in capsys.readouterr().out


def test_static_k_is_capped_at_the_trace_max_k(hand_trace: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    common = [
        "sim",
        "replay",
        "--trace",
        str(hand_trace),
        "--concurrency",
        "1",
        "--no-oracle",
        "--no-progress",
    ]
    assert main([*common, "--policy", "static:eagle3:8", "--json", str(a)]) == 0
    assert main([*common, "--policy", "static:eagle3:4", "--json", str(b)]) == 0
    ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ja["concurrency"]["1"]["throughput_tok_s"] == jb["concurrency"]["1"]["throughput_tok_s"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["sim", "replay", "--policy", "default", "--requests", "0"],
            "--requests: must be an integer 1..100000",
        ),
        (["sim", "compare", "--seed", "-1"], "--seed: must be an integer 0..4294967295, got '-1'"),
        (["trace", "generate", "--seed", "2**32"], "--seed: must be an integer 0..4294967295"),
        (
            ["profile", "fit", "s.jsonl", "--out", "p.yaml", "--level", "1"],
            "--level: must be a number in [0.5, 1)",
        ),
    ],
)
def test_out_of_range_flags_exit_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--scenario", "chat"] if argv[0] == "sim" else argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            [],
            "--engine: engine 'composite' drafts with ngram, which trace 'e3' lacks (it has: eagle3); "
            "engines that can replay it: stock-vllm, per-request-k",
        ),
        (
            ["--policy", "static:ngram:3"],
            "--policy static:ngram:3: trace 'e3' has no ngram acceptance (it has: eagle3)",
        ),
    ],
)
def test_a_method_the_trace_lacks_is_a_usage_error_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    # It stopped the replay at its first step needing the method, exiting 1 (a runtime error).
    p = write_lines(
        tmp_path / "e3.jsonl",
        {"spectrace": 1, "max_k": 4, "methods": ["eagle3"]},
        {"id": "a", "output_tokens": 3, "acc": {"eagle3": [2, 1, 0]}},
    )
    out = tmp_path / "never.json"
    argv = ["sim", "replay", "--trace", str(p), "--concurrency", "1", "--json", str(out), "--no-progress"]
    assert main([*argv, *(extra or ["--policy", "default"])]) == 2
    assert capsys.readouterr().err == says + "\n"
    assert not out.exists()
    assert main([*argv, "--policy", "default", "--engine", "stock-vllm"]) == 0  # an engine it can score


@pytest.mark.parametrize("verb", ["replay", "compare"])
def test_a_json_file_with_no_directory_is_refused_before_the_run(
    verb: str, hand_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It was found after the whole run, and exited 1.
    out = tmp_path / "no" / "r.json"
    argv = [
        "sim",
        verb,
        "--trace",
        str(hand_trace),
        "--policy",
        "default",
        "--json",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 2
    assert capsys.readouterr() == ("", f"--json {out}: no directory {out.parent} to write it in\n")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # ValueError tracebacks ("PosixPath('.') has an empty name")
        (
            ["trace", "generate", "--scenario", "chat", "--requests", "2", "--out", ""],
            "--out '': not a file name",
        ),
        (["trace", "import", "TRACE", "--out", "/"], "--out /: is a directory, not a file"),
        (["trace", "import", "--tokens", "TRACE", "--out", ""], "--out '': not a file name"),
        # exit 1 after the work
        (
            ["trace", "generate", "--scenario", "chat", "--requests", "2", "--out", "DIR/no/t.jsonl"],
            "--out DIR/no/t.jsonl: no directory DIR/no to write it in",
        ),
        # silently ignored: the result went to stdout
        (
            ["sim", "replay", "--trace", "TRACE", "--policy", "default", "--json", ""],
            "--json '': not a file name",
        ),
        (
            ["sim", "replay", "--trace", "TRACE", "--policy", "default", "--out", ""],
            "--out '': not a directory",
        ),
        # found after the run (exit 1)
        (
            ["sim", "replay", "--trace", "TRACE", "--policy", "default", "--json", "DIR"],
            "--json DIR: is a directory",
        ),
        (
            ["sim", "replay", "--trace", "TRACE", "--policy", "default", "--out", "TRACE"],
            "is a file, not a directory",
        ),
        (
            [
                "sim",
                "tune",
                "--policy",
                "default",
                "--param",
                "explore=0,0.3",
                "--trace",
                "TRACE",
                "--out",
                "DIR",
            ],
            "--out DIR: is a directory, not a file",
        ),
        (
            [
                "sim",
                "autoscale",
                "--duration",
                "60",
                "--triple-at",
                "10",
                "--json",
                "DIR/a.json",
                "--out",
                "TRACE",
            ],
            "--out TRACE: is a file, not a directory",
        ),
        # a traceback after the fit, with the profile written; x silently became x.png
        (
            ["profile", "fit", "STEPS", "--out", "DIR/p.yaml", "--plot", "DIR/p.xyz"],
            "--plot DIR/p.xyz: must name a .png",
        ),
        (
            ["profile", "fit", "STEPS", "--out", "DIR/p.yaml", "--plot", "DIR/p"],
            "--plot DIR/p: must name a .png file",
        ),
        (["profile", "fit", "STEPS", "--out", "", "--plot", "DIR/p.png"], "--out '': not a file name"),
        (["profile", "fit", "STEPS", "--out", "DIR/p.yaml", "--plot", "DIR/no/p.png"], "no directory DIR/no"),
    ],
)
def test_outputs_that_cannot_be_written_are_usage_errors_before_any_work(
    hand_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    from sim.steplog import write_steps
    from tests.sim.test_fit import synthetic

    d = tmp_path / "d"
    d.mkdir()
    write_steps(tmp_path / "s.jsonl", synthetic(50, 1))
    sub = {"TRACE": str(hand_trace), "STEPS": str(tmp_path / "s.jsonl"), "DIR": str(d)}
    for k, v in sub.items():
        argv = [a.replace(k, v) for a in argv]
        says = says.replace(k, v)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert not list(d.iterdir())  # nothing written


@pytest.mark.parametrize("same", ["trace", "profile"])
def test_a_sweep_refuses_two_traces_or_profiles_of_one_name(
    hand_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], same: str
) -> None:
    # Their reports went to one directory, TRACE--PROFILE: the second overwrote the first.
    other = tmp_path / "d2" / hand_trace.name
    other.parent.mkdir()
    other.write_bytes(hand_trace.read_bytes())
    argv = [
        "sim",
        "compare",
        "--trace",
        str(hand_trace),
        "--policy",
        "default",
        "--out",
        str(tmp_path / "cmp"),
    ]
    if same == "trace":
        argv += ["--trace", str(other)]
    else:
        argv += ["--profile", "llama-3.1-8b-h100,llama-3.1-8b-h100"]
    assert main(argv) == 2
    named = "hand" if same == "trace" else "llama-3.1-8b-h100"
    assert (
        capsys.readouterr().err
        == f"--{same}: two {same}s named {named!r}: a sweep names its results by them\n"
    )
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("open_loop", [False, True])
def test_load_ramp_in_a_closed_loop_says_its_arrivals_are_ignored(
    capsys: pytest.CaptureFixture[str], open_loop: bool
) -> None:
    # It replayed closed loop without a word, so "load-ramp" ran its requests back to back.
    argv = ["sim", "replay", "--scenario", "load-ramp", "--requests", "40", "--policy", "static:eagle3:3",
            "--concurrency", "4", *(["--open-loop"] if open_loop else [])]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    note = "note: --scenario load-ramp is replayed closed loop, its arrival times ignored (add --open-loop"
    assert (note in err) is not open_loop


@pytest.mark.parametrize("engines", ["stock-vllm", "stock-vllm,composite"])
def test_replay_prints_what_json_writes(
    hand_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], engines: str
) -> None:
    # Without --json/--out, `sim replay` printed the first engine's run only and dropped the others.
    argv = ["sim", "replay", "--trace", str(hand_trace), "--policy", "default", "--engine", engines]
    argv += ["--concurrency", "1", "--no-progress"]
    out = tmp_path / "r.json"
    assert main([*argv, "--json", str(out)]) == 0
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed == out.read_text(encoding="utf-8")
    data = json.loads(printed)
    if "," in engines:
        assert [r["engine"] for r in data["runs"]] == engines.split(",")
    else:
        assert data["engine"] == engines


@pytest.mark.parametrize("verb", ["replay", "compare", "tune"])
def test_seed_help_says_it_replaces_the_policys_seed(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    # --seed seeds the policy too, in place of its own `seed`: the help did not say so.
    with pytest.raises(SystemExit) as e:
        main(["sim", verb, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "seeds the generated traffic (--scenario)" in text
    assert "every policy replayed: it replaces each policy's own `seed`" in text


def test_replay_seeds_the_policy_with_seed_not_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The documented behaviour (docs/simulator.md, Reproducibility): policies differing only in `seed`
    # replay identically; --seed draws the policy (and the traffic) anew.
    from policies.presets import preset_text
    from policies.spec import parse_policy

    text = preset_text("epsilon-greedy")  # seed 0 (the default); the spec is its last section
    assert "seed:" not in text and text.endswith("\n")
    (tmp_path / "s7.yaml").write_text(text + "  seed: 7\n", encoding="utf-8")
    assert parse_policy((tmp_path / "s7.yaml").read_text(encoding="utf-8")).seed == 7
    argv = ["sim", "replay", "--scenario", "mixed", "--requests", "40", "--concurrency", "8", "--no-oracle"]
    argv += ["--no-progress"]
    runs: dict[str, float] = {}
    for name, extra in {
        "0": ["--policy", "epsilon-greedy"],
        "7": ["--policy", str(tmp_path / "s7.yaml")],
        "--seed 7": ["--policy", "epsilon-greedy", "--seed", "7"],
    }.items():
        assert main([*argv, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["concurrency"]["8"]["throughput_tok_s"]
    assert runs["0"] == runs["7"]
    assert runs["--seed 7"] != runs["0"]


@pytest.mark.parametrize("cmd", ["replay", "compare"])
def test_requests_with_a_trace_is_a_usage_error(
    hand_trace: Path, capsys: pytest.CaptureFixture[str], cmd: str
) -> None:
    # --requests sizes a generated scenario; with a trace it was silently ignored.
    argv = ["sim", cmd, "--trace", str(hand_trace), "--requests", "5", "--no-oracle", "--no-progress"]
    assert main([*argv, "--policy", "default"]) == 2
    err = capsys.readouterr().err
    assert "--requests: applies to --scenario" in err and "Traceback" not in err


@pytest.mark.parametrize("profiles", ["llama-3.1-8b-h100", "llama-3.1-8b-h100,llama-3.3-70b-fp8-h200"])
def test_the_result_json_replaces_a_file_whole(hand_trace: Path, tmp_path: Path, profiles: str) -> None:
    # One run or a sweep (several profiles): a reader of the old file sees it whole, never truncated.
    out = tmp_path / "r.json"
    out.write_text('{"old": true}\n')
    argv = ["sim", "compare", "--trace", str(hand_trace), "--policy", "default", "--profile", profiles]
    with out.open() as reader:
        assert main([*argv, "--concurrency", "1", "--no-oracle", "--no-progress", "--json", str(out)]) == 0
        assert reader.read() == '{"old": true}\n'
    assert "old" not in json.loads(out.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([hand_trace.name, "r.json"])
