"""Validation of the columnar step form (StepReport.columns): the same rules as rows, a field path each."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, TelemetryError, read_batch, validate_batch
from controller.wire.codec import observation_from_pb, request_columns
from policies.arms import METHOD_CODES, Arm, Method
from policies.engine import EngineInfo
from policies.observation import StepBatch, StepObservation

ENGINE = EngineInfo(
    engine_id="e1",
    model="m",
    max_k=4,
    arms=(Arm(Method.EAGLE3, 2), Arm(Method.EAGLE3, 4), Arm(Method.OFF, 0)),
    max_batch_size=64,
)


def cols(**kw: object) -> pb.RequestColumns:
    """Two valid requests, with the given columns replaced."""
    c = request_columns(
        request_ids=["a", "b"],
        classes=["code", "chat"],
        methods=["eagle3", "eagle3"],
        ks=[2, 2],
        drafted=[2, 2],
        accepted=[1, 2],
        finished=[False, True],
    )
    for name, value in kw.items():
        c.ClearField(name)  # type: ignore[arg-type]
        getattr(c, name).extend(value)
    return c


def step(c: pb.RequestColumns | None = None, **kw: object) -> pb.StepReport:
    base: dict[str, object] = dict(
        time_s=1.0, duration_s=0.02, batch_size=2, columns=c if c is not None else cols()
    )
    base.update(kw)
    return pb.StepReport(**base)  # type: ignore[arg-type]


DEFAULT_LIMITS = Limits()


def check(*steps: pb.StepReport, limits: Limits = DEFAULT_LIMITS) -> None:
    validate_batch(pb.StepReportBatch(sequence=1, steps=steps), ENGINE, limits)


def packed(c: pb.RequestColumns) -> pb.RequestColumns:
    """The same columns in the packed form (protocol 2): the integer columns as one byte string."""
    n = len(c.k)
    if not n:
        return c
    out = pb.RequestColumns()
    out.CopyFrom(c)
    rows = [list(getattr(c, f)) for f in ("traffic_class", "method", "k", "drafted", "accepted")]
    if len(c.ngram_proposal):
        rows.append(list(c.ngram_proposal))
        out.packed_ngram_proposal = True
    if len(c.finished):
        rows.append([int(x) for x in c.finished])
        out.packed_finished = True
    for f in ("traffic_class", "method", "k", "drafted", "accepted", "finished", "ngram_proposal"):
        out.ClearField(f)  # type: ignore[arg-type]
    out.packed = np.array(rows, dtype="<u4").tobytes()
    out.count = n
    return out


def cf(method: str, values: list[int]) -> pb.CounterfactualColumn:
    return pb.CounterfactualColumn(method=method, accepted=values)


def test_valid_columns() -> None:
    check(
        step(),
        step(cols(request_id=[], finished=[])),  # ids and finished are optional columns
        step(cols(method=[METHOD_CODES[Method.OFF]] * 2, k=[0, 0], drafted=[0, 0], accepted=[0, 0])),
        step(cols(counterfactual=[cf("ngram", [-1, 4])])),
        step(pb.RequestColumns(), batch_size=0),
    )


@pytest.mark.parametrize(
    ("bad", "reason", "where"),
    [
        (step(cols(accepted=[1, 3])), "accepted_gt_drafted", "steps[1].columns.accepted[1]"),
        (step(cols(k=[2, 2], drafted=[2, 3])), "drafted_gt_k", "steps[1].columns.drafted[1]"),
        (step(cols(k=[5, 2], drafted=[1, 2])), "k_gt_max", "steps[1].columns.k[0]"),
        (
            step(cols(method=[0, METHOD_CODES[Method.OFF]], k=[2, 4], drafted=[2, 4], accepted=[1, 4])),
            "off_with_draft",
            "steps[1].columns.k[1]",
        ),
        (
            step(cols(method=[0, METHOD_CODES[Method.OFF]], k=[2, 3], drafted=[2, 0], accepted=[1, 0])),
            "off_with_draft",
            "steps[1].columns.k[1]",
        ),
        (step(cols(method=[0, 9])), "method_unknown", "steps[1].columns.method[1]"),
        (
            step(cols(method=[METHOD_CODES[Method.NGRAM], 0])),
            "method_not_offered",
            "steps[1].columns.method[0]",
        ),
        (step(cols(traffic_class=[0, 2])), "traffic_class_invalid", "steps[1].columns.traffic_class[1]"),
        (step(cols(classes=["c" * 65, "chat"])), "traffic_class_too_long", "steps[1].columns.classes[0]"),
        (step(cols(request_id=["a", "r" * 257])), "request_id_too_long", "steps[1].columns.request_id[1]"),
        (step(cols(method=[0])), "columns_length", "steps[1].columns.method"),
        (step(cols(traffic_class=[])), "columns_length", "steps[1].columns.traffic_class"),
        (step(cols(finished=[True])), "columns_length", "steps[1].columns.finished"),
        (step(cols(request_id=["a"])), "columns_length", "steps[1].columns.request_id"),
        (
            step(cols(counterfactual=[cf("bogus", [1, 1])])),
            "counterfactual_method_unknown",
            "steps[1].columns.counterfactual[0].method",
        ),
        (
            step(cols(counterfactual=[cf("off", [1, 1])])),
            "counterfactual_method_unknown",
            "steps[1].columns.counterfactual[0].method",
        ),
        (
            step(cols(counterfactual=[cf("ngram", [1, 1]), cf("ngram", [1, 1])])),
            "counterfactual_method_repeated",
            "steps[1].columns.counterfactual[1].method",
        ),
        (
            step(cols(counterfactual=[cf("ngram", [1])])),
            "columns_length",
            "steps[1].columns.counterfactual[0].accepted",
        ),
        (
            step(cols(counterfactual=[cf("ngram", [1, 9])])),
            "counterfactual_gt_max",
            "steps[1].columns.counterfactual[0].accepted[1]",
        ),
        (
            step(cols(counterfactual=[cf("ngram", [-2, 1])])),
            "counterfactual_invalid",
            "steps[1].columns.counterfactual[0].accepted[0]",
        ),
        (step(batch_size=1), "batch_size_invalid", "steps[1].batch_size"),
    ],
)
def test_bad_columns_reason_and_place(bad: pb.StepReport, reason: str, where: str) -> None:
    with pytest.raises(TelemetryError) as e:
        check(step(), bad)
    assert e.value.reason == reason
    assert str(e.value).startswith(where + ":"), str(e.value)


def test_a_step_with_both_forms_is_refused() -> None:
    both = step()
    both.requests.add(request_id="x", traffic_class="code", method="eagle3", k=2, drafted=2, accepted=1)
    with pytest.raises(TelemetryError) as e:
        check(both)
    assert e.value.reason == "requests_and_columns"
    assert str(e.value).startswith("steps[0].columns:")


def test_requests_per_step_limit_counts_columns() -> None:
    with pytest.raises(TelemetryError) as e:
        check(step(), limits=Limits(max_requests_per_step=1))
    assert e.value.reason == "too_many_requests"
    assert str(e.value).startswith("steps[0].columns: 2 requests exceed the limit 1")


U32 = st.integers(0, 2**32 - 1)
SMALL = st.integers(0, 6)


@st.composite
def random_columns(draw: st.DrawFn) -> pb.RequestColumns:
    n = draw(st.integers(0, 6))

    def col(values: st.SearchStrategy[int]) -> list[int]:
        return draw(st.lists(values, min_size=n, max_size=n) | st.lists(values, max_size=7))

    c = pb.RequestColumns(
        request_id=draw(st.lists(st.text(max_size=3), min_size=n, max_size=n) | st.just([])),
        classes=draw(st.lists(st.sampled_from(["", "code", "chat", "c" * 65]), max_size=3)),
        traffic_class=col(SMALL | U32),
        method=col(SMALL | U32),
        k=draw(st.lists(SMALL | U32, min_size=n, max_size=n)),
        drafted=col(SMALL | U32),
        accepted=col(SMALL | U32),
        counterfactual=draw(
            st.lists(
                st.builds(
                    pb.CounterfactualColumn,
                    method=st.sampled_from(["ngram", "eagle3", "off", "bogus"]),
                    accepted=st.lists(st.integers(-3, 6) | st.integers(-(2**31), 2**31 - 1), max_size=7),
                ),
                max_size=2,
            )
        ),
        finished=draw(st.lists(st.booleans(), min_size=n, max_size=n) | st.just([])),
    )
    # Or the packed form (protocol 2): well formed, or with its length, count, flags or a repeated
    # column beside it wrong.
    form = draw(st.sampled_from(["repeated", "packed", "broken"]))
    if form == "repeated":
        return c
    proposals, finished = draw(st.booleans()), draw(st.booleans())
    count = n if form == "packed" else draw(st.integers(0, 7))
    width = (5 + proposals + finished) * count
    data = np.array(draw(st.lists(SMALL | U32, min_size=width, max_size=width)), dtype="<u4").tobytes()
    if form == "broken":
        data = data[: draw(st.integers(0, len(data)))]
    out = pb.RequestColumns(
        request_id=c.request_id,
        classes=c.classes,
        counterfactual=c.counterfactual,
        packed=data,
        count=count,
        packed_ngram_proposal=proposals,
        packed_finished=finished,
    )
    if form == "broken" and draw(st.booleans()):
        out.k.extend(c.k)  # both forms at once
    return out


@settings(max_examples=200, deadline=None)
@given(random_columns())
def test_any_columns_are_accepted_as_converted_or_refused_with_a_place(c: pb.RequestColumns) -> None:
    s = step(c, batch_size=0)
    try:
        (obs,) = validate_batch(pb.StepReportBatch(sequence=1, steps=[s]), ENGINE, DEFAULT_LIMITS)
    except TelemetryError as e:
        assert e.reason and "\n" not in str(e) and str(e).startswith("steps[0].")
        return
    ref = observation_from_pb(s)  # what a valid step converts to without validation
    assert obs.traffic_class == ref.traffic_class and obs.request_id == ref.request_id
    for name in ("method", "k", "drafted", "accepted", "finished"):
        assert np.array_equal(getattr(obs, name), getattr(ref, name)), name
    assert obs.counterfactual.keys() == ref.counterfactual.keys()
    assert all(np.array_equal(obs.counterfactual[m], ref.counterfactual[m]) for m in obs.counterfactual)
    assert (obs.k <= ENGINE.max_k).all() and (obs.accepted <= obs.drafted).all()
    assert (obs.k[obs.method == METHOD_CODES[Method.OFF]] == 0).all()  # "off" drafts nothing


def step_by_step(steps: list[pb.StepReport]) -> list[StepObservation] | tuple[str, str]:
    """What checking each step on its own (a batch of one) gives: the observations, or the first error
    (named at the step's place in the whole batch)."""
    out = []
    for i, s in enumerate(steps):
        try:
            out += validate_batch(pb.StepReportBatch(sequence=1, steps=[s]), ENGINE, DEFAULT_LIMITS)
        except TelemetryError as e:
            return e.reason, str(e).replace("steps[0].", f"steps[{i}].", 1)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(random_columns(), max_size=4), st.integers(0, 4), st.integers(0, 3))
def test_a_batch_is_checked_as_its_steps_one_by_one(
    columns: list[pb.RequestColumns], with_rows: int, bad_time: int
) -> None:
    # The per-request values of a batch are checked in one pass: same error (the first in step order,
    # even when a later step breaks an earlier check) or the same observations as step by step.
    steps = [step(c, batch_size=0, time_s=-1.0 if i == bad_time else 1.0) for i, c in enumerate(columns)]
    rows = pb.StepReport(time_s=1.0, duration_s=0.01)
    rows.requests.add(request_id="r", traffic_class="code", method="eagle3", k=2, drafted=2, accepted=1)
    steps.insert(min(with_rows, len(steps)), rows)
    want = step_by_step(steps)
    try:
        got: list[StepObservation] | tuple[str, str] = validate_batch(
            pb.StepReportBatch(sequence=1, steps=steps), ENGINE, DEFAULT_LIMITS
        )
    except TelemetryError as e:
        got = (e.reason, str(e))
    if isinstance(want, tuple) or isinstance(got, tuple):
        assert got == want
        return
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a.time_s, a.traffic_class, a.request_id) == (b.time_s, b.traffic_class, b.request_id)
        for name in ("method", "k", "drafted", "accepted", "finished"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert a.counterfactual.keys() == b.counterfactual.keys()


def test_prefill_tokens_reach_the_observation_in_both_forms() -> None:
    rows = pb.StepReport(time_s=1.0, duration_s=0.01, prefill_tokens=300)
    rows.requests.add(request_id="r", traffic_class="code", method="eagle3", k=2, drafted=2, accepted=1)
    got = validate_batch(
        pb.StepReportBatch(sequence=1, steps=[step(prefill_tokens=512), rows, step()]), ENGINE, DEFAULT_LIMITS
    )
    assert [o.prefill_tokens for o in got] == [512, 300, 0]
    assert observation_from_pb(step(prefill_tokens=7)).prefill_tokens == 7


def _same_observation(a: StepObservation, b: StepObservation) -> None:
    """Every field equal, arrays by value and dtype."""
    for f in StepObservation.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray), f
            assert x.dtype == y.dtype and np.array_equal(x, y), f
        elif f == "counterfactual":
            assert x.keys() == y.keys()
            for m in x:
                assert x[m].dtype == y[m].dtype and np.array_equal(x[m], y[m]), (f, m)
        else:
            assert x == y, f


def _same_batch(a: StepBatch, b: StepBatch) -> None:
    """Every column equal (arrays by value and dtype), classes by name, counterfactuals per method."""
    for f in StepBatch.__dataclass_fields__:
        if f.startswith("_"):
            continue
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f
        else:
            assert x == y, f
    assert a.traffic_class == b.traffic_class
    assert [a.class_names[j] for j in a.class_of] == [b.class_names[j] for j in b.class_of]
    assert a.counterfactual_methods() == b.counterfactual_methods()
    for m in a.counterfactual_methods():
        assert a.counterfactual(m).dtype == b.counterfactual(m).dtype
        assert np.array_equal(a.counterfactual(m), b.counterfactual(m)), m
    for i in range(len(a)):
        assert a.step_counterfactual(i).keys() == b.step_counterfactual(i).keys()


@st.composite
def nearly_valid_step(draw: st.DrawFn) -> pb.StepReport:
    """A columnar step that is valid but for, now and then, one value just out of its range."""
    n = draw(st.integers(0, 6))
    off = draw(st.sampled_from(range(13)))  # which value (if any) goes out of range

    def ints(lo: int, hi: int, bad: int | None, which: int) -> list[int]:
        values = draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
        if off == which and n and bad is not None:
            values[draw(st.integers(0, n - 1))] = bad
        return values

    k = ints(0, 4, 5, 1)
    drafted = [min(d, kk) for d, kk in zip(ints(0, 4, None, 0), k, strict=True)]
    accepted = [min(a, d) for a, d in zip(ints(0, 4, None, 0), drafted, strict=True)]
    if off == 2 and n:
        accepted[0] = drafted[0] + 1
    cf_values = ints(-1, 4, 5 if off == 3 else -2 if off == 4 else None, off)
    c = pb.RequestColumns(
        request_id=[f"r{j}" for j in range(n)] if draw(st.booleans()) else [],
        classes=["chat", "code"] if off != 5 else ["chat", "c" * 65],
        traffic_class=ints(0, 1, 2, 6),
        method=[(0 if off == 7 and j == 0 else METHOD_CODES[Method.EAGLE3]) for j in range(n)],
        k=k,
        drafted=drafted,
        accepted=accepted,
        counterfactual=[cf("ngram", cf_values)] + ([cf("ngram", cf_values)] if off == 8 else []),
        finished=draw(st.lists(st.booleans(), min_size=n, max_size=n)) if draw(st.booleans()) else [],
        ngram_proposal=ints(0, 4, 5, 9) if draw(st.booleans()) else [],
    )
    if draw(st.booleans()):
        c = packed(c)
    return step(
        c,
        batch_size=n if off != 10 else max(n - 1, 0),
        duration_s=0.02 if off != 11 else float("nan"),
        prefill_tokens=0 if off != 12 else 1 << 23,
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        nearly_valid_step() | random_columns().map(lambda c: step(c, batch_size=0)), min_size=1, max_size=5
    )
)
def test_a_columnar_batch_read_at_once_is_read_as_step_by_step(steps: list[pb.StepReport]) -> None:
    # A batch of columnar steps only is read per batch (all columns decoded and checked at once);
    # it must give what the step-by-step reading gives: the same observations, or the same error.
    import controller.validation as v

    batch = pb.StepReportBatch(sequence=1, steps=steps)

    def read() -> list[StepObservation] | tuple[str, str]:
        try:
            return validate_batch(batch, ENGINE, DEFAULT_LIMITS)
        except TelemetryError as e:
            return e.reason, str(e)

    at_once = read()
    fast = v._read_columnar_batch
    v._read_columnar_batch = lambda *a: None  # type: ignore[assignment]
    try:
        one_by_one = read()
    finally:
        v._read_columnar_batch = fast
    if isinstance(at_once, tuple) or isinstance(one_by_one, tuple):
        assert at_once == one_by_one
        return
    assert len(at_once) == len(one_by_one)
    for a, b in zip(at_once, one_by_one, strict=True):
        _same_observation(a, b)
    # The batch read at once (columns straight from the wire) holds what the steps' batch holds.
    _same_batch(read_batch(batch, ENGINE, DEFAULT_LIMITS), StepBatch(steps=one_by_one))


def test_a_valid_columnar_batch_is_read_at_once() -> None:
    # The batch path is taken for the plugin's usual batch (not only the fallback), and gives the
    # observations of the step-by-step path.
    import controller.validation as v

    steps = [step(cols(ngram_proposal=[1, 0], counterfactual=[cf("ngram", [2, -1])])) for _ in range(3)]
    fast = v._read_columnar_batch(steps, ENGINE, DEFAULT_LIMITS, {"eagle3", "off"})
    assert fast is not None and len(fast) == 3
    for got, s in zip(fast.steps, steps, strict=True):
        _same_observation(got, observation_from_pb(s))
    _same_batch(fast, StepBatch(steps=[observation_from_pb(s) for s in steps]))


def test_packed_and_repeated_columns_read_the_same() -> None:
    steps = [
        step(cols(ngram_proposal=[1, 0], counterfactual=[cf("ngram", [2, -1])])),
        step(cols(accepted=[0, 0])),
        step(cols(k=[4, 4], drafted=[4, 3], accepted=[4, 0], ngram_proposal=[4, 4])),
    ]
    plain = read_batch(pb.StepReportBatch(sequence=1, steps=steps), ENGINE, DEFAULT_LIMITS)
    for which in ([0, 1, 2], [1]):  # every step packed (the batch path), or some (step by step)
        mixed = [step(packed(s.columns)) if i in which else s for i, s in enumerate(steps)]
        got = read_batch(pb.StepReportBatch(sequence=1, steps=mixed), ENGINE, DEFAULT_LIMITS)
        _same_batch(got, plain)
        for a, b in zip(got.steps, plain.steps, strict=True):
            _same_observation(a, b)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c, "packed", c.packed[:-4]), "bytes, not 4 x count 2 x 6 columns"),
        (lambda c: setattr(c, "count", 3), "bytes, not 4 x count 3 x 6 columns"),
        (lambda c: c.k.extend([2, 2]), "the repeated k both set"),
        (lambda c: setattr(c, "packed_ngram_proposal", False), "bytes, not 4 x count 2 x 5 columns"),
        (lambda c: setattr(c, "count", 0), "without a count"),
    ],
)
def test_malformed_packed_columns_are_refused_by_name(change: object, message: str) -> None:
    c = packed(cols(ngram_proposal=[1, 0]))
    c.ClearField("finished")
    c.packed_finished = False
    c.packed = c.packed[: 4 * 2 * 6]  # the five columns and the n-gram proposals
    check(step(c))  # valid as built
    change(c)  # type: ignore[operator]
    with pytest.raises(TelemetryError) as e:
        check(step(cols(), time_s=0.5), step(c, batch_size=4))
    assert e.value.reason == "packed_invalid"
    assert str(e.value).startswith("steps[1].columns.packed: ") and message in str(e.value)
