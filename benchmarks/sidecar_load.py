"""Load on one sidecar: N simulated engines stream telemetry over loopback for a fixed time.

    python benchmarks/sidecar_load.py --engines 64 --seconds 20 [--json FILE]

Each engine sends ``--steps-per-s`` steps per second with ``--batch`` requests per step, in report
batches every ``--flush-ms``. The sidecar runs in a child process pinned to one core (``--core``);
it records how long each engine's decision round (``Sidecar._decide``) takes, in wall and thread CPU
time. Printed: observations (request-steps) applied per second, dropped reports (sent but not
applied, rate-limited or refused), decision latency p50/p99, how late a 10 ms sleep on the sidecar's
event loop wakes (event-loop lag), the sidecar's CPU use and peak RSS, the load generator's CPU, how
long the sidecar's main thread waited for its core (pinning keeps the sidecar on the core, not other
processes off it), and the machine's load average before and after (the figures depend on it).
The generator sends pre-encoded batches, so its own cost stays small. Target: 128 engines, zero
drops on one core, p99 under 5 ms. Measures, never asserts. A mistaken flag or an unwritable
``--json``/``--profile`` exits 2 before the sidecar starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from policies.text import error_text  # noqa: E402
from sim import cli_types  # noqa: E402
from sim.files import output_problem, replace_file, temporary_directory  # noqa: E402


def _sidecar_main(
    state_dir: str, core: int, ready: Any, stop: Any, out: str, profile: str = "", ack_interval_s: float = 1.0
) -> None:
    # Ctrl-C is the parent's to handle: it sets ``stop`` and waits for this process (a press at the
    # terminal reaches both; handled here too, it ended the sidecar with a traceback of its own).
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C pending since the start is discarded)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the parent for the start
    # And a parent killed outright (no ``stop`` ever set) takes this process with it.
    from _interrupt import die_with_parent  # (benchmarks/ is on the path the parent gave it)

    die_with_parent()
    if profile:  # the whole sidecar process under cProfile, stats written to ``profile``
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        try:
            _sidecar_main(state_dir, core, ready, stop, out, ack_interval_s=ack_interval_s)
        finally:
            prof.disable()
            prof.dump_stats(profile)
        return
    if core >= 0:
        os.sched_setaffinity(0, {core})
    from prometheus_client import CollectorRegistry

    from controller.config import SidecarConfig
    from controller.server import SidecarServer

    lat: list[float] = []
    lat_cpu: list[float] = []
    lag: list[float] = []

    async def run() -> None:
        sc = SidecarServer(
            config=SidecarConfig(
                engine_listen="127.0.0.1:0",
                admin_listen="127.0.0.1:0",
                metrics_listen="",
                state_dir=state_dir,
                snapshot_interval_s=3600.0,
                # Batches are acknowledged once a snapshot holds them: while some wait, the snapshot
                # is written every ack_interval_s (3600: no such writes, the baseline of --compare-acks).
                ack_interval_s=ack_interval_s,
            ),
            registry=CollectorRegistry(),
        )
        decide = sc._decide
        saves = 0
        save = sc.save_snapshot_async

        async def counted() -> bool:
            nonlocal saves
            saves += 1
            return await save()

        sc.save_snapshot_async = counted  # type: ignore[method-assign]

        def timed(st: Any, now: float) -> None:
            t, c = time.perf_counter(), time.thread_time()
            decide(st, now)
            lat.append(time.perf_counter() - t)
            # The same on the thread's CPU clock: the round's own work, without time the core was
            # given to another process (on a loaded host most of the wall-clock tail).
            lat_cpu.append(time.thread_time() - c)

        sc._decide = timed  # type: ignore[method-assign]

        async def watch_loop() -> None:
            # How late a 10 ms sleep wakes: how long the event loop was held by something else
            # (every engine's reports wait that long).
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                lag.append(time.perf_counter() - t - 0.01)

        await sc.start()
        watcher = asyncio.create_task(watch_loop())
        sched0 = _schedstat()
        ready.put(sc.engine_target)
        cpu0 = time.process_time()
        t0 = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        sched = [b - a for a, b in zip(sched0, _schedstat(), strict=True)]
        watcher.cancel()
        engines = sc.engines()
        doc = {
            "request_steps": sum(e.loop.totals.request_steps for e in engines.values()),
            "steps": sum(e.loop.totals.steps for e in engines.values()),
            "rejected": sum(e.rejected for e in engines.values()),
            "wall_s": wall,
            "cpu_s": cpu,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "decide_s": lat,
            "decide_cpu_s": lat_cpu,
            # The main thread's time on the core and waiting for it (runnable, another process on it).
            "main_thread_run_s": sched[0],
            "main_thread_wait_s": sched[1],
            "loop_lag_s": lag,
            "snapshots": saves,
        }
        await sc.stop(snapshot=False)
        Path(out).write_text(json.dumps(doc))

    asyncio.run(run())


def _ready(proc: Any, ready: Any) -> str:
    """The sidecar's engine address once it is up; exit 1 (one line) if its process ends first."""
    import queue

    while True:
        try:
            return str(ready.get(timeout=0.5))
        except queue.Empty:
            if not proc.is_alive():
                sys.exit(f"sidecar_load: the sidecar process ended (exit {proc.exitcode}) before it was up")


def _schedstat() -> list[float]:
    """This thread's (seconds run on a core, seconds waited runnable for one) from the kernel's
    scheduler statistics (zeros where the kernel does not keep them)."""
    import threading

    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
    except (OSError, ValueError):
        return [0.0, 0.0]
    return [int(run_ns) / 1e9, int(wait_ns) / 1e9]


def _batch(seq: int, steps: int, batch: int, t: float, *, rows: bool = False, packed: bool = True) -> Any:
    from controller.v1 import controller_pb2 as pb
    from controller.wire.codec import request_columns, request_steps

    cols: dict[str, Any] = dict(
        request_ids=[f"r{i}" for i in range(batch)],
        classes=["default"] * batch,
        methods=["eagle3"] * batch,
        ks=[2] * batch,
        drafted=[2] * batch,
        accepted=[i % 3 for i in range(batch)],
    )
    per_request: dict[str, Any] = (
        {"requests": request_steps(**cols)} if rows else {"columns": request_columns(**cols, packed=packed)}
    )
    return pb.StepReportBatch(
        sequence=seq,
        steps=[
            pb.StepReport(
                time_s=t, duration_s=0.01, batch_size=batch, queue_length=0, scheduled_k=2, **per_request
            )
            for _ in range(steps)
        ],
    )


def _encoded_reports(template: Any) -> Callable[[int], bytes]:
    """``seq -> the serialized EngineMessage holding ``template`` numbered seq``, without building a
    message per send: the template is encoded once and a message holding only the sequence appended
    (protobuf merges a repeated occurrence of an embedded message field, so the receiver parses one
    batch: the template's steps with that sequence). The generator then costs little CPU per send."""
    from controller.v1 import controller_pb2 as pb

    body = pb.EngineMessage(reports=template).SerializeToString()
    return lambda seq: body + pb.EngineMessage(reports=pb.StepReportBatch(sequence=seq)).SerializeToString()


def _serialize(msg: Any) -> bytes:
    return msg if isinstance(msg, bytes) else bytes(msg.SerializeToString())


async def _engines(
    target: str, n: int, seconds: float, steps_per_s: float, batch: int, flush_ms: float, form: str
) -> int:
    import grpc

    from controller.v1 import controller_pb2 as pb

    per_flush = max(1, round(steps_per_s * flush_ms / 1000))
    encoded = _encoded_reports(_batch(0, per_flush, batch, 0.0, rows=form == "rows", packed=form == "packed"))
    sent = 0

    async def one(i: int) -> None:
        nonlocal sent
        hello = pb.Hello(
            engine_id=f"load-{i}", model="m", max_k=4, arms=[pb.Arm(method="eagle3", k=k) for k in (1, 2, 3, 4)],
            granularity=pb.GRANULARITY_BATCH_STEP, max_batch_size=256, protocol_version=1, instance_id=f"i{i}",
        )  # fmt: skip
        end = time.monotonic() + seconds

        async def msgs() -> Any:
            nonlocal sent
            yield pb.EngineMessage(hello=hello)
            seq = 0
            nxt = time.monotonic()
            while time.monotonic() < end:
                seq += 1
                sent += per_flush * batch
                yield encoded(seq)
                nxt += flush_ms / 1000
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))

        async with grpc.aio.insecure_channel(target) as ch:
            attach = ch.stream_stream(
                "/controller.v1.EngineService/Attach",
                request_serializer=_serialize,
                response_deserializer=pb.Directive.FromString,
            )
            call = attach(msgs())
            reader = asyncio.create_task(_drain(call))
            await asyncio.sleep(seconds + 1.0)
            reader.cancel()
            call.cancel()

    await asyncio.gather(*(one(i) for i in range(n)))
    return sent


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Range-checked: --seconds 0 ended in a ZeroDivisionError after the run.
    ap.add_argument("--engines", type=cli_types.int_in(1, 4096), default=64)
    ap.add_argument("--seconds", type=cli_types.float_in(0, 3600, lo_open=True), default=10.0)
    ap.add_argument("--steps-per-s", type=cli_types.float_in(0, 100_000, lo_open=True), default=100.0)
    ap.add_argument("--batch", type=cli_types.int_in(1, 4096), default=32)
    ap.add_argument(
        "--flush-ms",
        type=cli_types.float_in(0, 60_000, lo_open=True),
        default=100.0,
        help="report batch interval (the plugin's default: 100 ms)",
    )
    ap.add_argument(
        "--rows", action="store_true", help="send per-request rows (RequestStep) instead of columns"
    )
    ap.add_argument(
        "--unpacked",
        action="store_true",
        help="columns in repeated fields (what engines send a sidecar older than protocol 2), not packed",
    )
    ap.add_argument(
        "--core", type=cli_types.int_in(-1, 4095), default=0, help="CPU core for the sidecar (-1: no pinning)"
    )
    ap.add_argument(
        "--profile", default="", metavar="FILE", help="run the sidecar under cProfile, stats to FILE (pstats)"
    )
    ap.add_argument(
        "--json", metavar="FILE", help="also write the figures here (make results: docs/results/)"
    )
    ap.add_argument(
        "--ack-interval-s",
        type=cli_types.float_in(0, 3600, lo_open=True),
        default=1.0,
        help="the sidecar's ack_interval_s (acknowledgements wait for a snapshot, written this often)",
    )
    ap.add_argument(
        "--compare-acks",
        action="store_true",
        help="run twice: first without acknowledgement snapshots (baseline), then with --ack-interval-s",
    )
    args = ap.parse_args(argv)
    if args.core >= (os.cpu_count() or 1):
        ap.error(
            f"--core: this machine has cores 0..{(os.cpu_count() or 1) - 1} (-1: no pinning), got {args.core}"
        )
    problem = output_problem("--json", args.json) or output_problem("--profile", args.profile or None)
    if problem:
        ap.error(problem)
    base = _measure(args, ack_interval_s=3600.0) if args.compare_acks else None
    doc = _measure(args, ack_interval_s=args.ack_interval_s)
    if base is not None and base["steps"] and doc["steps"]:
        b, d = base["cpu_s"] / base["steps"], doc["cpu_s"] / doc["steps"]
        print(
            f"acknowledgement snapshots: CPU per step {d * 1e6:.0f} us vs {b * 1e6:.0f} us without "
            f"(ratio {d / b:.3f}); {doc['snapshots']} vs {base['snapshots']} snapshots written"
        )
    return 0


def _form(args: argparse.Namespace) -> str:
    """How the engines send their requests: "rows", "columns" (repeated fields) or "packed"."""
    return "rows" if args.rows else "columns" if args.unpacked else "packed"


def _measure(args: argparse.Namespace, *, ack_interval_s: float) -> dict[str, Any]:
    """One run: the sidecar process, the engines, the figures printed; returns the sidecar's result."""
    ctx = mp.get_context("spawn")
    with temporary_directory(prefix="sc-load-") as d:
        ready, stop = ctx.Queue(), ctx.Event()
        out = os.path.join(d, "result.json")
        proc = ctx.Process(
            target=_sidecar_main,
            args=(
                os.path.join(d, "state"),
                args.core,
                ready,
                stop,
                out,
                os.path.abspath(args.profile) if args.profile else "",
                ack_interval_s,
            ),
        )
        load_before = os.getloadavg()
        try:
            # Started with SIGINT blocked, which it keeps through its exec until it ignores it (a
            # terminal's Ctrl-C reaches the whole process group: it printed a KeyboardInterrupt
            # traceback from the child's imports). Here a Ctrl-C meanwhile is kept for after the start:
            # ignored, it was lost and the run went on for its --seconds; raised inside the start (the
            # mask is this thread's, another thread takes the signal), the child read half its set-up.
            hits: list[int] = []
            previous = signal.getsignal(signal.SIGINT)
            swap = previous is not None and previous is not signal.SIG_IGN  # (None: not Python's)
            if swap:
                signal.signal(signal.SIGINT, lambda *_: hits.append(1))
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                if swap:
                    signal.signal(signal.SIGINT, previous)
            if hits:
                raise KeyboardInterrupt
            target = _ready(proc, ready)
            if args.core >= 0:  # keep the engines off the sidecar's core
                others = set(range(os.cpu_count() or 1)) - {args.core}
                if others:
                    os.sched_setaffinity(0, others)
            gen_cpu0, gen_t0 = time.process_time(), time.monotonic()
            sent = asyncio.run(
                _engines(
                    target,
                    args.engines,
                    args.seconds,
                    args.steps_per_s,
                    args.batch,
                    args.flush_ms,
                    _form(args),
                )
            )
            gen_cpu, gen_wall = time.process_time() - gen_cpu0, time.monotonic() - gen_t0
        finally:
            # Also on Ctrl-C or an error: a sidecar left waiting for ``stop`` kept the run from ever
            # ending (multiprocessing joins its children at exit).
            stop.set()
            if proc.pid is not None:  # (not started: a Ctrl-C before the start, or a start that failed)
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        if not Path(out).exists():
            sys.exit(f"sidecar_load: the sidecar process ended (exit {proc.exitcode}) without its figures")
        doc: dict[str, Any] = json.loads(Path(out).read_text())
    import numpy as np

    lat = np.array(doc["decide_s"]) * 1000
    applied = doc["request_steps"]
    print(
        f"engines {args.engines} x {args.steps_per_s:g} steps/s x batch {args.batch} as {_form(args)}, {args.seconds:g} s, sidecar on core {args.core}, ack_interval_s {ack_interval_s:g} ({doc['snapshots']} snapshots)"
    )
    print(
        f"observations/s (request-steps applied): {applied / args.seconds:,.0f}  (steps/s {doc['steps'] / args.seconds:,.0f})"
    )
    print(
        f"dropped reports (request-steps sent, not applied): {sent - applied:,}  rejected batches: {doc['rejected']}"
    )
    lat_cpu = np.array(doc["decide_cpu_s"]) * 1000
    if lat.size:
        print(
            f"decision latency ms: p50 {np.percentile(lat, 50):.3f}  p99 {np.percentile(lat, 99):.3f}  max {lat.max():.3f}  (n {lat.size}); "
            f"its CPU time: p99 {np.percentile(lat_cpu, 99):.3f}  max {lat_cpu.max():.3f}"
        )
    lag = np.array(doc["loop_lag_s"]) * 1000
    if lag.size:
        print(
            f"event-loop lag (a 10 ms sleep woken late by) ms: p50 {np.percentile(lag, 50):.1f}  "
            f"p99 {np.percentile(lag, 99):.1f}  max {lag.max():.1f}"
        )
    print(
        f"sidecar CPU: {doc['cpu_s'] / doc['wall_s'] * 100:.0f}% of one core; peak RSS {doc['max_rss_mib']:.0f} MiB; "
        f"load generator CPU: {gen_cpu / gen_wall * 100:.0f}% of one core"
    )
    if doc["main_thread_wait_s"]:
        # Runnable but not running: the core was given to other processes (the machine's load).
        print(
            f"sidecar main thread: ran {doc['main_thread_run_s'] / doc['wall_s'] * 100:.0f}% of the wall time, "
            f"waited for its core {doc['main_thread_wait_s'] / doc['wall_s'] * 100:.0f}%"
        )
    # The machine's load, which the figures depend on (a shared host changes them by tens of %).
    load = os.getloadavg()
    print(
        f"machine: {os.cpu_count()} cores, load average (1 min) {load_before[0]:.2f} before, {load[0]:.2f} after"
    )
    if doc["steps"]:
        # CPU time per applied step: the sidecar's cost, less sensitive than steps/s to a busy machine.
        per_step = doc["cpu_s"] / doc["steps"]
        print(f"sidecar CPU per step: {per_step * 1e6:.0f} us (one core: ~{1 / per_step:,.0f} steps/s)")
    if args.json:
        out_doc = {
            "command": f"python benchmarks/sidecar_load.py --engines {args.engines} --seconds {args.seconds:g}",
            "engines": args.engines,
            "seconds": args.seconds,
            "steps_per_s_per_engine": args.steps_per_s,
            "batch": args.batch,
            "flush_ms": args.flush_ms,
            "format": _form(args),
            "request_steps_applied_per_s": round(applied / args.seconds),
            "steps_applied_per_s": round(doc["steps"] / args.seconds),
            "request_steps_unapplied": sent - applied,
            "decision_ms": {
                k: round(float(np.percentile(lat, q)), 3) if lat.size else None
                for k, q in (("p50", 50), ("p99", 99), ("max", 100))
            },
            "decision_cpu_ms": {
                k: round(float(np.percentile(lat_cpu, q)), 3) if lat_cpu.size else None
                for k, q in (("p50", 50), ("p99", 99), ("max", 100))
            },
            "sidecar_cpu_pct_of_one_core": round(doc["cpu_s"] / doc["wall_s"] * 100, 1),
            "sidecar_cpu_us_per_step": round(doc["cpu_s"] / doc["steps"] * 1e6, 1) if doc["steps"] else None,
            "event_loop_lag_ms": {
                k: round(float(np.percentile(lag, q)), 2) if lag.size else None
                for k, q in (("p50", 50), ("p99", 99), ("max", 100))
            },
            "sidecar_waited_for_core_pct": round(doc["main_thread_wait_s"] / doc["wall_s"] * 100, 1),
            "load_generator_cpu_pct_of_one_core": round(gen_cpu / gen_wall * 100, 1),
            "cores": os.cpu_count(),
            "load_average_1min": [round(load_before[0], 2), round(load[0], 2)],
        }
        try:
            replace_file(args.json, (json.dumps(out_doc, indent=1) + "\n").encode("utf-8"))
        except OSError as e:
            sys.exit(f"sidecar_load: {args.json}: {error_text(e)}")  # one line, exit 1
    return doc


if __name__ == "__main__":
    from _interrupt import run_main  # (benchmarks/ is sys.path[0]: Ctrl-C is "interrupted", exit 130)

    run_main(main)
