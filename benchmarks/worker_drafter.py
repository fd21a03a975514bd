"""The worker's two n-gram drafters at serving sizes, without vLLM: what each costs per engine step.

Under async scheduling the plugin's worker merges n-gram drafts into EAGLE's (controller/vllm/worker.py).
``host`` (``DraftMerger``) keeps the histories on the host: on a GPU a step with n-gram rows must read
that step's sampled tokens on the host, which waits for the device. ``device`` (``DeviceDrafter``,
controller/vllm/device_ngram.py, the default on CUDA) queues every step on the device and waits for
nothing, but launches a few dozen small operations on a step with n-gram rows (it counts them). Which
costs less on a GPU is what this measures, with nothing but torch (the device machine's image has it; vLLM is not needed):

    python benchmarks/worker_drafter.py [--device cuda] [--batches 8,32] [--history 2000] [--steps 200]
        [--ngram-share 0.5] [--json FILE]

Both drafters get the same steps: every row samples 1..K+1 tokens from prompts with a repeating phrase
(so n-gram has matches), a share of rows is on n-gram each step, and every 8th step one request is
replaced by a new one. Per batch it prints each drafter's host time per step (the engine thread's, median
over the steps) and, on CUDA, the device drafter's device time per step (CUDA events around its
operations, the queue otherwise idle), as ratios to the host drafter's host time in the same run. The
host drafter's wait is not in its figure: here nothing runs on the device before its read; in an
engine it waits for the step's forward (the simulator charges it as ``scheduling.sync_step_s``).

What must hold (exit 1 otherwise): the two drafters give the same drafts at every step; on CUDA, every
device-drafter step runs under ``torch.cuda.set_sync_debug_mode("error")``, so a step that would make
the host wait for the device raises. Exit 2: a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policies.text import error_text  # noqa: E402
from sim import cli_types  # noqa: E402

K = 4
CHURN = 8  # steps between a request leaving and a new one arriving


def _scenario(
    batch: int, history: int, steps: int, share: float, seed: int
) -> tuple[list[dict[str, Any]], Callable[[str], list[int]]]:
    """The steps both drafters take (ids, sampled rows (-1: rejected), the rows on n-gram, the request
    that finished before the step), and each request's prompt, drawn on first use."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, 32000, 40)
    ids = [f"r{i}" for i in range(batch)]
    fresh, finished = batch, []
    out: list[dict[str, Any]] = []
    for t in range(steps):
        taken = rng.integers(1, K + 2, batch)  # tokens each row keeps this step (1..K+1)
        sampled = np.where(np.arange(K + 1) < taken[:, None], np.resize(phrase, (batch, K + 1)), -1)
        sampled[:, 0] = phrase[t % 40]
        on = {r for r in ids if rng.random() < share}
        out.append({"ids": list(ids), "sampled": sampled.astype(np.int32), "on": on, "finished": finished})
        finished = []
        if t % CHURN == CHURN - 1:  # a request leaves, a new one (with its prompt) takes its row
            gone = int(rng.integers(batch))
            finished = [ids[gone]]
            ids[gone] = f"r{fresh}"
            fresh += 1
    prompts_rng = np.random.default_rng(seed + 1)
    prompts: dict[str, list[int]] = {}

    def known(r: str) -> list[int]:
        if r not in prompts:
            mix = prompts_rng.random(history) < 0.5
            prompts[r] = np.where(
                mix, prompts_rng.integers(0, 32000, history), np.resize(phrase, history)
            ).tolist()
        return prompts[r]

    return out, known


def _run(
    batch: int, history: int, steps: int, share: float, device: str, seed: int, kernels: str
) -> dict[str, Any]:
    plan, known = _scenario(batch, history, steps, share, seed)
    # Room for every history: a prompt plus at most K + 1 tokens a step.
    kw = {"max_k": K, "min_n": 1, "max_n": 3, "max_model_len": history + steps * (K + 1)}
    res = _compare(plan, known, kw, device, kernels)
    res["batch"] = batch
    return res


def _compare(plan: list[dict[str, Any]], known: Callable[[str], list[int]], kw: dict[str, int], device: str,
             kernels: str) -> dict[str, Any]:  # fmt: skip
    """The host drafter and the device one with ``kernels`` through the same steps."""
    import torch

    from controller.vllm.device_ngram import DeviceDrafter
    from controller.vllm.worker import DraftMerger

    batch, steps = len(plan[0]["ids"]), len(plan)
    host, dev = DraftMerger(**kw), DeviceDrafter(**kw, device=device, kernels=kernels)
    cuda = device.startswith("cuda")
    eagle_host = np.full((batch, K), -7, dtype=np.int32)
    eagle_dev = torch.from_numpy(eagle_host).to(device)
    sampled_dev = [torch.from_numpy(s["sampled"]).to(device) for s in plan]  # as the sampler leaves them
    host_s, dev_s, gpu_ms, mismatches = [], [], [], 0
    if cuda:
        torch.cuda.synchronize()
    for i, s in enumerate(plan):
        t0 = time.perf_counter()
        want = host.step(s["ids"], s["sampled"], eagle_host, s["on"], known, finished=s["finished"])
        host_s.append(time.perf_counter() - t0)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.set_sync_debug_mode("error")
            start.record()
        t0 = time.perf_counter()
        got = dev.step(s["ids"], sampled_dev[i], eagle_dev, s["on"], known, finished=s["finished"])
        dev_s.append(time.perf_counter() - t0)
        if cuda:
            end.record()
            torch.cuda.set_sync_debug_mode("default")
            end.synchronize()
            gpu_ms.append(start.elapsed_time(end))
        a = eagle_host if want is None else want
        b = eagle_host if got is None else got.cpu().numpy()
        mismatches += int(not np.array_equal(a, b))
    warm = slice(min(10, steps // 4), None)  # the first steps compile and allocate
    ops = _ops_per_step(plan, known, kw, device, kernels, start=warm.start)
    res: dict[str, Any] = {
        "host_drafter_host_us": round(statistics.median(host_s[warm]) * 1e6, 1),
        "device_drafter_host_us": round(statistics.median(dev_s[warm]) * 1e6, 1),
        "mismatched_steps": mismatches,
        "steps": steps,
        "device_ops_per_step": ops,
    }
    res["device_host_ratio"] = round(
        res["device_drafter_host_us"] / max(res["host_drafter_host_us"], 1e-9), 2
    )
    if gpu_ms:
        res["device_drafter_device_us"] = round(statistics.median(gpu_ms[warm]) * 1e3, 1)
        res["device_device_ratio"] = round(
            res["device_drafter_device_us"] / max(res["host_drafter_host_us"], 1e-9), 2
        )
    return res


#: Operations that only view a tensor (no kernel, no launch), left out of the counts.
_VIEWS = frozenset({"slice", "select", "alias", "view", "_unsafe_view", "detach", "unsqueeze", "expand", "unfold",
                    "as_strided"})  # fmt: skip


def _ops_per_step(plan: list[dict[str, Any]], known: Callable[[str], list[int]], kw: dict[str, int], device: str,
                  kernels: str, start: int) -> dict[str, int]:  # fmt: skip
    """The launches the device drafter queues per step: tensor operations (views left out), counted with
    a torch dispatch mode, plus each Triton kernel launch (what the interpreter does inside one is not
    counted), on a fresh drafter replaying the same steps, every other one with its n-gram rows taken
    away: the median over the steps after ``start``, with and without n-gram rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0
        paused = False

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.n += not self.paused and func.overloadpacket.__name__ not in _VIEWS
            return func(*args, **(kwargs or {}))

    counting: list[Count] = []

    def launch(fn: Callable[..., None]) -> Callable[..., None]:
        def counted(*a: Any, **k: Any) -> None:
            c = counting[-1]
            c.n += 1
            c.paused = True
            try:
                fn(*a, **k)
            finally:
                c.paused = False

        return counted

    if kernels != "triton":
        return _count(plan, known, kw, device, kernels, start, Count, counting)
    from controller.vllm import device_kernels

    originals = device_kernels.append_rows, device_kernels.match_rows
    # DeviceDrafter looks the launches up at each call
    device_kernels.append_rows, device_kernels.match_rows = (launch(f) for f in originals)  # type: ignore[assignment]
    try:
        return _count(plan, known, kw, device, kernels, start, Count, counting)
    finally:
        device_kernels.append_rows, device_kernels.match_rows = originals  # type: ignore[assignment]


def _count(plan: list[dict[str, Any]], known: Callable[[str], list[int]], kw: dict[str, int], device: str,
           kernels: str, start: int, mode: Any, counting: list[Any]) -> dict[str, int]:  # fmt: skip
    import torch

    from controller.vllm.device_ngram import DeviceDrafter

    dev = DeviceDrafter(**kw, device=device, kernels=kernels)
    eagle = torch.full((len(plan[0]["ids"]), int(kw["max_k"])), -7, dtype=torch.int32, device=device)
    counts: dict[str, list[int]] = {"ngram": [], "no_ngram": []}
    for i, s in enumerate(plan):
        on = s["on"] if i % 2 else set()
        sampled = torch.from_numpy(s["sampled"]).to(device)
        with mode() as c:
            counting.append(c)
            dev.step(s["ids"], sampled, eagle, on, known, finished=s["finished"])
        if i >= start:
            counts["ngram" if on else "no_ngram"].append(c.n)
    return {k: int(statistics.median(v)) if v else 0 for k, v in counts.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="the device drafter's device (cuda, cuda:N or cpu)")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--history", type=int, default=2000, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ngram-share", type=float, default=0.5, help="share of rows on n-gram each step")
    ap.add_argument(
        "--kernels",
        choices=("torch", "triton", "both"),
        default="both",
        help="the device drafter's kernels to measure (triton: where it passes its start check)",
    )
    ap.add_argument("--seed", type=cli_types.seed, default=0)
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if (
        not all(1 <= b <= 1024 for b in batches)
        or not 1 <= args.history <= 1 << 20
        or not 4 <= args.steps <= 100_000
    ):
        ap.error("need batches in 1..1024, --history in 1..1048576 and --steps in 4..100000")
    if not 0 <= args.ngram_share <= 1:
        ap.error(f"--ngram-share: 0..1, got {args.ngram_share}")
    from sim.files import output_problem, replace_file

    problem = output_problem("--json", args.json)  # now, not after the run (a traceback then)
    if problem:
        ap.error(problem)
    try:
        import torch
    except ImportError:
        print("worker_drafter: torch is not installed here (vLLM's environment has it)", file=sys.stderr)
        return 1
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        # (a bad name failed inside the first step, reported as the drafter synchronising)
        print(f"worker_drafter: --device: cpu, cuda or cuda:N, got {args.device!r}", file=sys.stderr)
        return 2
    if (
        device.type == "cuda"
        and torch.cuda.is_available()
        and (device.index or 0) >= torch.cuda.device_count()
    ):
        print(
            f"worker_drafter: --device {args.device}: this machine has {torch.cuda.device_count()} CUDA "
            "device(s), numbered from 0",
            file=sys.stderr,
        )
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"worker_drafter: --device {args.device}: no CUDA device here (use --device cpu)", file=sys.stderr
        )
        return 1
    load = os.getloadavg()[0]
    variants = ["torch", "triton"] if args.kernels == "both" else [args.kernels]
    triton_problem = None
    if "triton" in variants:
        from controller.vllm.device_ngram import triton_problem as check

        triton_problem = check(args.device, max_k=K, min_n=1, max_n=3)
        if triton_problem is not None:
            print(f"worker_drafter: the Triton kernels are left out: {triton_problem}", file=sys.stderr)
            if args.kernels == "triton":
                return 1
            variants.remove("triton")
    rows = []
    for b in batches:
        print(f"worker_drafter: batch {b}, {args.steps} steps ...", file=sys.stderr, flush=True)
        row: dict[str, Any] = {}
        for kernels in variants:
            try:
                res = _run(b, args.history, args.steps, args.ngram_share, args.device, args.seed + b, kernels)
            except RuntimeError as e:  # set_sync_debug_mode("error"): a step made the host wait
                print(
                    f"worker_drafter: batch {b}: the device drafter ({kernels}) synchronised with the device: {e}",
                    file=sys.stderr,
                )
                return 1
            res["kernels"] = kernels
            if row:  # the Triton kernels beside the torch path's figures
                row["triton"] = {
                    k: v for k, v in res.items() if k not in ("batch", "host_drafter_host_us", "steps")
                }
            else:
                row = res
        rows.append(row)
    dev_col = "device µs (/host)" if args.device.startswith("cuda") else ""
    print(
        f"{'batch':>5} {'host drafter µs':>16} {'device drafter host µs (/host)':>31} {dev_col:>18} mismatched steps"
        "  device ops/step (n-gram rows / none)"
    )
    for row in rows:
        for r in (row, row.get("triton")):
            if r is None:
                continue
            gpu = (f"{r['device_drafter_device_us']:>9.1f} (x{r['device_device_ratio']:.2f})"
                   if "device_drafter_device_us" in r else "")  # fmt: skip
            ops = r["device_ops_per_step"]
            print(f"{row['batch']:>5} {row['host_drafter_host_us']:>16.1f} {r['device_drafter_host_us']:>20.1f} "
                  f"(x{r['device_host_ratio']:.2f}) {gpu:>18} {r['mismatched_steps']:>16}  "
                  f"{ops['ngram']:>16} / {ops['no_ngram']}  {r['kernels']}")  # fmt: skip
    print(f"({args.history}-token prompts, {args.ngram_share:.0%} of rows on n-gram, device {args.device}, "
          f"load average {load:.2f} on {os.cpu_count()} cores; host µs: the step call's wall time on the host, "
          "median over the steps; device µs: CUDA events around the device drafter's step; ratios: to the "
          "host drafter's host time in the same run; the host drafter's wait for the forward is not in it; "
          "device ops: launches the device drafter queues per step (tensor operations, views left out, and "
          "Triton kernels), the same steps replayed with every other one's n-gram rows taken away; last column: "
          "the device drafter's kernels)")  # fmt: skip
    if "triton" in variants and not args.device.startswith("cuda"):
        print("(Triton's kernels ran in its interpreter here: their times say nothing of a GPU's, their "
              "drafts and launches do)")  # fmt: skip
    if args.json:
        doc = {"command": " ".join(["python", "benchmarks/worker_drafter.py", *sys.argv[1:]]), "device": args.device,
               "history_tokens": args.history, "ngram_share": args.ngram_share, "rows": rows,
               "cores": os.cpu_count(), "load_average_1min": round(load, 2),
               "triton_problem": triton_problem}  # fmt: skip
        try:
            replace_file(args.json, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
        except OSError as e:
            print(f"worker_drafter: {args.json}: {error_text(e)}", file=sys.stderr)
            return 1
    return 1 if any(r["mismatched_steps"] or r.get("triton", {}).get("mismatched_steps") for r in rows) else 0


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
