"""Steps valid for their types but impossible for physics (helper 84): a measured step lasts at least
``MIN_STEP_S_PER_REQUEST`` per request it scheduled (``max(batch_size, rows)``), or the batch is refused
whole, naming ``steps[i].duration_s``, and nothing of it reaches the learner.

What must hold: a step of 64 requests that "lasted" 1 us (a round goodput of ~2e8 tok/s) is refused in
every wire form (rows, repeated columns, packed columns), alone or after valid steps, and the sidecar
applies none of its batch; durations exactly at the bound pass and the next double below fails; 0 (not
measured) passes at any batch; every realistic step (1e-4..10 s, batch 1..1024, K 0..15) passes; the
observe adapter's reports at real vLLM rates pass.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.observe import MAX_OBSERVED_BATCH, VllmCounters, _reports, observation_between
from controller.sidecar import Sidecar
from controller.v1 import controller_pb2 as pb
from controller.validation import (
    MIN_STEP_DURATION_S,
    MIN_STEP_S_PER_REQUEST,
    Limits,
    TelemetryError,
    read_batch,
    validate_hello,
)
from controller.wire.codec import request_columns, request_steps
from policies.arms import OFF, Arm, Method
from policies.engine import EngineInfo, Granularity

MAX_K = 15
ARMS = (*(Arm(Method.EAGLE3, k) for k in range(1, MAX_K + 1)), OFF)
ENGINE = EngineInfo("e1", "m", MAX_K, ARMS, Granularity.REQUEST_METHOD, 4096)
FORMS = ("rows", "columns", "packed")


def wire_step(
    n: int,
    duration_s: float,
    *,
    form: str = "rows",
    batch_size: int | None = None,
    k: int | list[int] = 2,
    accepted: list[int] | None = None,
) -> pb.StepReport:
    """A step of ``n`` eagle3 rows that accepted all their drafts (unless ``accepted`` says otherwise)."""
    ks = [k] * n if isinstance(k, int) else k
    kw: dict[str, Any] = dict(
        request_ids=[f"r{j}" for j in range(n)],
        classes=["default"] * n,
        methods=["eagle3" if kj else "off" for kj in ks],
        ks=ks,
        drafted=ks,
        accepted=ks if accepted is None else accepted,
    )
    size = n if batch_size is None else batch_size
    if form == "rows":
        return pb.StepReport(time_s=0.5, duration_s=duration_s, batch_size=size, requests=request_steps(**kw))
    cols = request_columns(**kw, packed=form == "packed")
    return pb.StepReport(time_s=0.5, duration_s=duration_s, batch_size=size, columns=cols)


def read(*steps: pb.StepReport) -> None:
    read_batch(pb.StepReportBatch(sequence=1, steps=steps), ENGINE, Limits())


def refused(*steps: pb.StepReport) -> TelemetryError:
    with pytest.raises(TelemetryError) as e:
        read(*steps)
    return e.value


def at_bound(scheduled: int) -> float:
    """The shortest duration a step of ``scheduled`` requests may report."""
    return max(MIN_STEP_DURATION_S, scheduled * MIN_STEP_S_PER_REQUEST)


@pytest.mark.parametrize("form", FORMS)
def test_64_requests_in_a_microsecond_are_refused_naming_the_field(form: str) -> None:
    # 64 x 3 tokens in 1 us: 1.9e8 tok/s, 2,000x the fastest real engine.
    e = refused(wire_step(64, 1e-6, form=form))
    assert e.reason == "duration_invalid"
    assert str(e).startswith("steps[0].duration_s: 1e-06 s for a batch of 64 requests"), str(e)
    assert f"at least {MIN_STEP_S_PER_REQUEST:g} s per request" in str(e)
    # After valid steps, in any form: the whole batch is refused, the bad step named.
    good = [wire_step(64, 0.02, form=f) for f in FORMS]
    e = refused(*good, wire_step(64, 1e-6, form=form))
    assert e.reason == "duration_invalid" and str(e).startswith("steps[3].duration_s: "), str(e)


@pytest.mark.parametrize("form", FORMS)
def test_requests_the_step_did_not_report_count_toward_its_floor(form: str) -> None:
    # Two rows reported of a batch of 4096: the learner credits all 4096 (reward x batch / duration).
    e = refused(wire_step(2, 1e-4, form=form, batch_size=4096))
    assert e.reason == "duration_invalid" and "a batch of 4096 requests" in str(e)
    read(wire_step(2, 4096 * MIN_STEP_S_PER_REQUEST, form=form, batch_size=4096))
    e = refused(pb.StepReport(time_s=0.5, duration_s=1e-6, batch_size=64))  # no rows at all
    assert str(e).startswith("steps[0].duration_s: ")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("scheduled", [1, 19, 20, 21, 64, 1000, 1024, 4096])
def test_the_bound_itself_passes_and_the_next_double_below_fails(form: str, scheduled: int) -> None:
    n = min(scheduled, 64)
    d = at_bound(scheduled)
    read(wire_step(n, d, form=form, batch_size=scheduled, k=MAX_K))
    e = refused(wire_step(n, math.nextafter(d, 0.0), form=form, batch_size=scheduled, k=MAX_K))
    assert e.reason == "duration_invalid" and str(e).startswith("steps[0].duration_s: "), str(e)
    read(wire_step(n, 0.0, form=form, batch_size=scheduled))  # not measured: counted, not learned from


def test_the_sidecar_applies_nothing_of_a_batch_with_an_impossible_step(tmp_path: Path) -> None:
    cfg = SidecarConfig(state_dir=str(tmp_path / "state"), max_policy_changes_per_s=1000.0)
    sc = Sidecar(config=cfg, registry=CollectorRegistry(), clock=lambda: 1_000.0)
    sc.open()
    try:
        hello = pb.Hello(
            engine_id="e1",
            model="m",
            max_k=MAX_K,
            arms=[pb.Arm(method="eagle3", k=k) for k in range(1, MAX_K + 1)] + [pb.Arm(method="off")],
            granularity=pb.GRANULARITY_REQUEST_METHOD,
            max_batch_size=4096,
            protocol_version=1,
        )
        s = sc.attach(validate_hello(hello))
        st_ = sc.engines()["e1"]
        before = json.dumps(st_.loop.state_dict(), sort_keys=True)
        bad = pb.StepReportBatch(sequence=1, steps=[wire_step(64, 0.02), wire_step(64, 1e-6)])
        with pytest.raises(TelemetryError):
            sc.ingest(s, bad)
        assert st_.loop.totals.steps == 0 and st_.last_sequence == 0 and st_.rejected == 1
        assert json.dumps(st_.loop.state_dict(), sort_keys=True) == before
        labels = {"reason": "duration_invalid"}
        assert sc.registry.get_sample_value("speccontrol_rejected_telemetry_total", labels) == 1.0
        # The refused batch is consumed (its resend is a duplicate); the next, with real durations, applies.
        sc.ingest(s, pb.StepReportBatch(sequence=2, steps=[wire_step(64, 0.02), wire_step(64, 0.021)]))
        assert st_.loop.totals.steps == 2 and st_.loop.totals.request_steps == 128
    finally:
        sc.close(snapshot=False)


@st.composite
def realistic_step(draw: st.DrawFn) -> pb.StepReport:
    """A step as real engines make them: 0.1 ms..10 s, batch 1..1024 (some rows reported), K 0..15."""
    size = draw(st.integers(1, 1024))
    n = draw(st.integers(0, min(size, 48)))
    ks = draw(st.lists(st.integers(0, MAX_K), min_size=n, max_size=n))
    acc = [draw(st.integers(0, kj)) for kj in ks]
    d = draw(st.floats(1e-4, 10.0))
    return wire_step(n, d, form=draw(st.sampled_from(FORMS)), batch_size=size, k=ks, accepted=acc)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(realistic_step(), min_size=1, max_size=6))
def test_every_realistic_step_passes(steps: list[pb.StepReport]) -> None:
    batch = read_batch(pb.StepReportBatch(sequence=1, steps=steps), ENGINE, Limits())
    assert batch.duration_s.tolist() == [s.duration_s for s in steps]


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(10.0, 1e6),  # request-steps per second: real vLLM engines make 1e2..1e5
    dt=st.sampled_from([1.0, 5.0, 60.0]),
    batch=st.integers(1, MAX_OBSERVED_BATCH),
    mean_accepted=st.floats(0.0, 4.0),
)
def test_what_the_observe_adapter_sends_at_real_rates_passes(
    rate: float, dt: float, batch: int, mean_accepted: float
) -> None:
    drafts = float(max(1, round(rate * dt)))
    cur = VllmCounters(
        time_s=dt,
        drafts=drafts,
        draft_tokens=4 * drafts,
        per_position=tuple(drafts * min(1.0, max(0.0, mean_accepted - i)) for i in range(4)),
        iterations=max(1.0, drafts / batch),
    )
    obs = observation_between(VllmCounters(time_s=0.0), cur, method=Method.EAGLE3, max_k=4)
    assert obs is not None
    engine = EngineInfo("e", "m", 4, (*ARMS[:4], OFF), Granularity.BATCH_STEP, MAX_OBSERVED_BATCH)
    read_batch(pb.StepReportBatch(sequence=1, steps=_reports(obs)), engine, Limits())


@settings(max_examples=200, deadline=None)
@given(
    drafts=st.floats(1.0, 1e9),
    dt=st.sampled_from([1e-3, 1.0, 5.0]),
    batch=st.integers(1, MAX_OBSERVED_BATCH),
)
def test_the_observe_adapter_refuses_an_interval_or_the_sidecar_takes_its_reports(
    drafts: float, dt: float, batch: int
) -> None:
    """Any interval: ``observation_between`` refuses it (saying so; the observer skips it) or its
    reports pass the sidecar's floors (10^4 drafts in 1 ms at batch 4,000 made reports the sidecar
    refused, which ended the observer instead of skipping the interval)."""
    cur = VllmCounters(
        time_s=dt,
        drafts=drafts,
        draft_tokens=4 * drafts,
        per_position=(drafts / 2,),
        iterations=drafts / batch,
    )
    try:
        obs = observation_between(VllmCounters(time_s=0.0), cur, method=Method.EAGLE3, max_k=4)
    except ValueError as e:
        assert "no engine verifies" in str(e) or "a batch of" in str(e), e
        return
    assert obs is not None
    engine = EngineInfo("e", "m", 4, (*ARMS[:4], OFF), Granularity.BATCH_STEP, MAX_OBSERVED_BATCH)
    read_batch(pb.StepReportBatch(sequence=1, steps=_reports(obs)), engine, Limits())
