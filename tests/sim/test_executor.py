"""``sim.executor``: results in item order whatever finishes first, progress for every job, and the same
sweep giving identical results on the local process pool and on a local Ray started by the test."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from sim.cli import main, resolve_policy
from sim.costmodel import load_profile
from sim.engines import ENGINES
from sim.executor import (
    RAY_START_ATTEMPTS,
    LocalExecutor,
    RayStartError,
    ShippedPolicy,
    make_executor,
    start_local_ray,
)
from sim.traffic import generate
from sim.tune import tune


def _slow_square(x: int) -> int:
    time.sleep(0.02 * (5 - x % 5))  # later items finish first
    return x * x


@pytest.mark.parametrize("jobs", [1, 2])
def test_local_executor_keeps_item_order_and_reports_every_job(jobs: int) -> None:
    seen: list[int] = []
    out = LocalExecutor(jobs=jobs).map(_slow_square, list(range(10)), lambda i, r: seen.append(i))
    assert out == [x * x for x in range(10)]
    assert sorted(seen) == list(range(10))


def test_policies_travel_as_yaml_and_come_back_equal() -> None:
    import pickle

    for name in ("default", "thompson", "static:eagle3:3"):
        spec = resolve_policy(name)
        assert pickle.loads(pickle.dumps(ShippedPolicy.of(spec))).spec() == spec


def test_executor_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["sim", "compare", "--scenario", "chat", "--requests", "4", "--concurrency", "1", "--no-oracle"]
    assert main([*base, "--address", "auto"]) == 2
    assert "--address: only with --executor ray" in capsys.readouterr().err
    # '' (an unset variable) was taken for no --address: a local pool ran, or Ray started a cluster
    # of its own on this machine in place of the one meant, without a word.
    for executor in ("local", "ray"):
        assert main([*base, "--executor", executor, "--address", ""]) == 2
        assert capsys.readouterr().err == "--address '': not a cluster address (leave it out for none)\n"
    with pytest.raises(SystemExit) as e:
        main([*base, "--executor", "dask"])
    assert e.value.code == 2


def _tune(executor: Any) -> list[tuple[dict[str, float], list[float]]]:
    traces = [generate("drift", n_requests=6, seed=1), generate("code", n_requests=6, seed=2)]
    cands = tune(
        resolve_policy("default"),
        {"rule.min_run": [2.0, 6.0]},
        traces,
        load_profile("llama-3.1-8b-h100"),
        ENGINES["composite"],
        [1, 4],
        seed=3,
        executor=executor,
    )
    return [(c.values, c.ratios) for c in cands]


@pytest.fixture(scope="module")
def local_ray() -> Any:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'speccontrol[ray]')")
    start_local_ray(ray, num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.mark.integration
def test_tune_gives_identical_results_on_local_and_ray(local_ray: Any) -> None:
    serial = _tune(LocalExecutor(jobs=1))
    assert serial == _tune(LocalExecutor(jobs=2))
    assert serial == _tune(make_executor("ray", jobs=2))
    assert len(serial) == 2 and all(len(r) == 4 for _, r in serial)


@pytest.mark.integration
def test_compare_sweep_over_traces_and_profiles_is_identical_on_local_and_ray(
    local_ray: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        *("sim", "compare", "--scenario", "chat,drift", "--requests", "5", "--concurrency", "1,4"),
        *("--profile", "llama-3.1-8b-h100,llama-3.1-8b-h100-per-draft", "--policy", "default"),
        *("--engine", "composite", "--seed", "7", "--progress"),
    ]
    out: dict[str, Any] = {}
    for ex in ("local", "ray"):
        assert main([*args, "--executor", ex, "--jobs", "2", "--json", str(tmp_path / f"{ex}.json")]) == 0
        err = capsys.readouterr().err
        assert "100.0%" in err and "done: drift on llama-3.1-8b-h100" in err
        out[ex] = json.loads((tmp_path / f"{ex}.json").read_text())
    assert out["local"] == out["ray"]
    cmps = out["local"]["comparisons"]
    assert [(c["trace"], c["profile"]) for c in cmps] == [
        ("chat", "llama-3.1-8b-h100"),
        ("chat", "llama-3.1-8b-h100-per-draft"),
        ("drift", "llama-3.1-8b-h100"),
        ("drift", "llama-3.1-8b-h100-per-draft"),
    ]
    # The two draft-cost models price the same replay differently.
    thr = [c["runs"][-1]["concurrency"]["4"]["throughput_tok_s"] for c in cmps[:2]]
    assert thr[0] != thr[1]


def test_replay_takes_one_trace_and_one_profile(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "replay", "--scenario", "chat,drift", "--policy", "default", "--requests", "4"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "one trace or scenario and one profile" in err and err.count("\n") == 1


class _FlakyRay:
    """A stand-in for the ray module whose first ``fails`` starts time out as Ray's do (a bare Exception)."""

    def __init__(self, fails: int) -> None:
        self.fails, self.inits, self.shutdowns = fails, 0, 0

    def init(self, **kwargs: Any) -> None:
        self.inits += 1
        assert kwargs["num_cpus"] == 2 and kwargs["include_dashboard"] is False
        if self.inits <= self.fails:
            raise Exception("The current node timed out during startup.")  # as Ray raises it

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_a_local_ray_whose_node_times_out_once_is_started_again() -> None:
    ray = _FlakyRay(fails=RAY_START_ATTEMPTS - 1)
    start_local_ray(ray, num_cpus=2)
    assert (ray.inits, ray.shutdowns) == (RAY_START_ATTEMPTS, RAY_START_ATTEMPTS - 1)


def test_a_local_ray_that_never_starts_is_a_clear_error_not_a_bare_exception() -> None:
    ray = _FlakyRay(fails=RAY_START_ATTEMPTS)
    with pytest.raises(RayStartError, match=f"timed out during startup.*{RAY_START_ATTEMPTS} attempts"):
        start_local_ray(ray, num_cpus=2)
    assert ray.shutdowns == RAY_START_ATTEMPTS
