from __future__ import annotations

import math

import pytest

from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, TelemetryError, validate_batch, validate_hello
from controller.wire.codec import request_steps
from policies.arms import Arm, Method
from policies.engine import EngineInfo

ENGINE = EngineInfo(
    engine_id="e1",
    model="m",
    max_k=4,
    arms=(Arm(Method.EAGLE3, 2), Arm(Method.EAGLE3, 4), Arm(Method.OFF, 0)),
    max_batch_size=64,
)


def hello(**kw: object) -> pb.Hello:
    base: dict[str, object] = dict(
        engine_id="e1",
        model="m",
        max_k=4,
        arms=[pb.Arm(method="eagle3", k=2), pb.Arm(method="off")],
        protocol_version=1,
    )
    base.update(kw)
    return pb.Hello(**base)  # type: ignore[arg-type]


def test_valid_hello() -> None:
    info = validate_hello(hello())
    assert (
        info.engine_id == "e1"
        and info.max_k == 4
        and info.arms == (Arm(Method.EAGLE3, 2), Arm(Method.OFF, 0))
    )


@pytest.mark.parametrize(
    ("kw", "reason", "fragment"),
    [
        ({"engine_id": ""}, "engine_id_missing", "hello.engine_id"),
        ({"engine_id": "x" * 129}, "engine_id_too_long", "hello.engine_id"),
        ({"max_k": 0}, "max_k_out_of_range", "hello.max_k"),
        ({"max_k": 65}, "max_k_out_of_range", "hello.max_k"),
        ({"arms": []}, "no_arms", "hello.arms"),
        ({"arms": [pb.Arm(method="medusa", k=2)]}, "arm_invalid", "hello.arms[0].method"),
        ({"arms": [pb.Arm(method="off"), pb.Arm(method="eagle3", k=5)]}, "k_gt_max", "hello.arms[1].k"),
        ({"arms": [pb.Arm(method="eagle3", k=0)]}, "arm_invalid", "hello.arms"),
        ({"protocol_version": 2}, "protocol_version", "hello.protocol_version"),
        ({"arms": [pb.Arm(method="p_eagle", k=2)]}, "no_arms", "no arm the engine can apply"),
    ],
)
def test_bad_hello(kw: dict[str, object], reason: str, fragment: str) -> None:
    with pytest.raises(TelemetryError) as e:
        validate_hello(hello(**kw))
    assert e.value.reason == reason
    assert fragment in str(e.value)


def step(**kw: object) -> pb.StepReport:
    reqs = kw.pop("requests", None)
    if reqs is None:
        reqs = request_steps(
            request_ids=["a", "b"],
            classes=["code", "chat"],
            methods=["eagle3", "eagle3"],
            ks=[2, 2],
            drafted=[2, 2],
            accepted=[1, 2],
        )
    base: dict[str, object] = dict(time_s=1.0, duration_s=0.02, batch_size=2, queue_wait_s=0.0, requests=reqs)
    base.update(kw)
    return pb.StepReport(**base)  # type: ignore[arg-type]


def req(**kw: object) -> pb.RequestStep:
    base: dict[str, object] = dict(
        request_id="r", traffic_class="default", method="eagle3", k=2, drafted=2, accepted=1
    )
    base.update(kw)
    return pb.RequestStep(**base)  # type: ignore[arg-type]


DEFAULT_LIMITS = Limits()


def check(*steps: pb.StepReport, limits: Limits = DEFAULT_LIMITS) -> None:
    validate_batch(pb.StepReportBatch(sequence=1, steps=steps), ENGINE, limits)


def test_valid_batch() -> None:
    check(
        step(),
        step(requests=[req(method="off", k=0, drafted=0, accepted=0)]),
        step(requests=[], batch_size=0),
    )


@pytest.mark.parametrize(
    ("bad", "reason", "where"),
    [
        (step(duration_s=math.nan), "duration_invalid", "steps[1].duration_s"),
        (step(time_s=-1.0), "time_invalid", "steps[1].time_s"),
        (step(queue_wait_s=math.inf), "queue_wait_invalid", "steps[1].queue_wait_s"),
        (
            step(requests=[req(), req(accepted=3, drafted=2)]),
            "accepted_gt_drafted",
            "steps[1].requests[1].accepted",
        ),
        (step(requests=[req(k=2, drafted=3, accepted=0)]), "drafted_gt_k", "steps[1].requests[0].drafted"),
        (step(requests=[req(k=5, drafted=1)]), "k_gt_max", "steps[1].requests[0].k"),
        (
            step(requests=[req(), req(method="off", k=4, drafted=4, accepted=4)]),
            "off_with_draft",
            "steps[1].requests[1].k",
        ),
        (step(requests=[req(method="medusa")]), "method_unknown", "steps[1].requests[0].method"),
        (step(requests=[req(method="ngram")]), "method_not_offered", "steps[1].requests[0].method"),
        (
            step(requests=[req(counterfactual_accepted={"bogus": 1})]),
            "counterfactual_method_unknown",
            "steps[1].requests[0].counterfactual_accepted",
        ),
        (
            step(requests=[req(counterfactual_accepted={"ngram": 9})]),
            "counterfactual_gt_max",
            "steps[1].requests[0].counterfactual_accepted[ngram]",
        ),
        (
            step(requests=[req(traffic_class="c" * 65)]),
            "traffic_class_too_long",
            "steps[1].requests[0].traffic_class",
        ),
        (step(batch_size=1), "batch_size_invalid", "steps[1].batch_size"),
        (step(batch_size=100_000), "batch_size_invalid", "steps[1].batch_size"),
    ],
)
def test_bad_step_reason_and_place(bad: pb.StepReport, reason: str, where: str) -> None:
    with pytest.raises(TelemetryError) as e:
        check(step(), bad)
    assert e.value.reason == reason
    assert str(e.value).startswith(where + ":"), str(e.value)


def test_limits() -> None:
    with pytest.raises(TelemetryError) as e:
        check(step(), step(), limits=Limits(max_steps_per_batch=1))
    assert e.value.reason == "too_many_steps"
    with pytest.raises(TelemetryError) as e:
        check(step(), limits=Limits(max_requests_per_step=1))
    assert e.value.reason == "too_many_requests"
    assert str(e.value).startswith("steps[0].requests: 2 requests exceed the limit 1")
