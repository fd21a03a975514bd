"""The step telemetry codec: a step's request columns to ``StepReport`` and back, written once.

Encoding: every engine builds a step's requests with ``encode_columns`` (arrays in, the columnar wire
form out): the vLLM plugin's ``StepRecord``, the demo engine's core, and ``request_columns`` for
callers holding names rather than codes. ``request_steps`` builds the older rows form (one message per
request), which the sidecar still accepts.

Decoding: ``decode_columns`` reads the columnar form into arrays without judging them, and
``columns_observation`` turns checked columns into a ``StepObservation``; the sidecar's validation
calls the two with its checks in between, and ``observation_from_pb`` (either form, already valid)
calls them back to back.

What must hold: ``observation_from_pb`` of an encoded step gives back the arrays it was built from
(values within the wire's types: uint32 counts read into int32 up to 2^31 - 1, counterfactuals int32);
only the classes the step uses go on the wire; a counterfactual column nobody scored is left out, as
the rows form leaves the map entry out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from controller.v1 import controller_pb2 as pb
from policies.arms import METHOD_CODES, Method
from policies.observation import NOT_SCORED, StepObservation


def encode_columns(
    *,
    class_names: Sequence[str],
    class_index: np.ndarray,
    method: np.ndarray,
    k: np.ndarray,
    drafted: np.ndarray,
    accepted: np.ndarray,
    request_id: Sequence[str] = (),
    counterfactual: Mapping[Method, np.ndarray] | None = None,
    finished: np.ndarray | None = None,
    ngram_proposal: np.ndarray | None = None,
    packed: bool = False,
) -> pb.RequestColumns:
    """A step's requests in the columnar wire form.

    Per request: ``class_names[class_index[j]]`` is its traffic class (the table may name more classes
    than the step uses; only the used ones are sent, in table order), ``method`` its method code
    (``METHOD_CODES``), ``counterfactual[m]`` method m's would-be accepted count (``NOT_SCORED`` where
    not scored). ``request_id``, ``finished`` and ``ngram_proposal`` may be left out (not reported).
    ``packed``: the integer columns as one ``packed`` byte string (for a sidecar that reads protocol
    2); a step without requests is sent the same either way. Raises ValueError for a value outside
    uint32, as protobuf does for the repeated fields.
    """
    used, inverse = np.unique(np.asarray(class_index, dtype=np.int64), return_inverse=True)
    n = len(inverse)
    if packed and n:
        rows = [inverse, method, k, drafted, accepted]
        if ngram_proposal is not None:
            rows.append(ngram_proposal)
        if finished is not None:
            rows.append(finished)
        block = np.empty((len(rows), n), dtype=np.int64)
        for i, row in enumerate(rows):
            block[i] = row
        if int(block.min()) < 0 or int(block.max()) > _UINT32_MAX:
            raise ValueError("encode_columns: a column value is outside uint32")
        return pb.RequestColumns(
            request_id=request_id,
            classes=[class_names[i] for i in used.tolist()],
            counterfactual=_counterfactual_columns(counterfactual),
            packed=block.astype("<u4").tobytes(),
            count=n,
            packed_ngram_proposal=ngram_proposal is not None,
            packed_finished=finished is not None,
        )
    return pb.RequestColumns(
        request_id=request_id,
        classes=[class_names[i] for i in used.tolist()],
        traffic_class=inverse.tolist(),
        method=np.asarray(method).tolist(),
        k=np.asarray(k).tolist(),
        drafted=np.asarray(drafted).tolist(),
        accepted=np.asarray(accepted).tolist(),
        counterfactual=_counterfactual_columns(counterfactual),
        finished=np.asarray(finished).tolist() if finished is not None else [],
        ngram_proposal=np.asarray(ngram_proposal).tolist() if ngram_proposal is not None else [],
    )


_UINT32_MAX = (1 << 32) - 1

#: The engine protocol that reads ``RequestColumns.packed`` (a sidecar says it reads it in
#: ``Directive.protocol_version``; engines send packed columns only then).
PACKED_PROTOCOL = 2
#: Steps one batch may report dropped since the batch before (a day at 10k steps/s, far below 2^63):
#: the sidecar refuses a batch beyond it, so an engine reports more in several batches.
MAX_DROPPED_STEPS = 1 << 30
#: Sequences and versions count batches and directives: 2^53 (exact in a JSON number, a float64)
#: takes 285 years at a million a second. Beyond it, a counter is garbage, not a count: the sidecar
#: refuses a report batch numbered beyond it or a step run under a directive numbered beyond it, so an
#: engine takes no directive numbered beyond it either (``convert.directive_for_engine``).
MAX_SEQUENCE = (1 << 53) - 1

#: The packed form's columns in their order (then ngram_proposal and finished, when flagged).
PACKED_COLUMNS = ("traffic_class", "method", "k", "drafted", "accepted")


def _counterfactual_columns(
    counterfactual: Mapping[Method, np.ndarray] | None,
) -> list[pb.CounterfactualColumn]:
    """One column per method someone scored (a column nobody scored is left out)."""
    return [
        pb.CounterfactualColumn(method=m.value, accepted=col.tolist())
        for m, col in ((m, np.asarray(v)) for m, v in (counterfactual or {}).items())
        if bool((col != NOT_SCORED).any())
    ]


def columns_count(c: pb.RequestColumns) -> int:
    """A columnar step's requests: ``count`` in the packed form, else the length of ``k``."""
    return c.count or len(c.k)


def packed_rows(c: pb.RequestColumns) -> int:
    """How many columns a packed step carries (5, plus the flagged optional ones)."""
    return 5 + int(c.packed_ngram_proposal) + int(c.packed_finished)


def packed_problem(c: pb.RequestColumns) -> str:
    """Why a step's columns are not a readable packed form ("" when they are, or are not packed)."""
    if not c.count:
        if len(c.packed) or c.packed_ngram_proposal or c.packed_finished:
            return "packed columns without a count (count is 0)"
        return ""
    both = [f for f in (*PACKED_COLUMNS, "finished", "ngram_proposal") if len(getattr(c, f))]
    if both:
        return f"packed columns and the repeated {both[0]} both set (a step carries one form)"
    rows = packed_rows(c)
    if len(c.packed) != 4 * rows * c.count:
        return f"{len(c.packed)} bytes, not 4 x count {c.count} x {rows} columns"
    return ""


def index_classes(names: Iterable[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """Per-request class names as a table (first appearance first) and each request's index into it."""
    table: dict[str, int] = {}
    index = np.fromiter((table.setdefault(c, len(table)) for c in names), dtype=np.int64)
    return tuple(table), index


@dataclass(frozen=True, slots=True)
class StepColumns:
    """A columnar step's requests as read off the wire (int64 arrays), nothing range-checked yet."""

    n: int  # requests: the length of ``k``
    classes: tuple[str, ...]
    request_id: tuple[str, ...]  # () when not reported
    traffic_class: np.ndarray  # per request: index into ``classes``
    method: np.ndarray  # per request: method code
    k: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    #: (method as sent, its column as sent), in wire order: repeats and unknown names are kept for
    #: validation to name.
    counterfactual: tuple[tuple[str, np.ndarray], ...]
    finished: np.ndarray | None  # None when not reported
    ngram_proposal: np.ndarray | None  # None when not reported


def _ints(col: Any) -> np.ndarray:
    return np.fromiter(col, dtype=np.int64, count=len(col))


def unpack_columns(
    columns: Sequence[pb.RequestColumns], sizes: Sequence[int], *, proposals: bool, finished: bool
) -> tuple[np.ndarray, ...]:
    """Packed steps of one layout (``packed_problem`` found nothing; ``sizes``: each step's count, 0
    for a step without requests) as columns over all their rows, from one read of their bytes:
    traffic_class, method, k, drafted, accepted and, when packed, ngram_proposal (int64) and finished
    (bool)."""
    rows = 5 + proposals + finished
    total = sum(sizes)
    words = np.frombuffer(b"".join([c.packed for c in columns]), dtype="<u4").astype(np.int64)
    if len(set(sizes)) == 1:  # one step, or every step the same size
        block = words.reshape(len(sizes), rows, sizes[0]).transpose(1, 0, 2).reshape(rows, total)
    else:  # request g of step i: its column r at starts[i] + r * n_i + (g - offsets[i])
        n = np.asarray(sizes, dtype=np.int64)
        starts = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(rows * n[:-1], out=starts[1:])
        offsets = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(n[:-1], out=offsets[1:])
        at = np.repeat(starts - offsets, n) + np.arange(total)
        block = words[at + np.arange(rows)[:, None] * np.repeat(n, n)]
    out = list(block[:5])
    if proposals:
        out.append(block[5])
    if finished:
        out.append(block[rows - 1] != 0)
    return tuple(out)


def decode_columns(c: pb.RequestColumns) -> StepColumns:
    """The columns as sent; lengths are not compared (validation does, before it trusts them). A
    packed step must have its layout checked first (``packed_problem``): else ValueError."""
    if c.count:
        problem = packed_problem(c)
        if problem:
            raise ValueError(f"decode_columns: {problem}")
        proposals, finished = c.packed_ngram_proposal, c.packed_finished
        tc, method, k, drafted, accepted, *extra = unpack_columns(
            [c], [c.count], proposals=proposals, finished=finished
        )
        return StepColumns(
            n=c.count,
            classes=tuple(c.classes),
            request_id=tuple(c.request_id),
            traffic_class=tc,
            method=method,
            k=k,
            drafted=drafted,
            accepted=accepted,
            counterfactual=tuple((col.method, _ints(col.accepted)) for col in c.counterfactual),
            finished=extra[-1] if finished else None,
            ngram_proposal=extra[0] if proposals else None,
        )
    return StepColumns(
        n=len(c.k),
        classes=tuple(c.classes),
        request_id=tuple(c.request_id),
        traffic_class=_ints(c.traffic_class),
        method=_ints(c.method),
        k=_ints(c.k),
        drafted=_ints(c.drafted),
        accepted=_ints(c.accepted),
        counterfactual=tuple((col.method, _ints(col.accepted)) for col in c.counterfactual),
        finished=np.fromiter(c.finished, dtype=bool, count=len(c.finished)) if len(c.finished) else None,
        ngram_proposal=_ints(c.ngram_proposal) if len(c.ngram_proposal) else None,
    )


def columns_observation(step: pb.StepReport, cols: StepColumns) -> StepObservation:
    """The observation of a columnar step whose columns have been checked (equal lengths, class
    indices in range, known methods: else IndexError or ValueError)."""
    n = cols.n
    names = tuple(x or "default" for x in cols.classes)
    return StepObservation(
        **step_fields(step, n),
        traffic_class=(names[0],) * n
        if len(names) == 1
        else tuple(names[i] for i in cols.traffic_class.tolist()),
        method=cols.method.astype(np.int8),
        k=cols.k.astype(np.int32),
        drafted=cols.drafted.astype(np.int32),
        accepted=cols.accepted.astype(np.int32),
        counterfactual={Method(m): v.astype(np.int32) for m, v in cols.counterfactual},
        request_id=cols.request_id or ("",) * n,
        finished=cols.finished if cols.finished is not None else np.zeros(n, dtype=bool),
        ngram_proposal=cols.ngram_proposal.astype(np.int32) if cols.ngram_proposal is not None else None,
    )


def step_fields(step: pb.StepReport, n: int) -> dict[str, Any]:
    """A step's own fields as ``StepObservation`` keywords (``n``: its requests, the batch if unset)."""
    return {
        "time_s": step.time_s,
        "duration_s": step.duration_s,
        "prefill_tokens": int(step.prefill_tokens),
        "batch_size": int(step.batch_size) or n,
        "queue_length": int(step.queue_length),
        "queue_wait_s": step.queue_wait_s,
    }


def ngram_proposal_from_pb(step: pb.StepReport) -> np.ndarray | None:
    """The step's n-gram proposals per request (int32), or None when not reported.

    Columns: an empty ``ngram_proposal`` means not reported. Rows: each row's optional field; a step
    reports it on every row or on none (validation checks), so the first row decides.
    """
    if step.HasField("columns"):
        col = step.columns.ngram_proposal
        return np.array(col, dtype=np.int32) if len(col) else None
    reqs = step.requests
    if not len(reqs) or not reqs[0].HasField("ngram_proposal"):
        return None
    return np.fromiter((r.ngram_proposal for r in reqs), dtype=np.int32, count=len(reqs))


def observation_from_pb(step: pb.StepReport) -> StepObservation:
    """Columns from a (validated) StepReport, in either form (rows or columns)."""
    if step.HasField("columns"):
        return columns_observation(step, decode_columns(step.columns))
    reqs = step.requests
    n = len(reqs)
    cf_methods = {m for r in reqs for m in r.counterfactual_accepted}
    cf: dict[Method, np.ndarray] = {}
    for m in cf_methods:
        cf[Method(m)] = np.fromiter(
            (r.counterfactual_accepted.get(m, NOT_SCORED) for r in reqs), dtype=np.int32, count=n
        )
    return StepObservation(
        **step_fields(step, n),
        traffic_class=tuple(r.traffic_class or "default" for r in reqs),
        method=np.fromiter((METHOD_CODES[Method(r.method)] for r in reqs), dtype=np.int8, count=n),
        k=np.fromiter((r.k for r in reqs), dtype=np.int32, count=n),
        drafted=np.fromiter((r.drafted for r in reqs), dtype=np.int32, count=n),
        accepted=np.fromiter((r.accepted for r in reqs), dtype=np.int32, count=n),
        counterfactual=cf,
        request_id=tuple(r.request_id for r in reqs),
        finished=np.fromiter((r.finished for r in reqs), dtype=bool, count=n),
        ngram_proposal=ngram_proposal_from_pb(step),
    )


def request_steps(
    *,
    request_ids: Iterable[str],
    classes: Iterable[str],
    methods: Iterable[str],
    ks: Iterable[int],
    drafted: Iterable[int],
    accepted: Iterable[int],
    counterfactual: dict[str, Iterable[int]] | None = None,
    finished: Iterable[bool] | None = None,
    ngram_proposal: Iterable[int] | None = None,
) -> list[pb.RequestStep]:
    """RequestStep messages from columns (engines build reports with this).

    ``ngram_proposal``: per request, the n-gram proposer's draft length before the step drafted (0 = no
    match); None when the engine runs no n-gram proposer (the field stays unset on every row).
    """
    cf_cols = {m: list(v) for m, v in (counterfactual or {}).items()}
    fin = list(finished) if finished is not None else None
    prop = [int(x) for x in ngram_proposal] if ngram_proposal is not None else None
    out = []
    for j, (rid, c, m, k, d, a) in enumerate(
        zip(request_ids, classes, methods, ks, drafted, accepted, strict=True)
    ):
        cf = {mm: int(col[j]) for mm, col in cf_cols.items() if int(col[j]) != NOT_SCORED}
        out.append(
            pb.RequestStep(
                request_id=rid,
                traffic_class=c,
                method=m,
                k=int(k),
                drafted=int(d),
                accepted=int(a),
                counterfactual_accepted=cf,
                finished=bool(fin[j]) if fin is not None else False,
                ngram_proposal=prop[j] if prop is not None else None,
            )
        )
    return out


def request_columns(
    *,
    request_ids: Iterable[str],
    classes: Iterable[str],
    methods: Iterable[str],
    ks: Iterable[int],
    drafted: Iterable[int],
    accepted: Iterable[int],
    counterfactual: dict[str, Iterable[int]] | None = None,
    finished: Iterable[bool] | None = None,
    ngram_proposal: Iterable[int] | None = None,
    packed: bool = False,
) -> pb.RequestColumns:
    """``encode_columns`` for callers holding names: the same arguments as ``request_steps``."""
    table, index = index_classes(classes)
    return encode_columns(
        class_names=table,
        class_index=index,
        method=np.array([METHOD_CODES[Method(m)] for m in methods], dtype=np.int64),
        k=np.array(list(ks), dtype=np.int64),
        drafted=np.array(list(drafted), dtype=np.int64),
        accepted=np.array(list(accepted), dtype=np.int64),
        request_id=list(request_ids),
        counterfactual={
            Method(m): np.array(list(v), dtype=np.int64) for m, v in (counterfactual or {}).items()
        },
        finished=np.array(list(finished), dtype=bool) if finished is not None else None,
        ngram_proposal=np.array(list(ngram_proposal), dtype=np.int64) if ngram_proposal is not None else None,
        packed=packed,
    )
