"""Validation of what engines send, against their own Hello and the sidecar's limits. Pure.

Every failure carries a machine-readable ``reason`` (a metric label) and a one-line message naming
the step and request index and the field. Where it quotes the engine's own text (a method name), it
quotes it shortened (``policies.params.shown``): the message is the stream's gRPC status, whose
metadata gRPC caps at 16 KiB (a longer one reached the engine as RESOURCE_EXHAUSTED "Stream removed",
reason and place lost), and it is one line of the sidecar's log.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from controller.v1 import controller_pb2 as pb
from controller.wire.codec import (
    MAX_DROPPED_STEPS,
    MAX_SEQUENCE,
    StepColumns,
    columns_count,
    columns_observation,
    decode_columns,
    observation_from_pb,
    packed_problem,
    packed_rows,
    unpack_columns,
)
from controller.wire.convert import engine_info_from_hello
from controller.wire.names import (
    MAX_ENGINE_ID,
    MAX_PLUGIN_MODE,
    MAX_REQUEST_ID,
    MAX_TRAFFIC_CLASS,
    escape_text,
    has_control,
)
from policies.arms import MAX_K as ARM_MAX_K
from policies.arms import METHOD_CODES, METHODS_BY_CODE, Method
from policies.context import MAX_BATCH_SIZE
from policies.engine import EngineInfo
from policies.observation import NOT_SCORED, StepBatch, StepObservation
from policies.params import shown
from policies.physics import MAX_STEP_S, MIN_STEP_S, MIN_STEP_S_PER_REQUEST, step_floor_s
from policies.spec import PolicyError, PolicySpec, parse_policy

MAX_INSTANCE_ID = 128
MAX_K = ARM_MAX_K  # one bound for arms and engines (policies.arms)
#: Distinct traffic classes one columnar step may name.
MAX_CLASSES_PER_STEP = 4096
#: Prompt tokens one step can prefill: far beyond any scheduler's max_num_batched_tokens.
MAX_PREFILL_TOKENS = 1 << 22
PROTOCOL_VERSIONS = (0, 1)
#: Hello strings and lists beyond any real engine's (a long model path, every method at every K).
MAX_MODEL = 512
MAX_ENGINE_VERSION = 128
MAX_ARMS = 4 * (MAX_K + 1)
MAX_COUNTERFACTUAL_METHODS = 8
#: A step's duration: 1 us..1 h, and at least 50 ns per request it scheduled (``max(batch_size,
#: rows)``); policies.physics says why. 0 means "not measured": the step is counted but not learned from.
MIN_STEP_DURATION_S = MIN_STEP_S
MAX_STEP_DURATION_S = MAX_STEP_S
#: Engine clocks (monotonic or Unix seconds) and queue waits, with room for centuries of uptime.
MAX_TIME_S = 1e11
MAX_QUEUE_WAIT_S = 1e7
MAX_QUEUE_LENGTH = 1 << 24
_METHODS = frozenset(m.value for m in Method)
_OFF_CODE = METHOD_CODES[Method.OFF]


class TelemetryError(ValueError):
    """Invalid engine input: ``reason`` is a stable label, ``str()`` a one-line message."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Limits:
    max_steps_per_batch: int = 1024
    max_requests_per_step: int = 4096


def validate_hello(h: pb.Hello) -> EngineInfo:
    """The engine's description, or TelemetryError."""
    if not h.engine_id:
        raise TelemetryError("engine_id_missing", "hello.engine_id: required")
    if len(h.engine_id) > MAX_ENGINE_ID:
        raise TelemetryError("engine_id_too_long", f"hello.engine_id: longer than {MAX_ENGINE_ID} characters")
    if len(h.instance_id) > MAX_INSTANCE_ID:
        raise TelemetryError(
            "instance_id_too_long", f"hello.instance_id: longer than {MAX_INSTANCE_ID} characters"
        )
    for name in ("engine_id", "instance_id", "model", "engine_version", "plugin_mode"):
        if has_control(getattr(h, name)):
            raise TelemetryError(
                "control_characters",
                f"hello.{name}: holds control characters ({escape_text(getattr(h, name))[:80]})",
            )
    if len(h.model) > MAX_MODEL:
        raise TelemetryError("model_too_long", f"hello.model: longer than {MAX_MODEL} characters")
    if len(h.engine_version) > MAX_ENGINE_VERSION:
        raise TelemetryError(
            "engine_version_too_long", f"hello.engine_version: longer than {MAX_ENGINE_VERSION} characters"
        )
    if len(h.arms) > MAX_ARMS:
        raise TelemetryError("too_many_arms", f"hello.arms: {len(h.arms)} arms exceed the limit {MAX_ARMS}")
    if len(h.counterfactual_methods) > MAX_COUNTERFACTUAL_METHODS:
        raise TelemetryError(
            "too_many_counterfactual_methods",
            f"hello.counterfactual_methods: {len(h.counterfactual_methods)} entries exceed the limit "
            f"{MAX_COUNTERFACTUAL_METHODS}",
        )
    if h.max_batch_size > MAX_BATCH_SIZE:
        raise TelemetryError(
            "max_batch_size_out_of_range",
            f"hello.max_batch_size: {h.max_batch_size} is beyond any engine (at most {MAX_BATCH_SIZE})",
        )
    if len(h.plugin_mode) > MAX_PLUGIN_MODE:
        raise TelemetryError(
            "plugin_mode_too_long", f"hello.plugin_mode: longer than {MAX_PLUGIN_MODE} characters"
        )
    if h.protocol_version not in PROTOCOL_VERSIONS:
        raise TelemetryError(
            "protocol_version",
            f"hello.protocol_version: {h.protocol_version} is not supported (supported: 0, 1)",
        )
    if not 1 <= h.max_k <= MAX_K:
        raise TelemetryError("max_k_out_of_range", f"hello.max_k: must be 1..{MAX_K}, got {h.max_k}")
    if not h.arms:
        raise TelemetryError("no_arms", "hello.arms: the engine must offer at least one arm")
    for i, a in enumerate(h.arms):
        if a.method not in _METHODS:
            raise TelemetryError("arm_invalid", f"hello.arms[{i}].method: unknown method {shown(a.method)}")
        if a.k > h.max_k:
            raise TelemetryError("k_gt_max", f"hello.arms[{i}].k: {a.k} exceeds max_k {h.max_k}")
    if h.granularity not in (0, 1, 2, 3):
        raise TelemetryError("granularity_invalid", f"hello.granularity: unknown value {h.granularity}")
    for i, m in enumerate(h.counterfactual_methods):
        if m not in _METHODS:
            raise TelemetryError(
                "method_unknown", f"hello.counterfactual_methods[{i}]: unknown method {shown(m)}"
            )
    try:
        info = engine_info_from_hello(h)
    except ValueError as e:
        raise TelemetryError("arm_invalid", f"hello.arms: {e}") from None
    if not info.playable(()):
        raise TelemetryError(
            "no_arms", "hello.arms: no arm the engine can apply live (p_eagle needs k = max_k)"
        )
    return info


def validate_batch(batch: pb.StepReportBatch, engine: EngineInfo, limits: Limits) -> list[StepObservation]:
    """``read_batch``'s steps, each whole (for callers that look at one step at a time)."""
    return list(read_batch(batch, engine, limits).steps)


def read_batch(batch: pb.StepReportBatch, engine: EngineInfo, limits: Limits) -> StepBatch:
    """Check a whole report batch before any of it is used (a bad batch changes nothing).

    Returns the steps as one ``StepBatch``, converted while checking (the columnar form is read once,
    every column of every step at once). Only a batch that is not all columnar and valid pays for
    reading step by step, which names the first bad field as checking each step alone would.
    """
    check_batch_header(batch)
    if len(batch.steps) > limits.max_steps_per_batch:
        raise TelemetryError(
            "too_many_steps",
            f"reports.steps: {len(batch.steps)} steps exceed the limit {limits.max_steps_per_batch}",
        )
    methods = {a.method.value for a in engine.arms} | {Method.OFF.value}
    fast = _read_columnar_batch(batch.steps, engine, limits, methods)
    if fast is not None:
        return fast
    read: list[StepObservation | _Columns] = []
    try:
        for i, step in enumerate(batch.steps):
            read.append(_read_step(step, engine, limits, index=i, methods=methods))
    except TelemetryError:
        for r in read:  # an earlier step's error comes first
            if isinstance(r, _Columns):
                _finish_columns(r, engine, methods, checked=False)
        raise
    cols = [r for r in read if isinstance(r, _Columns)]
    checked = bool(cols) and _rows_ok(cols, engine, methods)
    return StepBatch(
        steps=[
            r if isinstance(r, StepObservation) else _finish_columns(r, engine, methods, checked=checked)
            for r in read
        ]
    )


def check_batch_header(batch: pb.StepReportBatch) -> None:
    """The batch's own counters within their physical ranges (checked before the sequence is used)."""
    if batch.sequence > MAX_SEQUENCE:
        raise TelemetryError(
            "sequence_out_of_range", f"reports.sequence: {batch.sequence} is beyond {MAX_SEQUENCE}"
        )
    if batch.dropped_steps > MAX_DROPPED_STEPS:
        raise TelemetryError(
            "dropped_steps_out_of_range",
            f"reports.dropped_steps: {batch.dropped_steps} is beyond {MAX_DROPPED_STEPS}",
        )


def batch_request_steps(batch: pb.StepReportBatch, limits: Limits) -> int:
    """The request-steps a batch reports (each step's requests, in either form, summed), read before
    the batch is (what reading it costs grows with). A step is counted at most at
    ``max_requests_per_step``: one claiming more is refused when read (``too_many_requests``), not
    taken for a flood."""
    most = limits.max_requests_per_step
    return sum(min(len(s.requests) + columns_count(s.columns), most) for s in batch.steps)


#: (field, reason, upper bound) of a step's times, all finite and >= 0.
_STEP_TIMES = (
    ("time_s", "time_invalid", MAX_TIME_S),
    ("duration_s", "duration_invalid", MAX_STEP_DURATION_S),
    ("queue_wait_s", "queue_wait_invalid", MAX_QUEUE_WAIT_S),
)


def _step_scalars_ok(step: pb.StepReport) -> bool:
    """Whether ``_check_step_scalars`` passes, as one comparison chain (NaN fails every comparison)."""
    t, d, q = step.time_s, step.duration_s, step.queue_wait_s
    return (
        0 <= t <= MAX_TIME_S
        and 0 <= q <= MAX_QUEUE_WAIT_S
        and (d == 0 or MIN_STEP_DURATION_S <= d <= MAX_STEP_DURATION_S)
        and step.prefill_tokens <= MAX_PREFILL_TOKENS
        and step.queue_length <= MAX_QUEUE_LENGTH
        and step.directive_version <= MAX_SEQUENCE
    )


def _check_step_scalars(step: pb.StepReport, where: str) -> None:
    """A step's own numbers within their physical ranges (scheduled_k is informational, unread)."""
    if _step_scalars_ok(step):  # the usual step: the rest names the bad field
        return
    for name, reason, hi in _STEP_TIMES:
        v = getattr(step, name)
        if not (math.isfinite(v) and 0 <= v <= hi):
            raise TelemetryError(reason, f"{where}.{name}: must be finite and in [0, {hi:g}], got {v!r}")
    d = step.duration_s
    if 0 < d < MIN_STEP_DURATION_S:
        raise TelemetryError(
            "duration_invalid",
            f"{where}.duration_s: {d!r} is shorter than any step ({MIN_STEP_DURATION_S:g} s; 0: not measured)",
        )
    if step.prefill_tokens > MAX_PREFILL_TOKENS:
        raise TelemetryError(
            "prefill_tokens_invalid",
            f"{where}.prefill_tokens: {step.prefill_tokens} is beyond any scheduler's token budget "
            f"({MAX_PREFILL_TOKENS})",
        )
    if step.queue_length > MAX_QUEUE_LENGTH:
        raise TelemetryError(
            "queue_length_invalid", f"{where}.queue_length: {step.queue_length} is beyond {MAX_QUEUE_LENGTH}"
        )
    if step.directive_version > MAX_SEQUENCE:
        raise TelemetryError(
            "directive_version_invalid",
            f"{where}.directive_version: {step.directive_version} is beyond {MAX_SEQUENCE}",
        )


def _step_rate_ok(duration_s: float, scheduled: int) -> bool:
    """Whether a step of ``scheduled`` requests could last ``duration_s`` (0: not measured, passes)."""
    return duration_s == 0 or duration_s >= step_floor_s(scheduled)


def _check_step_rate(duration_s: float, scheduled: int, where: str) -> None:
    """``MIN_STEP_S_PER_REQUEST``: the step's duration against the requests it scheduled."""
    if not _step_rate_ok(duration_s, scheduled):
        floor = step_floor_s(scheduled)
        raise TelemetryError(
            "duration_invalid",
            f"{where}.duration_s: {duration_s!r} s for a batch of {scheduled} requests is faster than any "
            f"engine (at least {MIN_STEP_S_PER_REQUEST:g} s per request: {floor:g} s; 0: not measured)",
        )


def _check_counts(
    k: np.ndarray, drafted: np.ndarray, accepted: np.ndarray, max_k: int, where: str, *, columns: bool
) -> None:
    """K within the engine's max, drafted within K, accepted within drafted (the first bad row named)."""
    _first(k > max_k, "k_gt_max", where, "k", lambda j: f"{k[j]} exceeds the engine's max_k {max_k}",
           columns=columns)  # fmt: skip
    _first(drafted > k, "drafted_gt_k", where, "drafted", lambda j: f"{drafted[j]} exceeds k {k[j]}",
           columns=columns)  # fmt: skip
    _first(accepted > drafted, "accepted_gt_drafted", where, "accepted",
           lambda j: f"{accepted[j]} exceeds drafted {drafted[j]}", columns=columns)  # fmt: skip


def _read_step(
    step: pb.StepReport, engine: EngineInfo, limits: Limits, *, index: int, methods: set[str]
) -> StepObservation | _Columns:
    """A step in the rows form checked and converted, or one in the columnar form read and checked up
    to its per-request values (``_finish_columns`` checks those)."""
    where = f"steps[{index}]"
    _check_step_scalars(step, where)
    columnar = step.HasField("columns")
    if columnar and len(step.requests):
        raise TelemetryError(
            "requests_and_columns", f"{where}.columns: a step carries requests or columns, not both"
        )
    reqs = step.requests
    n = columns_count(step.columns) if columnar else len(reqs)
    if n > limits.max_requests_per_step:
        raise TelemetryError(
            "too_many_requests",
            f"{where}.{'columns' if columnar else 'requests'}: {n} requests exceed the limit "
            f"{limits.max_requests_per_step}",
        )
    if step.batch_size > max(limits.max_requests_per_step, engine.max_batch_size):
        raise TelemetryError(
            "batch_size_invalid", f"{where}.batch_size: {step.batch_size} is beyond any sane batch"
        )
    if step.batch_size and step.batch_size < n:
        raise TelemetryError(
            "batch_size_invalid",
            f"{where}.batch_size: {step.batch_size} is smaller than the {n} requests reported",
        )
    _check_step_rate(step.duration_s, max(step.batch_size, n), where)
    allowed = methods
    if columnar:
        return _read_columns(step, n, where)
    if n == 0:
        return observation_from_pb(step)
    k = np.fromiter((r.k for r in reqs), dtype=np.int64, count=n)
    drafted = np.fromiter((r.drafted for r in reqs), dtype=np.int64, count=n)
    accepted = np.fromiter((r.accepted for r in reqs), dtype=np.int64, count=n)
    _check_counts(k, drafted, accepted, engine.max_k, where, columns=False)
    for j, r in enumerate(reqs):
        if r.method not in allowed:
            reason = "method_unknown" if r.method not in _METHODS else "method_not_offered"
            raise TelemetryError(
                reason,
                f"{where}.requests[{j}].method: {shown(r.method)} is not one of the engine's ({', '.join(sorted(allowed))})",
            )
        if r.method == Method.OFF.value and r.k > 0:
            raise TelemetryError("off_with_draft", f"{where}.requests[{j}].k: {_off_with_draft(k)(j)}")
        _check_class_name(r.traffic_class, f"{where}.requests[{j}].traffic_class")
        if len(r.request_id) > MAX_REQUEST_ID:
            raise TelemetryError(
                "request_id_too_long",
                f"{where}.requests[{j}].request_id: longer than {MAX_REQUEST_ID} characters",
            )
        if r.HasField("ngram_proposal") != reqs[0].HasField("ngram_proposal"):
            raise TelemetryError(
                "ngram_proposal_partial",
                f"{where}.requests[{j}].ngram_proposal: reported on some rows of the step but not this "
                "one (every row or none)",
            )
        if r.ngram_proposal > engine.max_k:
            raise TelemetryError(
                "ngram_proposal_gt_max",
                f"{where}.requests[{j}].ngram_proposal: {r.ngram_proposal} exceeds max_k {engine.max_k}",
            )
        for m, v in r.counterfactual_accepted.items():
            if m not in _METHODS or m == Method.OFF.value:
                raise TelemetryError(
                    "counterfactual_method_unknown",
                    f"{where}.requests[{j}].counterfactual_accepted: unknown method {shown(m)}",
                )
            if v > engine.max_k:
                raise TelemetryError(
                    "counterfactual_gt_max",
                    f"{where}.requests[{j}].counterfactual_accepted[{m}]: {v} exceeds max_k {engine.max_k}",
                )
    return observation_from_pb(step)


@dataclass(frozen=True, slots=True)
class _Columns:
    """A columnar step read, its structure checked, its per-request values not yet."""

    step: pb.StepReport
    where: str
    cols: StepColumns


def _read_columns(step: pb.StepReport, n: int, where: str) -> _Columns:
    """The columnar form's structure (lengths, classes, ids) checked; each column read once.

    The columns are decoded first (decoding judges nothing, and the message size limit bounds it), so
    the checks read the arrays and tuples rather than the protobuf containers a second time."""
    where = f"{where}.columns"
    problem = packed_problem(step.columns)
    if problem:
        raise TelemetryError("packed_invalid", f"{where}.packed: {problem}")
    cols = decode_columns(step.columns)
    fin, prop = cols.finished, cols.ngram_proposal
    for name, length, optional in (
        ("request_id", len(cols.request_id), True),
        ("traffic_class", len(cols.traffic_class), False),
        ("method", len(cols.method), False),
        ("drafted", len(cols.drafted), False),
        ("accepted", len(cols.accepted), False),
        ("finished", 0 if fin is None else len(fin), True),
        ("ngram_proposal", 0 if prop is None else len(prop), True),
    ):
        if length != n and not (optional and length == 0):
            raise TelemetryError(
                "columns_length",
                f"{where}.{name}: {length} entries, but k has {n}" + (" (or none)" if optional else ""),
            )
    classes = cols.classes
    if len(classes) > MAX_CLASSES_PER_STEP:
        raise TelemetryError(
            "too_many_classes",
            f"{where}.classes: {len(classes)} classes exceed the limit {MAX_CLASSES_PER_STEP}",
        )
    for i, name in enumerate(classes):
        if not _class_name_ok(name):
            _check_class_name(name, f"{where}.classes[{i}]")
    request_id = cols.request_id
    if request_id and max(map(len, request_id)) > MAX_REQUEST_ID:
        j = next(j for j, rid in enumerate(request_id) if len(rid) > MAX_REQUEST_ID)
        raise TelemetryError(
            "request_id_too_long", f"{where}.request_id[{j}]: longer than {MAX_REQUEST_ID} characters"
        )
    return _Columns(step=step, where=where, cols=cols)


#: Traffic class names that passed ``_check_class_name`` (engines repeat the same few on every step),
#: bounded so that an engine naming a new class on every step cannot grow it.
_GOOD_CLASS_NAMES: set[str] = set()
MAX_GOOD_CLASS_NAMES = 4096


def _class_name_ok(name: str) -> bool:
    """Whether ``_check_class_name`` passes ``name`` (remembered when it does)."""
    if name in _GOOD_CLASS_NAMES:
        return True
    if len(name) > MAX_TRAFFIC_CLASS or has_control(name):
        return False
    if len(_GOOD_CLASS_NAMES) < MAX_GOOD_CLASS_NAMES:
        _GOOD_CLASS_NAMES.add(name)
    return True


def _read_columnar_batch(
    steps: Sequence[pb.StepReport], engine: EngineInfo, limits: Limits, allowed: set[str]
) -> StepBatch | None:
    """A batch whose steps are all columnar and valid, read per batch: each step's structure in one
    tight pass, then every column of all steps decoded and checked at once, straight into one
    ``StepBatch`` (no per-step object). The same checks as the step-by-step path (``_read_step``,
    ``_read_columns``, ``_finish_columns``), answered only yes or no: None as soon as anything is off
    (or a step carries rows), and that path then names the first problem or reads the rows."""
    if not steps:
        return None
    max_req = limits.max_requests_per_step
    batch_cap = max(max_req, engine.max_batch_size)
    max_k = engine.max_k
    columns: list[pb.RequestColumns] = []
    sizes: list[int] = []
    scalars: list[tuple[float, float, int, int, float, int]] = []
    classes_of: list[tuple[str, ...]] = []
    # Every step with requests in one form: packed (count > 0, one layout) or the repeated fields (a
    # step without requests is the same in both). The first step with requests decides.
    first = next((step.columns for step in steps if step.columns.count or len(step.columns.k)), None)
    packed = first is not None and bool(first.count)
    layout, rows = (False, False), 0
    if first is not None and packed:
        layout, rows = (first.packed_ngram_proposal, first.packed_finished), packed_rows(first)
    for step in steps:
        if not step.HasField("columns") or len(step.requests) or not _step_scalars_ok(step):
            return None
        c = step.columns
        n_ids = len(c.request_id)
        if packed and c.count:
            n = c.count
            if (
                (c.packed_ngram_proposal, c.packed_finished) != layout
                or len(c.packed) != 4 * n * rows
                or len(c.k)
                or len(c.traffic_class)
                or len(c.method)
                or len(c.drafted)
                or len(c.accepted)
                or len(c.finished)
                or len(c.ngram_proposal)
            ):
                return None
        else:  # repeated fields (in a packed batch: a step without requests)
            n = len(c.k)
            if c.count or len(c.packed) or c.packed_ngram_proposal or c.packed_finished or (packed and n):
                return None
            if len(c.traffic_class) != n or len(c.method) != n or len(c.drafted) != n or len(c.accepted) != n:
                return None
            n_finished, n_proposal = len(c.finished), len(c.ngram_proposal)
            if (n_finished and n_finished != n) or (n_proposal and n_proposal != n):
                return None
        if n_ids and n_ids != n:
            return None
        size = step.batch_size
        if n > max_req or size > batch_cap or 0 < size < n or not _step_rate_ok(step.duration_s, size or n):
            return None
        classes = tuple(c.classes)
        if len(classes) > MAX_CLASSES_PER_STEP or not all(map(_class_name_ok, classes)):
            return None
        columns.append(c)
        sizes.append(n)
        classes_of.append(classes)
        scalars.append(
            (
                step.time_s,
                step.duration_s,
                size or n,
                step.queue_length,
                step.queue_wait_s,
                step.prefill_tokens,
            )
        )
    total = sum(sizes)
    request_id = tuple(
        itertools.chain.from_iterable(
            c.request_id if len(c.request_id) else ("",) * n for c, n in zip(columns, sizes, strict=True)
        )
    )
    if total and max(map(len, request_id)) > MAX_REQUEST_ID:
        return None

    def whole(name: str) -> np.ndarray:  # one column of every step, concatenated
        return np.fromiter(
            itertools.chain.from_iterable([getattr(c, name) for c in columns]), dtype=np.int64, count=total
        )

    ngram_reported: np.ndarray
    if packed:
        tc, method, k, drafted, accepted, *extra = unpack_columns(
            columns, sizes, proposals=layout[0], finished=layout[1]
        )
        proposal = extra[0] if layout[0] else np.zeros(total, dtype=np.int64)
        finished = extra[-1] if layout[1] else np.zeros(total, dtype=bool)
        ngram_reported = np.array([layout[0] and n > 0 for n in sizes], dtype=bool)
    else:
        tc, method, k, drafted, accepted = (
            whole(f) for f in ("traffic_class", "method", "k", "drafted", "accepted")
        )
    n_classes = np.repeat(np.array([len(c) for c in classes_of], dtype=np.int64), sizes)
    if total and _bad_rows(tc, n_classes, method, k, drafted, accepted, engine, allowed).any():
        return None
    counterfactual: dict[Method, tuple[np.ndarray, np.ndarray]] = {}
    start = 0
    for i, (c, n) in enumerate(zip(columns, sizes, strict=True)):
        seen: list[str] = []
        for col in c.counterfactual:
            m = col.method
            if m not in _METHODS or m == Method.OFF.value or m in seen or len(col.accepted) != n:
                return None
            seen.append(m)
            v = np.fromiter(col.accepted, dtype=np.int64, count=n)
            if n and ((v > max_k) | (v < NOT_SCORED)).any():
                return None
            method_ = Method(m)
            cf = counterfactual.get(method_)
            if cf is None:
                cf = counterfactual[method_] = (
                    np.full(total, NOT_SCORED, dtype=np.int32),
                    np.zeros(len(columns), dtype=bool),
                )
            cf[0][start : start + n] = v
            cf[1][i] = True
        start += n
    if not packed:
        ngram_reported = np.fromiter(
            (len(c.ngram_proposal) > 0 for c in columns), dtype=bool, count=len(columns)
        )
        if ngram_reported.all():
            proposal = whole("ngram_proposal")
        elif not ngram_reported.any():
            proposal = np.zeros(total, dtype=np.int64)
        else:
            proposal = np.fromiter(
                itertools.chain.from_iterable(
                    c.ngram_proposal if len(c.ngram_proposal) else itertools.repeat(0, n)
                    for c, n in zip(columns, sizes, strict=True)
                ),
                dtype=np.int64,
                count=total,
            )
        finished = (
            np.fromiter(
                itertools.chain.from_iterable(
                    c.finished if len(c.finished) else itertools.repeat(False, n)
                    for c, n in zip(columns, sizes, strict=True)
                ),
                dtype=bool,
                count=total,
            )
            if any(len(c.finished) for c in columns)
            else np.zeros(total, dtype=bool)
        )
    if total and int(proposal.max()) > max_k:
        return None
    class_names, class_of = _batch_classes(classes_of, tc, sizes)
    time_s, duration_s, batch_size, queue_length, queue_wait_s, prefill = zip(*scalars, strict=True)
    return StepBatch.from_columns(
        n=np.array(sizes, dtype=np.int64),
        time_s=np.array(time_s, dtype=np.float64),
        duration_s=np.array(duration_s, dtype=np.float64),
        batch_size=np.array(batch_size, dtype=np.int64),
        queue_length=np.array(queue_length, dtype=np.int64),
        queue_wait_s=np.array(queue_wait_s, dtype=np.float64),
        prefill_tokens=np.array(prefill, dtype=np.int64),
        method=method.astype(np.int8),
        k=k.astype(np.int32),
        drafted=drafted.astype(np.int32),
        accepted=accepted.astype(np.int32),
        class_names=class_names,
        class_of=class_of,
        request_id=request_id,
        finished=finished,
        ngram_proposal=proposal.astype(np.int32),
        ngram_reported=ngram_reported,
        counterfactual=counterfactual,
    )


def _batch_classes(
    classes_of: list[tuple[str, ...]], tc: np.ndarray, sizes: list[int]
) -> tuple[tuple[str, ...], np.ndarray]:
    """The batch's distinct class names ("" read as "default") and each row's index into them, from
    each step's own class list and per-row indices into it (checked in range)."""
    first = classes_of[0]
    if all(c == first for c in classes_of):  # the usual batch: every step lists the same classes
        names = tuple(x or "default" for x in first)
        if len(set(names)) == len(names):
            return names, tc
    index: dict[str, int] = {}
    lut = np.fromiter(
        (index.setdefault(x or "default", len(index)) for cl in classes_of for x in cl),
        dtype=np.int64,
        count=sum(map(len, classes_of)),
    )
    base = np.zeros(len(classes_of), dtype=np.int64)
    np.cumsum([len(c) for c in classes_of[:-1]], out=base[1:])
    return tuple(index), lut[tc + np.repeat(base, sizes)]


def _check_class_name(name: str, path: str) -> None:
    if len(name) > MAX_TRAFFIC_CLASS:
        raise TelemetryError("traffic_class_too_long", f"{path}: longer than {MAX_TRAFFIC_CLASS} characters")
    if has_control(name):
        raise TelemetryError(
            "control_characters", f"{path}: holds control characters ({escape_text(name)[:80]})"
        )


def _bad_rows(
    tc: np.ndarray,
    n_classes: int | np.ndarray,
    method: np.ndarray,
    k: np.ndarray,
    drafted: np.ndarray,
    accepted: np.ndarray,
    engine: EngineInfo,
    allowed: set[str],
) -> np.ndarray:
    """Per request, whether any of its values breaks a rule (all rules as one combined mask)."""
    method_ok = _code_mask(frozenset(allowed))[np.minimum(method, len(METHODS_BY_CODE))]
    out: np.ndarray = (
        (tc >= n_classes)
        | ~method_ok
        | (k > engine.max_k)
        | (drafted > k)
        | (accepted > drafted)
        | ((method == _OFF_CODE) & (k > 0))
    )
    return out


def _rows_ok(read: list[_Columns], engine: EngineInfo, allowed: set[str]) -> bool:
    """Whether every request of every step passes the per-request rules (one pass over the batch)."""
    cols = [r.cols for r in read]
    if len(cols) == 1:
        c = cols[0]
        return not (
            c.n
            and _bad_rows(
                c.traffic_class, len(c.classes), c.method, c.k, c.drafted, c.accepted, engine, allowed
            ).any()
        )
    sizes = [c.n for c in cols]
    if not sum(sizes):
        return True
    bad = _bad_rows(
        np.concatenate([c.traffic_class for c in cols]),
        np.repeat([len(c.classes) for c in cols], sizes),
        np.concatenate([c.method for c in cols]),
        np.concatenate([c.k for c in cols]),
        np.concatenate([c.drafted for c in cols]),
        np.concatenate([c.accepted for c in cols]),
        engine,
        allowed,
    )
    return not bad.any()


def _finish_columns(
    read: _Columns, engine: EngineInfo, allowed: set[str], *, checked: bool
) -> StepObservation:
    """The columnar step's per-request checks (skipped when ``checked``: done for the whole batch), its
    counterfactual columns, and its observation.

    All value checks run as one combined mask; only a bad step pays for finding the first bad entry.
    """
    step, where, c = read.step, read.where, read.cols
    n, tc, method, k, drafted, accepted = c.n, c.traffic_class, c.method, c.k, c.drafted, c.accepted
    classes = c.classes
    if not checked and n and _bad_rows(tc, len(classes), method, k, drafted, accepted, engine, allowed).any():
        _first(
            tc >= len(classes),
            "traffic_class_invalid",
            where,
            "traffic_class",
            lambda j: f"{tc[j]} is not an index into the step's {len(classes)} classes",
            columns=True,
        )
        method_ok = _code_mask(frozenset(allowed))[np.minimum(method, len(METHODS_BY_CODE))]
        _first(
            ~method_ok,
            "method_not_offered",
            where,
            "method",
            lambda j: (
                f"{_method_name(int(method[j]))} is not one of the engine's ({', '.join(sorted(allowed))})"
            ),
            columns=True,
            reason_of=lambda j: (
                "method_unknown" if method[j] >= len(METHODS_BY_CODE) else "method_not_offered"
            ),
        )
        _check_counts(k, drafted, accepted, engine.max_k, where, columns=True)
        _first(
            (method == _OFF_CODE) & (k > 0), "off_with_draft", where, "k", _off_with_draft(k), columns=True
        )
    seen: set[str] = set()
    for i, (m, v) in enumerate(c.counterfactual):
        at = f"{where}.counterfactual[{i}]"
        if m not in _METHODS or m == Method.OFF.value:
            raise TelemetryError("counterfactual_method_unknown", f"{at}.method: unknown method {shown(m)}")
        if m in seen:
            raise TelemetryError("counterfactual_method_repeated", f"{at}.method: {m!r} appears twice")
        seen.add(m)
        if len(v) != n:
            raise TelemetryError("columns_length", f"{at}.accepted: {len(v)} entries, but k has {n}")
        if n and ((v > engine.max_k) | (v < NOT_SCORED)).any():
            _check_counterfactual(v, at, engine.max_k)
    proposal = c.ngram_proposal
    if proposal is not None and n and int(proposal.max()) > engine.max_k:
        _first(
            proposal > engine.max_k,
            "ngram_proposal_gt_max",
            where,
            "ngram_proposal",
            lambda j: f"{proposal[j]} exceeds max_k {engine.max_k}",
            columns=True,
        )
    return columns_observation(step, c)


def _off_with_draft(k: np.ndarray) -> Callable[[int], str]:
    # No speculation drafts nothing: an "off" row claiming a draft (and its accepted tokens) would
    # count tokens no draft produced in the acceptance and goodput the policy learns from.
    return lambda j: f"{k[j]} on a row with method 'off' (no speculation drafts nothing: k must be 0)"


def _check_counterfactual(v: np.ndarray, at: str, max_k: int) -> None:
    _first(
        v > max_k,
        "counterfactual_gt_max",
        at,
        "accepted",
        lambda j: f"{v[j]} exceeds max_k {max_k}",
        columns=True,
    )
    _first(
        v < NOT_SCORED,
        "counterfactual_invalid",
        at,
        "accepted",
        lambda j: f"{v[j]} is below {NOT_SCORED} (not scored)",
        columns=True,
    )


@functools.lru_cache(maxsize=64)
def _code_mask(allowed: frozenset[str]) -> np.ndarray:
    """Per method code (one past the last: any unknown code), whether the engine may report it."""
    ok = np.zeros(len(METHODS_BY_CODE) + 1, dtype=bool)
    for m in allowed:
        ok[METHOD_CODES[Method(m)]] = True
    ok.flags.writeable = False  # shared between calls
    return ok


def _method_name(code: int) -> str:
    return repr(METHODS_BY_CODE[code].value) if code < len(METHODS_BY_CODE) else f"code {code}"


def _first(
    bad: np.ndarray,
    reason: str,
    where: str,
    field: str,
    describe: Callable[[int], str],
    *,
    columns: bool = False,
    reason_of: Callable[[int], str] | None = None,
) -> None:
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        path = f"{where}.{field}[{j}]" if columns else f"{where}.requests[{j}].{field}"
        raise TelemetryError(reason_of(j) if reason_of else reason, f"{path}: {describe(j)}")


def parse_policy_checked(text: str, *, source: str) -> PolicySpec:
    """``parse_policy`` for untrusted input: anything it fails on is a PolicyError, never a crash.

    The parser is meant to raise only PolicyError; this keeps an oversight in it (a value of a type
    it does not expect) from becoming an internal error on the admin API or a traceback in the CLI.
    """
    try:
        return parse_policy(text, source=source)
    except PolicyError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError, OverflowError) as e:
        raise PolicyError(f"invalid policy ({type(e).__name__}: {e})", source=source) from None
