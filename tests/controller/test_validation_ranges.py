"""Physical ranges at the edge (issue 15, findings 1, 4 and 6): every numeric field of a report and
every string and list of a Hello has a bound, checked before anything reaches the learner, with an
error naming the field. The cases the hostile-input pass found are here by value."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb
from controller.validation import (
    MAX_BATCH_SIZE,
    MAX_DROPPED_STEPS,
    MAX_SEQUENCE,
    MAX_STEP_DURATION_S,
    MIN_STEP_DURATION_S,
    Limits,
    TelemetryError,
    check_batch_header,
    escape_text,
    validate_batch,
    validate_hello,
)
from policies.loop import ControlLoop
from policies.observation import StepBatch
from policies.presets import preset_text
from policies.spec import parse_policy
from tests.controller.test_validation import ENGINE, check, hello, req, step
from tests.controller.test_validation_columns import cols
from tests.controller.test_validation_columns import step as col_step

U64_MAX = (1 << 64) - 1
GOODPUT_MODEL = preset_text("default")  # the goodput model, per class


@pytest.mark.parametrize(
    ("kw", "reason", "path"),
    [
        ({"duration_s": 1e154}, "duration_invalid", "steps[0].duration_s"),
        ({"duration_s": 5e-324}, "duration_invalid", "steps[0].duration_s"),
        ({"duration_s": MAX_STEP_DURATION_S * 1.001}, "duration_invalid", "steps[0].duration_s"),
        ({"duration_s": math.inf}, "duration_invalid", "steps[0].duration_s"),
        ({"duration_s": -0.01}, "duration_invalid", "steps[0].duration_s"),
        ({"time_s": 1e300}, "time_invalid", "steps[0].time_s"),
        ({"time_s": math.nan}, "time_invalid", "steps[0].time_s"),
        ({"queue_wait_s": 1e20}, "queue_wait_invalid", "steps[0].queue_wait_s"),
        ({"queue_length": (1 << 32) - 1}, "queue_length_invalid", "steps[0].queue_length"),
        ({"directive_version": U64_MAX}, "directive_version_invalid", "steps[0].directive_version"),
        ({"prefill_tokens": (1 << 32) - 1}, "prefill_tokens_invalid", "steps[0].prefill_tokens"),
        ({"batch_size": (1 << 32) - 1}, "batch_size_invalid", "steps[0].batch_size"),
    ],
)
def test_step_numbers_out_of_physical_range(kw: dict[str, object], reason: str, path: str) -> None:
    for make in (step, col_step):  # rows and columns share the step's own fields
        with pytest.raises(TelemetryError) as e:
            check(make(**kw))
        assert e.value.reason == reason
        assert str(e.value).startswith(f"{path}: "), str(e.value)


@pytest.mark.parametrize(
    "kw",
    [
        {"duration_s": 0.0},  # not measured: counted, not learned from
        {"duration_s": MIN_STEP_DURATION_S},
        {"duration_s": MAX_STEP_DURATION_S},
        {"directive_version": MAX_SEQUENCE},
        {"queue_length": 100_000},
    ],
)
def test_range_edges_that_are_physical_pass(kw: dict[str, object]) -> None:
    check(step(**kw))


@pytest.mark.parametrize(
    ("batch", "reason", "path"),
    [
        (pb.StepReportBatch(sequence=U64_MAX), "sequence_out_of_range", "reports.sequence"),
        (pb.StepReportBatch(sequence=MAX_SEQUENCE + 1), "sequence_out_of_range", "reports.sequence"),
        (
            pb.StepReportBatch(sequence=1, dropped_steps=U64_MAX),
            "dropped_steps_out_of_range",
            "reports.dropped_steps",
        ),
        (
            pb.StepReportBatch(sequence=1, dropped_steps=MAX_DROPPED_STEPS + 1),
            "dropped_steps_out_of_range",
            "reports.dropped_steps",
        ),
    ],
)
def test_batch_counters_out_of_range(batch: pb.StepReportBatch, reason: str, path: str) -> None:
    for fn in (check_batch_header, lambda b: validate_batch(b, ENGINE, Limits())):
        with pytest.raises(TelemetryError) as e:
            fn(batch)
        assert e.value.reason == reason and str(e.value).startswith(path)
    check_batch_header(pb.StepReportBatch(sequence=MAX_SEQUENCE, dropped_steps=MAX_DROPPED_STEPS))


@pytest.mark.parametrize(
    ("kw", "reason", "path"),
    [
        ({"model": "m" * 2_500_000}, "model_too_long", "hello.model"),
        ({"engine_version": "v" * 10_000}, "engine_version_too_long", "hello.engine_version"),
        ({"arms": [pb.Arm(method="off")] * 300}, "too_many_arms", "hello.arms"),
        (
            {"counterfactual_methods": ["ngram"] * 9},
            "too_many_counterfactual_methods",
            "hello.counterfactual_methods",
        ),
        ({"max_batch_size": (1 << 32) - 1}, "max_batch_size_out_of_range", "hello.max_batch_size"),
        ({"max_batch_size": MAX_BATCH_SIZE + 1}, "max_batch_size_out_of_range", "hello.max_batch_size"),
        ({"engine_id": "e1\nWARNING forged"}, "control_characters", "hello.engine_id"),
        ({"engine_id": "e\x001"}, "control_characters", "hello.engine_id"),
        ({"model": "m\r"}, "control_characters", "hello.model"),
        ({"instance_id": "i\u2028"}, "control_characters", "hello.instance_id"),
        ({"engine_version": "\x1b[31mred"}, "control_characters", "hello.engine_version"),
        # A right-to-left override: "pod-\u202eevil" shows as "pod-live" in a log or a table.
        ({"engine_id": "pod-\u202eevil"}, "control_characters", "hello.engine_id"),
    ],
)
def test_hello_strings_and_lists_are_bounded(kw: dict[str, object], reason: str, path: str) -> None:
    with pytest.raises(TelemetryError) as e:
        validate_hello(hello(**kw))
    assert e.value.reason == reason and str(e.value).startswith(f"{path}: ")
    assert "\n" not in str(e.value) and "\x00" not in str(e.value)


def test_traffic_classes_with_control_characters_are_refused_in_both_forms() -> None:
    with pytest.raises(TelemetryError) as e:
        check(step(requests=[req(traffic_class="a\nb")]))
    assert e.value.reason == "control_characters"
    assert str(e.value).startswith("steps[0].requests[0].traffic_class: ")
    with pytest.raises(TelemetryError) as e:
        check(col_step(c=cols(classes=["ok", "x\x00"], traffic_class=[0, 1])))
    assert e.value.reason == "control_characters"
    assert str(e.value).startswith("steps[0].columns.classes[1]: ")


def test_escape_text_leaves_printable_text_and_escapes_the_rest() -> None:
    assert escape_text("chat/code é 日本") == "chat/code é 日本"
    assert escape_text("a\nb\x00c\u2028") == "a\\nb\\x00c\\u2028"


@settings(max_examples=200, deadline=None)
@given(
    durations=st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=8),
    accepted=st.integers(0, 2),
)
def test_any_duration_is_refused_by_name_or_leaves_the_learner_finite(
    durations: list[float], accepted: int
) -> None:
    """Whatever doubles an engine sends as durations: either the batch is refused naming the field,
    or the goodput model learns from it and its estimates and state stay finite (JSON-safe)."""
    batch = pb.StepReportBatch(
        sequence=1,
        steps=[step(duration_s=d, requests=[req(accepted=accepted), req(accepted=2)]) for d in durations],
    )
    try:
        observations = validate_batch(batch, ENGINE, Limits())
    except TelemetryError as e:
        assert e.reason == "duration_invalid" and ".duration_s: " in str(e)
        assert any(not (d == 0 or MIN_STEP_DURATION_S <= d <= MAX_STEP_DURATION_S) for d in durations)
        return
    loop = ControlLoop(spec=parse_policy(GOODPUT_MODEL), engine=ENGINE, seed=1)
    loop.observe(StepBatch(steps=observations))
    loop.decide(10.0)
    for est in loop.estimates().values():
        assert all(np.isfinite(v) for v in est.values())
    json.dumps(loop.state_dict(), allow_nan=False)
