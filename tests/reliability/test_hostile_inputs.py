"""Issue 15's findings against a real sidecar over real gRPC: nothing an engine or an admin client
sends can poison the learner, break status or snapshots, grow /metrics without bound or forge a
log line; a learner state that breaks anyway is reset, not kept."""

from __future__ import annotations

import json
import logging
import math
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.server import SidecarServer as Sidecar
from controller.sidecar import MAX_CLASSES_PER_ENGINE
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.validation import MAX_SEQUENCE
from controller.wire.codec import request_columns
from policies.arms import Arm, Method
from policies.engine import EngineInfo
from policies.presets import preset_text, resolve_policy_text
from policies.spec import MAX_DOCUMENT_BYTES, PolicyError
from tests.integration.test_sidecar_grpc import (
    STATIC_EAGLE3_2,
    TestEngine,
    hello,
    loopback_config,
    step,
    until,
)

pytestmark = pytest.mark.integration

U64_MAX = (1 << 64) - 1


def _config(tmp_path: Path, **kw: object) -> SidecarConfig:
    base: dict[str, object] = {
        "metrics_listen": "127.0.0.1:0",
        "decision_tick_s": 0.01,
        "snapshot_interval_s": 3600.0,
    }
    return loopback_config(tmp_path, **{**base, **kw})


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    sc = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
    await sc.start()
    sc.set_policy(preset_text("default"), source="preset:default")  # the goodput model
    try:
        yield sc
    finally:
        await sc.stop(snapshot=False)


async def _admin(sc: Sidecar) -> tuple[grpc.aio.Channel, pb_grpc.AdminServiceStub]:
    ch = grpc.aio.insecure_channel(sc.admin_target)
    return ch, pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]


def _batch(seq: int, *steps: pb.StepReport, dropped: int = 0) -> pb.EngineMessage:
    return pb.EngineMessage(reports=pb.StepReportBatch(sequence=seq, steps=steps, dropped_steps=dropped))


async def _refused(eng: TestEngine) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await eng.directive(lambda d: False)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(err.value.details())


@pytest.mark.parametrize(("duration", "reason"), [(1e154, "duration_invalid"), (5e-324, "duration_invalid")])
async def test_absurd_durations_are_refused_and_status_and_snapshots_stay_healthy(
    sidecar: Sidecar, duration: float, reason: str
) -> None:
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello("e1")))
    await eng.directive()
    eng.report(*[step(t=float(i), accepted=[1, 2]) for i in range(20)])
    await until(lambda: sidecar.engines()["e1"].loop.totals.steps == 20)
    bad = step(t=30.0, accepted=[1, 2])
    bad.duration_s = duration
    eng.out.put_nowait(_batch(2, bad))
    details = await _refused(eng)
    assert details.startswith(f"{reason}: steps[0].duration_s: ")
    await eng.close()
    ch, admin = await _admin(sidecar)
    async with ch:
        status = await admin.GetStatus(pb.StatusRequest())
        (e1,) = status.engines
        assert e1.steps == 20 and e1.rejected == 1
        assert all(math.isfinite(a.goodput_tok_s) for a in e1.arms)
        assert math.isfinite(e1.goodput_tok_s)
    assert sidecar.save_snapshot()
    json.loads(sidecar.snapshots.path.read_text())  # strict JSON: it was written with allow_nan=False
    assert sidecar.registry.get_sample_value("speccontrol_control_loop_resets_total") == 0


@pytest.mark.parametrize("field", ["sequence", "dropped_steps"])
async def test_counters_of_2_64_are_refused_and_later_batches_still_apply(
    sidecar: Sidecar, field: str
) -> None:
    h = hello("e1")
    h.instance_id = "i" * 32
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h))
    await eng.directive()
    eng.out.put_nowait(_batch(1, step(t=1.0, accepted=[1])))
    await until(lambda: sidecar.engines()["e1"].loop.totals.steps == 1)
    if field == "sequence":
        eng.out.put_nowait(_batch(U64_MAX, step(t=2.0, accepted=[1])))
    else:
        eng.out.put_nowait(_batch(2, step(t=2.0, accepted=[1]), dropped=U64_MAX))
    assert f"reports.{field}: " in await _refused(eng)
    await eng.close()
    again = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h))
    try:
        await again.directive()
        again.out.put_nowait(_batch(2, step(t=3.0, accepted=[1])))  # not a "duplicate" of 2^64-1
        await until(lambda: sidecar.engines()["e1"].loop.totals.steps == 2)
    finally:
        await again.close()
    r = sidecar.registry
    assert (r.get_sample_value("speccontrol_duplicate_reports_total", {"engine": "e1"}) or 0) == 0
    assert (r.get_sample_value("speccontrol_engine_dropped_steps_total", {"engine": "e1"}) or 0) == 0
    assert sidecar.engines()["e1"].last_sequence == 2 < MAX_SEQUENCE


async def test_a_loop_whose_state_broke_is_reset_and_nothing_else_fails(
    sidecar: Sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever path might still put NaN into a learner: status, snapshots and decisions recover."""
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello("e1")))
    try:
        await eng.directive()
        eng.report(*[step(t=float(i), accepted=[1, 2]) for i in range(20)])
        await until(lambda: sidecar.engines()["e1"].loop.totals.steps == 20)
        learner = sidecar.engines()["e1"].loop.learner
        learner._xtx = np.full_like(learner._xtx, np.nan)  # type: ignore[attr-defined]
        learner._xty = np.full_like(learner._xty, np.nan)  # type: ignore[attr-defined]
        learner._fit = None  # type: ignore[attr-defined]
        caplog.set_level(logging.ERROR)
        assert sidecar.save_snapshot()
        ch, admin = await _admin(sidecar)
        async with ch:
            (e1,) = (await admin.ListEngines(pb.ListEnginesRequest())).engines
        assert e1.steps == 20  # the counters survive the reset
        assert sidecar.registry.get_sample_value("speccontrol_control_loop_resets_total") == 1
        assert "control loop starts afresh" in caplog.text
        eng.report(step(t=30.0, accepted=[1, 2]))
        await until(lambda: sidecar.engines()["e1"].loop.totals.steps == 21)
    finally:
        await eng.close()


async def test_huge_model_names_are_refused_so_status_keeps_working(sidecar: Sidecar) -> None:
    for i in range(2):  # two 2.5 MB names made status exceed 4 MB for everyone
        h = hello(f"big{i}")
        h.model = "m" * 2_500_000
        eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await eng.directive()
        assert "hello.model: longer than" in str(err.value.details())
        await eng.close()
    ch, admin = await _admin(sidecar)
    async with ch:
        status = await admin.GetStatus(pb.StatusRequest())
    assert status.engines_total == 0 and not status.engines_truncated


def _info(i: int) -> EngineInfo:
    return EngineInfo(
        engine_id=f"engine-{i:04d}",
        model="m" * 400,
        max_k=4,
        arms=(Arm(Method.EAGLE3, 2), Arm(Method.EAGLE3, 4), Arm(Method.OFF, 0)),
        max_batch_size=64,
    )


async def test_status_is_bounded_and_list_engines_pages_through_everything(tmp_path: Path) -> None:
    # A slow tick: 300 engines deciding every 10 ms would only slow the test.
    sc = Sidecar(
        config=_config(tmp_path, max_message_bytes=128 * 1024, decision_tick_s=1.0),
        registry=CollectorRegistry(),
    )
    await sc.start()
    try:
        for i in range(300):
            sc.attach(_info(i))
        ch, admin = await _admin(sc)
        async with ch:
            status = await admin.GetStatus(pb.StatusRequest())
            assert status.engines_total == 300 and status.engines_truncated
            assert 0 < len(status.engines) < 300 and status.ByteSize() <= 64 * 1024
            seen: list[str] = []
            offset = 0
            for _ in range(300):
                page = await admin.ListEngines(pb.ListEnginesRequest(offset=offset, limit=50))
                assert page.total == 300 and len(page.engines) <= 50
                seen += [e.engine_id for e in page.engines]
                offset = page.next_offset
                if not offset:
                    break
            assert seen == [_info(i).engine_id for i in range(300)]
    finally:
        await sc.stop(snapshot=False)


def _scrape(sc: Sidecar) -> str:
    with urllib.request.urlopen(sc.metrics_url, timeout=10) as r:
        return str(r.read().decode())


async def test_metrics_forget_evicted_engines_and_carry_build_info_and_decision_latency(
    tmp_path: Path,
) -> None:
    sc = Sidecar(config=_config(tmp_path, max_engines=3), registry=CollectorRegistry())
    await sc.start()
    try:
        for i in range(12):  # unique engine ids, each attaching once and leaving
            eng = TestEngine(sc.engine_target, pb.EngineMessage(hello=hello(f"churn-{i}")))
            await eng.directive()
            eng.report(step(t=1.0, accepted=[1]))
            await until(lambda i=i: sc.engines()[f"churn-{i}"].loop.totals.steps == 1)  # type: ignore[misc]
            await eng.close()
            await until(lambda i=i: not sc.engines()[f"churn-{i}"].connected)  # type: ignore[misc]
        text = _scrape(sc)
        engines = {
            line.split('engine="')[1].split('"')[0] for line in text.splitlines() if 'engine="' in line
        }
        assert engines == {f"churn-{i}" for i in (9, 10, 11)}
        assert "_created" not in text
        assert "speccontrol_build_info{" in text and "version=" in text
        assert (sc.registry.get_sample_value("speccontrol_decision_seconds_count") or 0) >= 1
    finally:
        await sc.stop(snapshot=False)


def _big_policy(name: str) -> str:
    """A valid policy of about 20 KB (a long description)."""
    return STATIC_EAGLE3_2.replace("name: static-eagle3-2", f"name: {name}\n  description: {'x' * 20_000}")


async def test_engine_overrides_are_capped_and_list_policies_is_bounded(tmp_path: Path) -> None:
    sc = Sidecar(
        config=_config(tmp_path, max_engines=3, max_message_bytes=128 * 1024), registry=CollectorRegistry()
    )
    await sc.start()
    try:
        for i in range(3):
            sc.set_policy(_big_policy(f"own-{i}"), source="big.yaml", engine_id=f"e{i}")
        with pytest.raises(PolicyError, match=r"at most 3 engines \(max_engines\)"):
            sc.set_policy(_big_policy("own-3"), source="big.yaml", engine_id="e3")
        sc.set_policy(_big_policy("own-0b"), source="big.yaml", engine_id="e0")  # a known one may change
        ch, admin = await _admin(sc)
        async with ch:
            resp = await admin.ListPolicies(pb.ListPoliciesRequest())
        assert resp.truncated and resp.ByteSize() <= 128 * 1024
        assert resp.active[0].engine_id == "" and resp.active[0].name == "default"
        assert 1 <= len(resp.active) < 4 and resp.presets
    finally:
        await sc.stop(snapshot=False)


def test_a_huge_policy_file_is_refused_without_being_read(tmp_path: Path) -> None:
    """A 16 GiB (sparse) file: read whole first, this would exhaust memory; it is refused at 64 KiB."""
    big = tmp_path / "huge.yaml"
    with big.open("wb") as f:
        f.truncate(1 << 34)
    with pytest.raises(PolicyError, match=f"document larger than {MAX_DOCUMENT_BYTES} bytes"):
        resolve_policy_text(str(big))
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe" * 10)
    with pytest.raises(PolicyError, match="not UTF-8 text"):
        resolve_policy_text(str(binary))


def _class_step(i: int, form: str) -> pb.StepReport:
    """Step ``i``: one request of a class never seen before (rows, or packed columns as the plugin)."""
    s = step(t=float(i), accepted=[1])
    if form == "rows":
        s.requests[0].traffic_class = f"class-{i}"
        return s
    s.ClearField("requests")
    s.columns.CopyFrom(
        request_columns(request_ids=["r0"], classes=[f"class-{i}"], methods=["eagle3"], ks=[2], drafted=[2],
                        accepted=[1], packed=True)
    )  # fmt: skip
    return s


@pytest.mark.parametrize("form", ["rows", "packed"])
async def test_an_engine_naming_a_new_class_every_step_grows_nothing_beyond_the_cap(
    sidecar: Sidecar, form: str
) -> None:
    h = hello("classy")
    h.granularity = pb.GRANULARITY_REQUEST_METHOD  # classes are learnt per request
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h))
    try:
        await eng.directive()
        for b in range(4):  # 400 steps, each with a class never seen before
            eng.report(*(_class_step(b * 100 + j, form) for j in range(100)))
        await until(lambda: sidecar.engines()["classy"].loop.totals.steps == 400)  # nothing refused
        await until(lambda: sidecar.engines()["classy"].loop.rounds >= 1)
    finally:
        await eng.close()
    st = sidecar.engines()["classy"]
    assert len(st.classes) == MAX_CLASSES_PER_ENGINE and st.classes_pooled == 400 - (
        MAX_CLASSES_PER_ENGINE - 1
    )
    learned = {ctx.split("/", 1)[1] for ctx in st.loop.state_dict()["contexts"]}
    assert learned <= st.classes | {"*"} and len(learned) > 100  # learnt, up to the bound
    mix = st.loop.state_dict()["learner"]["mix"]
    assert all(set(m) <= st.classes for m in mix.values())


async def test_the_class_bound_holds_across_restarts(tmp_path: Path) -> None:
    # The classes an engine named count against its bound after a restart too: else every restart
    # let it add about 255 more (contexts, snapshot and status grew 257 -> 512 -> 767 -> 1022).
    seen: list[int] = []
    for run in range(3):
        sc = Sidecar(config=_config(tmp_path), registry=CollectorRegistry())
        await sc.start()
        try:
            if run == 0:
                sc.set_policy(preset_text("default"), source="preset:default")
            h = hello("classy")
            h.granularity = pb.GRANULARITY_REQUEST_METHOD  # classes are learnt per request
            eng = TestEngine(sc.engine_target, pb.EngineMessage(hello=h))
            try:
                await eng.directive()
                for b in range(3):  # 300 steps, each with a class never seen before
                    eng.report(*(_class_step(run * 1000 + b * 100 + j, "rows") for j in range(100)))
                st = sc.engines()["classy"]
                want, rounds = 300 * (run + 1), st.loop.rounds
                await until(lambda st=st, want=want: st.loop.totals.steps == want)
                await until(lambda st=st, rounds=rounds: st.loop.rounds > rounds)
            finally:
                await eng.close()
            st = sc.engines()["classy"]
            learned = {ctx.split("/", 1)[1] for ctx in st.loop.state_dict()["contexts"]} - {"*"}
            mix = st.loop.state_dict()["learner"]["mix"]
            seen.append(len(learned | {c for m in mix.values() for c in m}))
            assert len(st.classes) == MAX_CLASSES_PER_ENGINE
        finally:
            await sc.stop()  # a clean stop: the next run restores this one
    assert max(seen) <= MAX_CLASSES_PER_ENGINE, seen


def _long_method_hello(h: pb.Hello, name: str) -> None:
    h.arms.append(pb.Arm(method=name, k=1))


def _long_counterfactual_hello(h: pb.Hello, name: str) -> None:
    h.counterfactual_methods.append(name)


def _long_method_row(s: pb.StepReport, name: str) -> None:
    s.requests[0].method = name


def _long_counterfactual_row(s: pb.StepReport, name: str) -> None:
    s.requests[0].counterfactual_accepted[name] = 1


def _long_counterfactual_column(s: pb.StepReport, name: str) -> None:
    n = len(s.requests)
    s.CopyFrom(
        pb.StepReport(
            time_s=s.time_s,
            duration_s=s.duration_s,
            batch_size=n,
            columns=request_columns(
                request_ids=[r.request_id for r in s.requests],
                classes=["default"] * n,
                methods=["eagle3"] * n,
                ks=[2] * n,
                drafted=[2] * n,
                accepted=[1] * n,
            ),
        )
    )
    s.columns.counterfactual.add(method=name, accepted=[1] * n)


@pytest.mark.parametrize(
    ("hello_change", "step_change", "reason", "path"),
    [
        (_long_method_hello, None, "arm_invalid", "hello.arms[6].method: "),
        (_long_counterfactual_hello, None, "method_unknown", "hello.counterfactual_methods[0]: "),
        (None, _long_method_row, "method_unknown", "steps[0].requests[0].method: "),
        (
            None,
            _long_counterfactual_row,
            "counterfactual_method_unknown",
            "steps[0].requests[0].counterfactual",
        ),
        (
            None,
            _long_counterfactual_column,
            "counterfactual_method_unknown",
            "steps[0].columns.counterfactual[0]",
        ),
    ],
)
async def test_a_long_unknown_method_is_refused_by_name_in_a_short_message(
    sidecar: Sidecar,
    caplog: pytest.LogCaptureFixture,
    hello_change: Any,
    step_change: Any,
    reason: str,
    path: str,
) -> None:
    # The refusal quoted the engine's method name whole: a name of a few kilobytes made the status
    # message larger than gRPC's metadata limit, so the engine got RESOURCE_EXHAUSTED "Stream removed
    # (received metadata size exceeds hard limit)" instead of the reason and the place, and the
    # sidecar logged a line as long as the name.
    name = "x" * 100_000 + "\n"
    h = hello("e1")
    if hello_change is not None:
        hello_change(h, name)
    eng = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=h))
    try:
        if step_change is not None:
            await eng.directive()
            s = step(t=1.0, accepted=[1, 2])
            step_change(s, name)
            eng.out.put_nowait(_batch(1, s))
        with caplog.at_level(logging.WARNING):
            details = await _refused(eng)
    finally:
        await eng.close()
    assert details.startswith(f"{reason}: {path}") and len(details) < 500, details[:200]
    assert "\n" not in details
    [line] = [r.getMessage() for r in caplog.records if "rejected telemetry" in r.getMessage()]
    assert len(line) < 600
    if step_change is not None:
        assert sidecar.engines()["e1"].loop.totals.steps == 0
