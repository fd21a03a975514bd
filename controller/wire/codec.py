"""The step telemetry codec: a step's request columns to ``StepReport`` (rows or columnar form) and back.

Engines build a step's requests with ``request_columns`` (the columnar form) or ``request_steps``
(one message per request); the sidecar reads either with ``observation_from_pb`` once validation has
checked it. What must hold: decoding an encoded step gives back the columns it was built from; a
counterfactual column nobody scored is left out, as the rows form leaves the map entry out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from controller.v1 import controller_pb2 as pb
from policies.arms import METHOD_CODES, Method
from policies.observation import NOT_SCORED, StepObservation


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
        return _observation_from_columns(step)
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


def _observation_from_columns(step: pb.StepReport) -> StepObservation:
    c = step.columns
    n = len(c.k)
    names = [x or "default" for x in c.classes]
    if len(names) == 1:
        traffic_class: tuple[str, ...] = (names[0],) * n
    else:
        traffic_class = tuple(names[i] for i in c.traffic_class)
    return StepObservation(
        **step_fields(step, n),
        traffic_class=traffic_class,
        method=np.array(c.method, dtype=np.int8),
        k=np.array(c.k, dtype=np.int32),
        drafted=np.array(c.drafted, dtype=np.int32),
        accepted=np.array(c.accepted, dtype=np.int32),
        counterfactual={
            Method(col.method): np.array(col.accepted, dtype=np.int32) for col in c.counterfactual
        },
        request_id=tuple(c.request_id) if len(c.request_id) else ("",) * n,
        finished=np.array(c.finished, dtype=bool) if len(c.finished) else np.zeros(n, dtype=bool),
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
) -> pb.RequestColumns:
    """The columnar form of ``request_steps`` (StepReport.columns); same arguments, same meaning."""
    index: dict[str, int] = {}
    class_idx = [index.setdefault(c, len(index)) for c in classes]
    return pb.RequestColumns(
        request_id=list(request_ids),
        classes=list(index),
        traffic_class=class_idx,
        method=[METHOD_CODES[Method(m)] for m in methods],
        k=[int(x) for x in ks],
        drafted=[int(x) for x in drafted],
        accepted=[int(x) for x in accepted],
        # A column nobody scored is left out, as rows leave the map entry out.
        counterfactual=[
            pb.CounterfactualColumn(method=m, accepted=col)
            for m, col in ((m, [int(x) for x in v]) for m, v in (counterfactual or {}).items())
            if any(x != NOT_SCORED for x in col)
        ],
        finished=[bool(x) for x in finished] if finished is not None else [],
        ngram_proposal=[int(x) for x in ngram_proposal] if ngram_proposal is not None else [],
    )
