"""The vLLM plugin's cost per engine step, at batch 8 and 32, composite drafter and fast loop on.

Runs with the vLLM virtualenv's Python, in one process: the same tiny EAGLE-3 engine (K max 4) first
without the plugin, then with it attached to a real sidecar running the default policy (its n-gram
span rule on). The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the plugin's own hook
time can be measured directly, besides the end-to-end step time of both engines.

    .venv-vllm/bin/python benchmarks/plugin_overhead.py [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

for k, v in {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(k, v)


def _engine(model: Path, head: Path) -> Any:
    from vllm import LLM

    llm = LLM(
        model=str(model),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        enforce_eager=True,
        seed=0,
        speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 4},
    )
    return llm


def _run(llm: Any, batch: int, tokens: int, timed: dict[str, float]) -> dict[str, float]:
    from vllm import SamplingParams

    sched: Any = llm.llm_engine.engine_core.engine_core.scheduler
    steps = [0]
    orig = sched.update_from_output

    def counted(*a: Any, **kw: Any) -> Any:
        steps[0] += 1
        return orig(*a, **kw)

    sched.update_from_output = counted
    prompts = [f"{i} alpha beta gamma delta alpha beta gamma delta" for i in range(batch)]
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    for key in timed:
        timed[key] = 0.0
    steps[0] = 0
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = steps[0]
    out = {
        "steps": n,
        "step_us": wall / n * 1e6,
        "plugin_us": sum(timed.values()) / n * 1e6 if timed else 0.0,
    }
    sched.update_from_output = orig
    hooks = getattr(sched, "_speccontrol", None)
    if hooks is not None:
        out["link_dropped"] = hooks.link.stats().dropped_steps
    return out


def _time_hooks(timed: dict[str, float]) -> None:
    from controller.vllm.engine_hooks import EngineHooks

    for name in ("before_schedule", "after_schedule", "before_update", "after_update", "choose_drafts"):
        timed[name] = 0.0
        orig = getattr(EngineHooks, name)

        def wrapped(self: Any, *a: Any, _o: Any = orig, _n: str = name, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return _o(self, *a, **kw)
            finally:
                timed[_n] += time.perf_counter() - t

        setattr(EngineHooks, name, wrapped)


def _child(tmp: Path, mode: str, batches: list[int], tokens: int) -> None:
    timed: dict[str, float] = {}
    if mode == "with":
        from controller.vllm.plugin import register

        register()
        _time_hooks(timed)
    llm = _engine(tmp / "model" / "target", tmp / "model" / "eagle3")
    res = {b: _run(llm, b, tokens, timed) for b in batches}
    (tmp / f"{mode}.json").write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--child", choices=("with", "without"))
    ap.add_argument("--tmp")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        _child(Path(args.tmp), args.child, batches, args.tokens)
        return
    tmp = Path(tempfile.mkdtemp(prefix="plugin-bench-"))
    from tests.e2e.tiny_model import build

    build(tmp / "model")
    child = [
        sys.executable,
        __file__,
        "--tmp",
        str(tmp),
        "--tokens",
        str(args.tokens),
        "--batches",
        args.batches,
    ]
    env = {k: v for k, v in os.environ.items() if k != "SPECCONTROL_PLUGIN"}
    subprocess.run([*child, "--child", "without"], env=env, check=True)

    cfg = tmp / "sidecar.yaml"
    cfg.write_text(
        f"engine_listen: unix://{tmp}/e.sock\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\n"
        f"state_dir: {tmp}/state\ndefault_policy: default\n"
    )
    sidecar = subprocess.Popen([sys.executable, "-m", "controller.serve", "--config", str(cfg)], cwd=ROOT)
    try:
        while not (tmp / "state" / "endpoints.json").exists():
            time.sleep(0.1)
        env.update({"SPECCONTROL_PLUGIN": "1", "SPECCONTROL_SIDECAR": f"unix://{tmp}/e.sock"})
        subprocess.run([*child, "--child", "with"], env=env, check=True)
    finally:
        sidecar.terminate()
        sidecar.wait(10)
    results = {
        m: {int(b): r for b, r in json.loads((tmp / f"{m}.json").read_text()).items()}
        for m in ("without", "with")
    }
    print(json.dumps(results, indent=1))
    print(
        f"\n{'batch':>5}  {'steps':>6}  {'step µs (no plugin)':>20}  {'step µs (plugin)':>17}  {'plugin hooks µs/step':>21}"
    )
    for b in batches:
        w, p = results["without"][b], results["with"][b]
        print(
            f"{b:>5}  {p['steps']:>6.0f}  {w['step_us']:>20.0f}  {p['step_us']:>17.0f}  {p['plugin_us']:>21.1f}"
        )


if __name__ == "__main__":
    main()
