"""Where a sweep's independent jobs run: a local process pool (default) or a Ray cluster.

``make_executor("local" | "ray", jobs=N, address=...)`` gives an object whose ``map(fn, items, on_done)``
runs ``fn(item)`` for every item and returns the results in item order, calling ``on_done(i, result)``
as each finishes (progress for the whole sweep). Jobs must be pure functions of their item (seeded):
then the results do not depend on the executor, its worker count or the order jobs finish in, which
``tests/sim/test_executor.py`` holds for both executors.

Ray is optional (``pip install 'speccontrol[ray]'``). Without ``address`` a private local Ray is started
with ``jobs`` CPUs and shut down afterwards; with one (``auto`` or ``ray://host:10001``) the existing
cluster is joined, and every node must have speccontrol installed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
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


@dataclass(frozen=True, slots=True)
class LocalExecutor:
    """A process pool of ``jobs`` workers; ``jobs`` 1 runs in this process (no pool)."""

    jobs: int = 1

    def map(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        on_done: Callable[[int, R], None] | None = None,
    ) -> list[R]:
        out: list[Any] = [None] * len(items)
        if self.jobs <= 1 or len(items) <= 1:
            for i, it in enumerate(items):
                out[i] = fn(it)
                if on_done:
                    on_done(i, out[i])
            return out
        with ProcessPoolExecutor(max_workers=min(self.jobs, len(items))) as ex:
            index: dict[Future[R], int] = {ex.submit(fn, it): i for i, it in enumerate(items)}
            pending = set(index)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in sorted(done, key=index.__getitem__):
                    i = index[f]
                    out[i] = f.result()
                    if on_done:
                        on_done(i, out[i])
        return out


@dataclass(frozen=True, slots=True)
class RayExecutor:
    """Ray tasks of one CPU each, on a private local Ray (``address`` None) or an existing cluster."""

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
                        num_cpus=max(1, self.jobs),
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
    """``local`` (a process pool; the default) or ``ray``; ``jobs`` defaults to the CPU count."""
    n = max(1, jobs if jobs is not None else (os.cpu_count() or 1))
    if kind == "local":
        if address:
            raise ExecutorUsageError("--address: only with --executor ray")
        return LocalExecutor(jobs=n)
    if kind == "ray":
        _import_ray()
        return RayExecutor(jobs=n, address=address or None)
    raise ExecutorUsageError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {kind!r}")
