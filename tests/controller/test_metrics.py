from __future__ import annotations

import math
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from controller.metrics import MetricsServer, SidecarMetrics
from policies.arms import Arm, Method
from policies.observation import StepBatch, StepObservation


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def obs(**kw: object) -> StepObservation:
    base: dict[str, object] = dict(
        time_s=1.0,
        duration_s=0.05,
        traffic_class=["a", "a", "b"],
        method=[Method.EAGLE3, Method.EAGLE3, Method.NGRAM],
        k=[2, 2, 4],
        drafted=[2, 2, 4],
        accepted=[2, 0, 3],
        queue_length=7,
        queue_wait_s=0.3,
    )
    base.update(kw)
    return StepObservation.build(**base)  # type: ignore[arg-type]


def test_token_counters_and_ratios_are_exact() -> None:
    reg = CollectorRegistry()
    m = SidecarMetrics(registry=reg, clock=Clock())
    m.set_connected("e1", True)
    m.observe("e1", StepBatch.of(obs()))
    m.observe("e1", StepBatch.of(obs(accepted=[1, 1, 4], queue_wait_s=0.1, queue_length=2)))
    e3 = {"engine": "e1", "method": "eagle3", "k": "2"}
    ng = {"engine": "e1", "method": "ngram", "k": "4"}
    assert reg.get_sample_value("speccontrol_drafted_tokens_total", e3) == 8
    assert reg.get_sample_value("speccontrol_accepted_tokens_total", e3) == 4
    assert reg.get_sample_value("speccontrol_emitted_tokens_total", e3) == 8
    assert reg.get_sample_value("speccontrol_request_steps_total", e3) == 4
    assert reg.get_sample_value("speccontrol_acceptance_rate", e3) == 0.5
    assert reg.get_sample_value("speccontrol_mean_accepted_per_step", e3) == 1.0
    assert reg.get_sample_value("speccontrol_acceptance_rate", ng) == 7 / 8
    assert reg.get_sample_value("speccontrol_mean_accepted_per_step", ng) == 3.5
    assert reg.get_sample_value("speccontrol_engine_steps_total", {"engine": "e1"}) == 2
    # goodput: (5 + 3) + (6 + 3) tokens over 0.1 s of engine time
    assert reg.get_sample_value("speccontrol_goodput_tokens_per_second", {"engine": "e1"}) == 17 / 0.1
    assert reg.get_sample_value("speccontrol_queue_wait_seconds", {"engine": "e1"}) == (0.3 + 0.1) / 2
    assert reg.get_sample_value("speccontrol_queue_length", {"engine": "e1"}) == 2
    assert m.recent_goodput("e1") == 17 / 0.1


def test_arm_directive_age_and_connection_gauges() -> None:
    reg = CollectorRegistry()
    clock = Clock()
    m = SidecarMetrics(registry=reg, clock=clock)
    m.set_connected("e1", True)
    m.set_directive(
        "e1", version=7, issued_at=990.0, arms={"1/*": Arm(Method.EAGLE3, 3), "2-4/*": Arm(Method.OFF, 0)}
    )
    assert reg.get_sample_value("speccontrol_engines_connected") == 1
    assert reg.get_sample_value("speccontrol_directive_version", {"engine": "e1"}) == 7
    assert reg.get_sample_value("speccontrol_directive_age_seconds", {"engine": "e1"}) == 10.0
    clock.t = 1002.5
    assert reg.get_sample_value("speccontrol_directive_age_seconds", {"engine": "e1"}) == 12.5
    cur = {"engine": "e1", "context": "1/*", "method": "eagle3", "k": "3"}
    assert reg.get_sample_value("speccontrol_current_arm", cur) == 1
    assert reg.get_sample_value("speccontrol_current_k", {"engine": "e1", "context": "2-4/*"}) == 0
    # A new decision replaces the arm series instead of leaving the old one behind.
    m.set_directive("e1", version=8, issued_at=1002.0, arms={"1/*": Arm(Method.NGRAM, 4)})
    assert reg.get_sample_value("speccontrol_current_arm", cur) is None
    assert reg.get_sample_value("speccontrol_current_k", {"engine": "e1", "context": "2-4/*"}) is None
    m.set_connected("e1", False)
    assert reg.get_sample_value("speccontrol_engines_connected") == 0


def test_a_detached_engine_keeps_its_counters_and_exports_no_gauges() -> None:
    # An engine that went away overloaded must not keep reporting its last queue wait (the fleet
    # scales on the max of it) nor a directive age that grows while it is down.
    reg = CollectorRegistry()
    clock = Clock()
    m = SidecarMetrics(registry=reg, clock=clock)
    m.set_connected("e1", True)
    m.observe("e1", StepBatch.of(obs(queue_wait_s=12.0, queue_length=40)))
    m.set_directive("e1", version=3, issued_at=999.0, arms={"1/*": Arm(Method.EAGLE3, 3)})
    e1 = {"engine": "e1"}
    gauges = ("goodput_tokens_per_second", "queue_wait_seconds", "queue_length", "directive_version",
              "directive_age_seconds")  # fmt: skip
    assert all(reg.get_sample_value(f"speccontrol_{g}", e1) is not None for g in gauges)
    m.set_connected("e1", False)
    clock.t = 4600.0
    assert [g for g in gauges if reg.get_sample_value(f"speccontrol_{g}", e1) is not None] == []
    assert reg.get_sample_value("speccontrol_current_k", {"engine": "e1", "context": "1/*"}) is None
    assert reg.get_sample_value("speccontrol_engine_steps_total", e1) == 1  # counters stay
    assert reg.get_sample_value("speccontrol_engines_connected") == 0
    m.set_connected("e1", True)  # re-attached: what it reports from now on
    assert reg.get_sample_value("speccontrol_queue_wait_seconds", e1) is None
    assert reg.get_sample_value("speccontrol_queue_length", e1) == 0
    m.observe("e1", StepBatch.of(obs(queue_wait_s=0.5, queue_length=2)))
    assert reg.get_sample_value("speccontrol_queue_wait_seconds", e1) == 0.5


def test_plain_counters() -> None:
    reg = CollectorRegistry()
    m = SidecarMetrics(registry=reg, clock=Clock())
    m.rejected.labels("accepted_gt_drafted").inc()
    m.decisions.labels("e1").inc(3)
    m.switches.labels("e1").inc()
    m.snapshot_failures.inc()
    m.last_snapshot.set(123.0)
    assert (
        reg.get_sample_value("speccontrol_rejected_telemetry_total", {"reason": "accepted_gt_drafted"}) == 1
    )
    assert reg.get_sample_value("speccontrol_decisions_total", {"engine": "e1"}) == 3
    assert reg.get_sample_value("speccontrol_switches_total", {"engine": "e1"}) == 1
    assert reg.get_sample_value("speccontrol_snapshot_failures_total") == 1
    assert reg.get_sample_value("speccontrol_last_snapshot_timestamp_seconds") == 123.0


def test_registries_are_independent() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    SidecarMetrics(registry=a, clock=Clock()).observe("e1", StepBatch.of(obs()))
    SidecarMetrics(registry=b, clock=Clock())
    assert a.get_sample_value("speccontrol_engine_steps_total", {"engine": "e1"}) == 1
    assert b.get_sample_value("speccontrol_engine_steps_total", {"engine": "e1"}) is None


def test_http_server_on_ephemeral_port() -> None:
    reg = CollectorRegistry()
    SidecarMetrics(registry=reg, clock=Clock()).observe("e1", StepBatch.of(obs()))
    srv = MetricsServer(registry=reg, host="127.0.0.1", port=0)
    url = srv.start()
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        assert not url.startswith("http://127.0.0.1:0/")
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        assert 'speccontrol_engine_steps_total{engine="e1"} 1.0' in text
    finally:
        srv.stop()


def test_policy_guard_events_are_exported_per_engine_and_kind() -> None:
    reg = CollectorRegistry()
    m = SidecarMetrics(registry=reg, clock=lambda: 0.0)
    m.set_guards("e1", {"drift_alarm": 2, "held_by_margin": 5, "exploration_denied": 0, "tpot_trip": 1})
    assert (
        reg.get_sample_value(
            "speccontrol_policy_guard_events_total", {"engine": "e1", "guard": "drift_alarm"}
        )
        == 2
    )
    assert (
        reg.get_sample_value("speccontrol_policy_guard_events_total", {"engine": "e1", "guard": "tpot_trip"})
        == 1
    )
    m.set_guards("e1", {"drift_alarm": 3})
    assert (
        reg.get_sample_value(
            "speccontrol_policy_guard_events_total", {"engine": "e1", "guard": "drift_alarm"}
        )
        == 3
    )


def samples(reg: CollectorRegistry) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for m in reg.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    )


def test_a_report_batch_gives_the_samples_of_its_steps_one_by_one() -> None:
    batch = [
        obs(),
        obs(traffic_class=[], method=[], k=[], drafted=[], accepted=[], queue_length=1),  # an empty step
        obs(accepted=[1, 1, 4], queue_wait_s=0.1, queue_length=2),
        obs(traffic_class=["a"], method=[Method.OFF], k=[0], drafted=[0], accepted=[0], duration_s=0.0),
    ]
    one, many = CollectorRegistry(), CollectorRegistry()
    m1, m2 = SidecarMetrics(registry=one, clock=Clock()), SidecarMetrics(registry=many, clock=Clock())
    for o in batch:
        m1.observe("e1", StepBatch.of(o))
    m2.observe("e1", StepBatch(steps=batch))
    m2.observe("e1", StepBatch(steps=[]))
    assert samples(one) == samples(many)
    assert (
        many.get_sample_value("speccontrol_request_steps_total", {"engine": "e1", "method": "off", "k": "0"})
        == 1
    )
    assert many.get_sample_value("speccontrol_engine_steps_total", {"engine": "e1"}) == 4
    # (8 + 0 + 9) tokens over three steps of 0.05 s (the empty one included, as step by step); the
    # last step was not measured (duration 0): its token has no time to go over.
    assert m2.recent_goodput("e1") == m1.recent_goodput("e1") == 17 / (0.05 + 0.05 + 0.05)


def test_goodput_leaves_out_unmeasured_steps() -> None:
    # duration_s 0 is "not measured" (controller.validation): its tokens have no engine time to go
    # over. Counted over the measured steps' time they inflated goodput (here 2x); with no measured
    # step at all the gauge read 0 tokens/s for an engine that emits.
    reg = CollectorRegistry()
    m = SidecarMetrics(registry=reg, clock=Clock())
    m.set_connected("e1", True)
    e1 = {"engine": "e1"}
    m.observe("e1", StepBatch.of(obs(duration_s=0.0)))
    assert reg.get_sample_value("speccontrol_goodput_tokens_per_second", e1) is None
    assert reg.get_sample_value("speccontrol_queue_wait_seconds", e1) == 0.3  # the step still counts
    assert m.recent_goodput("e1") == 0.0
    m.observe("e1", StepBatch.of(obs(duration_s=0.05)))  # 5 + 3 tokens in 0.05 s
    assert reg.get_sample_value("speccontrol_goodput_tokens_per_second", e1) == 8 / 0.05
    assert m.recent_goodput("e1") == 8 / 0.05


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.0, 1e-6, 0.02, 3600.0]),
            st.lists(st.integers(0, 4), min_size=0, max_size=8),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_goodput_is_finite_and_is_tokens_of_measured_steps_over_their_time(
    steps: list[tuple[float, list[int]]],
) -> None:
    reg = CollectorRegistry()
    m = SidecarMetrics(registry=reg, clock=Clock())
    m.set_connected("e1", True)
    for duration, accepted in steps:
        n = len(accepted)
        m.observe(
            "e1",
            StepBatch.of(
                obs(
                    duration_s=duration,
                    traffic_class=["a"] * n,
                    method=[Method.EAGLE3] * n,
                    k=[4] * n,
                    drafted=[4] * n,
                    accepted=accepted,
                )
            ),
        )
    measured = [(d, a) for d, a in steps if d > 0]
    got = reg.get_sample_value("speccontrol_goodput_tokens_per_second", {"engine": "e1"})
    if not measured:
        assert got is None
        return
    want = sum(len(a) + sum(a) for _, a in measured) / sum(d for d, _ in measured)
    assert got is not None and math.isfinite(got) and got == pytest.approx(want, rel=1e-12)


def test_forget_engine_removes_every_series_of_the_engine() -> None:
    reg = CollectorRegistry()
    m = SidecarMetrics(registry=reg, clock=Clock())
    for eid in ("gone", "kept"):
        m.set_connected(eid, True)
        m.observe(eid, StepBatch.of(obs()))
        m.set_directive(eid, version=1, issued_at=999.0, arms={"1/*": Arm(Method.EAGLE3, 3)})
        m.set_guards(eid, {"drift_alarm": 1})
        for counter in (m.decisions, m.switches, m.duplicates, m.lost_batches, m.engine_dropped):
            counter.labels(eid).inc()
    before = {dict(labels).get("engine") for _, labels, _ in samples(reg)}
    m.forget_engine("gone")
    after = {dict(labels).get("engine") for _, labels, _ in samples(reg)}
    assert before == {"gone", "kept", None} and after == {"kept", None}
    kept = [x for x in samples(reg) if dict(x[1]).get("engine") == "kept"]
    names = {name for name, _, _ in kept}
    assert len(names) == 20, sorted(names)  # every per-engine family, still there for the other one


@pytest.mark.parametrize("engine_id", ['quo"te', "back\\slash\\n", "ünï-cøde ✓", "日本語/e 1", "{}=,"])
def test_label_values_round_trip_through_the_metrics_page(engine_id: str) -> None:
    # What a scraper reads back is the engine id as it connected (quotes and backslashes escaped
    # on the page, not doubled); a context's control character arrives escaped, on one line.
    reg = CollectorRegistry()
    m = SidecarMetrics(registry=reg, clock=Clock())
    m.set_connected(engine_id, True)
    m.observe(engine_id, StepBatch.of(obs()))
    m.set_directive(engine_id, version=1, issued_at=999.0, arms={"a\nb": Arm(Method.NGRAM, 4)})
    srv = MetricsServer(registry=reg, host="127.0.0.1", port=0)
    url = srv.start()
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    finally:
        srv.stop()
    read = {
        (s.name, tuple(sorted(s.labels.items())))
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert ("speccontrol_engine_steps_total", (("engine", engine_id),)) in read
    assert ("speccontrol_current_k", (("context", "a\\nb"), ("engine", engine_id))) in read
