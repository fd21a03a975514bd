"""Where a sweep's independent jobs run: a local process pool (default) or a Ray cluster.

``make_executor("local" | "ray", jobs=N, address=...)`` gives an object whose ``map(fn, items, on_done)``
runs ``fn(item)`` for every item and returns the results in item order, calling ``on_done(i, result)``
as each finishes (progress for the whole sweep). Jobs must be pure functions of their item (seeded):
then the results do not depend on the executor, its worker count or the order jobs finish in, which
``tests/sim/test_executor.py`` holds for both executors.

Ray is optional (``pip install 'speccontrol[ray]'``). Without ``address`` a private local Ray is started
with ``jobs`` CPUs and shut down afterwards; with one (``auto`` or ``ray://host:10001``) the existing
cluster is joined, and every node must have speccontrol installed.

The local pool must never outlive its sweep or outgrow the machine. It runs at most one worker per
usable CPU (``usable_cpus``: the jobs are CPU-bound, so ``--jobs 1024`` on 2 cores only multiplied
the memory, about 50 MB a worker, and the start-up), and keeps a few jobs per worker queued rather
than the whole sweep. Anything that ends ``map`` early (Ctrl-C, a job that raises, a worker that
died) kills the workers at once: the pool's own shutdown waited for every queued job first, so
Ctrl-C took as long as the rest of the sweep. While the pool runs, Ctrl-C is taken between results,
never inside the pool's own machinery (``_ctrl_c_deferred``). Workers ignore SIGINT (the terminal
sends it to the whole group; the parent ends them) and, on Linux, are killed when the parent dies (SIGTERM, the OOM
killer): they were left blocked on their queue for good. A worker that dies is an ``ExecutorError``
(one line, exit 1), not ``BrokenProcessPool``'s traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from policies.spec import PolicySpec, parse_policy, render_policy

T = TypeVar("T")
R = TypeVar("R")
EXECUTORS = ("local", "ray")


class ExecutorError(RuntimeError):
    pass


class ExecutorUsageError(ExecutorError):
    """A bad ``--executor``/``--address`` combination (a usage error, exit 2)."""


class RayStartError(RuntimeError):
    """A private local Ray did not come up (its node never registered), after every attempt."""


#: Tries at starting a private local Ray. Ray waits a fixed 30 s for its own node to register and then
#: raises a bare Exception; on a machine whose cores are busy that wait can run out once, not twice.
RAY_START_ATTEMPTS = 3


def start_local_ray(ray: Any, *, num_cpus: int, runtime_env: dict[str, Any] | None = None) -> None:
    """``ray.init`` of a private local Ray with ``num_cpus`` CPUs, tried ``RAY_START_ATTEMPTS`` times."""
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
            return
        except Exception as e:  # Ray times its node start-up out with a bare Exception
            ray.shutdown()  # what the failed start left (its GCS, a half-started raylet)
            if attempt == RAY_START_ATTEMPTS:
                raise RayStartError(f"{e} ({attempt} attempts)") from None


class Executor(Protocol):
    def map(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        on_done: Callable[[int, R], None] | None = None,
    ) -> list[R]: ...


#: Jobs queued per worker beyond the one it runs: enough to keep it busy between two results, few
#: enough that a sweep of 10^5 jobs does not hold 10^5 futures and their pickled items at once.
QUEUED_PER_WORKER = 2


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one), at least 1."""
    with contextlib.suppress(AttributeError, OSError):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


_PR_SET_PDEATHSIG = 1


def _worker_init(parent: int) -> None:
    """In each pool worker, before its first job: Ctrl-C is the parent's to handle (it kills the
    workers), and the worker dies with its parent instead of waiting on a queue nobody feeds."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took hold
        os._exit(1)


def _kill_pool(pool: ProcessPoolExecutor) -> None:
    """End a pool now: queued jobs cancelled, running ones killed (their results are not wanted)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            proc.kill()
    # Prompt: nothing is left running to wait for. (RuntimeError: its manager thread never started.)
    with contextlib.suppress(RuntimeError):
        pool.shutdown(wait=True, cancel_futures=True)
    for proc in procs:
        with contextlib.suppress(OSError, ValueError, AttributeError, AssertionError):
            proc.join(timeout=5)


#: How often a waiting sweep looks for a deferred Ctrl-C (seconds).
_POLL_S = 0.2


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[Callable[[], bool]]:
    """While a pool runs, Ctrl-C only sets a flag that ``map`` checks between results and turns into
    KeyboardInterrupt there. Raised wherever the main thread was, it broke the pool's own start-up
    (``cannot join thread before it is started``, a traceback; or a hang). Workers forked meanwhile
    inherit the flag handler, so a press before their initializer runs is harmless too."""
    pressed = False

    def press(signum: int, frame: Any) -> None:
        nonlocal pressed
        pressed = True

    try:
        previous = signal.getsignal(signal.SIGINT)
        if previous in (signal.SIG_IGN, None):  # ignored (a background job): leave it so
            yield lambda: False
            return
        signal.signal(signal.SIGINT, press)
    except ValueError:  # not the main thread, which alone gets KeyboardInterrupt anyway
        yield lambda: False
        return
    try:
        yield lambda: pressed
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass(frozen=True, slots=True)
class LocalExecutor:
    """A process pool of up to ``jobs`` workers (no more than ``usable_cpus()``, nor than there are
    items); ``jobs`` 1 runs in this process (no pool)."""

    jobs: int = 1

    def workers(self, n_items: int) -> int:
        """How many worker processes a ``map`` over ``n_items`` items starts (0: runs in this process)."""
        if self.jobs <= 1 or n_items <= 1:
            return 0
        return max(1, min(self.jobs, n_items, usable_cpus()))

    def map(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        on_done: Callable[[int, R], None] | None = None,
    ) -> list[R]:
        out: list[Any] = [None] * len(items)
        workers = self.workers(len(items))
        if workers == 0:
            for i, it in enumerate(items):
                out[i] = fn(it)
                if on_done:
                    on_done(i, out[i])
            return out
        with _ctrl_c_deferred() as interrupted:
            pool = ProcessPoolExecutor(max_workers=workers, initializer=_worker_init, initargs=(os.getpid(),))
            try:
                for i, result in _completed(pool, fn, items, workers * (1 + QUEUED_PER_WORKER), interrupted):
                    out[i] = result
                    if on_done:
                        on_done(i, result)
            except BrokenProcessPool:
                _kill_pool(pool)
                if interrupted():  # a worker that died of the same Ctrl-C
                    raise KeyboardInterrupt from None
                raise ExecutorError(
                    f"a worker process of the sweep died (killed for memory, or by a signal); "
                    f"{workers} workers were running: try fewer --jobs"
                ) from None
            except MemoryError:
                _kill_pool(pool)
                raise ExecutorError(
                    f"a job ran out of memory with {workers} workers: try fewer --jobs"
                ) from None
            except BaseException:  # Ctrl-C, a job's own error: nothing more of this sweep is wanted
                _kill_pool(pool)
                raise
            pool.shutdown(wait=True)
            if interrupted():  # pressed as the last results came in
                raise KeyboardInterrupt
        return out


def _completed(
    pool: ProcessPoolExecutor,
    fn: Callable[[T], R],
    items: Sequence[T],
    window: int,
    interrupted: Callable[[], bool],
) -> Iterator[tuple[int, R]]:
    """``(index, fn(item))`` as jobs finish, with at most ``window`` submitted and not yet seen;
    KeyboardInterrupt here once ``interrupted()``."""
    index: dict[Future[R], int] = {}
    todo = iter(range(len(items)))
    pending: set[Future[R]] = set()

    def fill() -> None:
        while len(pending) < window and not interrupted():
            i = next(todo, None)
            if i is None:
                return
            f = pool.submit(fn, items[i])
            index[f] = i
            pending.add(f)

    fill()
    while pending:
        if interrupted():
            raise KeyboardInterrupt
        done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_COMPLETED)
        for f in sorted(done, key=index.__getitem__):
            yield index.pop(f), f.result()
        fill()
    if interrupted():
        raise KeyboardInterrupt


@dataclass(frozen=True, slots=True)
class RayExecutor:
    """Ray tasks of one CPU each, on a private local Ray (``address`` None; of ``jobs`` CPUs, at most
    ``usable_cpus()``) or an existing cluster."""

    jobs: int = 1
    address: str | None = None

    def map(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        on_done: Callable[[int, R], None] | None = None,
    ) -> list[R]:
        ray = _import_ray()
        started = not ray.is_initialized()
        if started:
            try:
                if self.address:
                    ray.init(address=self.address, log_to_driver=False)
                else:
                    path = os.environ.get("PYTHONPATH")
                    start_local_ray(
                        ray,
                        # As the local pool: no more CPUs than there are (Ray starts a worker per CPU).
                        num_cpus=max(1, min(self.jobs, usable_cpus())),
                        # Workers import this checkout as the driver does.
                        runtime_env={"env_vars": {"PYTHONPATH": path}} if path else None,
                    )
            except (ConnectionError, RuntimeError, ValueError, RayStartError) as e:
                where = self.address or "local"
                raise ExecutorError(f"--executor ray: cannot start or reach Ray ({where}): {e}") from None
        try:
            task = ray.remote(num_cpus=1)(fn)
            refs = [task.remote(it) for it in items]
            index = {r: i for i, r in enumerate(refs)}
            out: list[Any] = [None] * len(items)
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    i = index[ref]
                    out[i] = ray.get(ref)
                    if on_done:
                        on_done(i, out[i])
            return out
        finally:
            if started:
                ray.shutdown()


@dataclass(frozen=True, slots=True)
class ShippedPolicy:
    """A policy as a job carries it: ``PolicySpec`` holds read-only mappings that do not pickle, so jobs
    carry its YAML and parse it where they run (the same spec: parsing is deterministic)."""

    yaml_text: str
    source: str

    @classmethod
    def of(cls, spec: PolicySpec) -> ShippedPolicy:
        return cls(spec.source_yaml or render_policy(spec), spec.name)

    def spec(self) -> PolicySpec:
        return parse_policy(self.yaml_text, source=self.source)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ExecutorError("--executor ray: ray is not installed (pip install 'speccontrol[ray]')") from None
    return ray


def make_executor(kind: str, *, jobs: int | None = None, address: str | None = None) -> Executor:
    """``local`` (a process pool; the default) or ``ray``; ``jobs`` defaults to the usable CPU count
    (a local pool runs no more workers than that whatever ``jobs`` says: ``LocalExecutor.workers``)."""
    n = max(1, jobs if jobs is not None else usable_cpus())
    if address == "":  # (an unset variable) not taken for none: Ray started a cluster of its own here
        raise ExecutorUsageError("--address '': not a cluster address (leave it out for none)")
    if kind == "local":
        if address:
            raise ExecutorUsageError("--address: only with --executor ray")
        return LocalExecutor(jobs=n)
    if kind == "ray":
        _import_ray()
        return RayExecutor(jobs=n, address=address or None)
    raise ExecutorUsageError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {kind!r}")
