"""One engine step as the plugin records it: cheap to build in the step, converted to protobuf later.

The engine step only fills numpy columns (traffic classes as indices into the plugin's class table,
no Python object per request but the id); the background sender turns them into a ``StepReport`` (in
its columnar form, which the sidecar reads in one pass, naming only the classes the step uses) so
protobuf work never lands on the engine's critical path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from controller.v1 import controller_pb2 as pb
from policies.arms import METHODS_BY_CODE, Method
from policies.observation import NOT_SCORED


@dataclass(frozen=True, slots=True)
class StepRecord:
    time_s: float
    duration_s: float
    batch_size: int
    queue_length: int
    queue_wait_s: float
    scheduled_k: int
    directive_version: int
    request_id: tuple[str, ...]
    #: Each request's traffic class: ``class_names[class_index[j]]`` (the table may name more classes).
    class_names: tuple[str, ...]
    class_index: np.ndarray
    method: np.ndarray  # int8 method codes of the verified draft
    k: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    cf_ngram: np.ndarray  # n-gram's counterfactual accepted count, NOT_SCORED where not scored
    finished: np.ndarray
    prefill_tokens: int = 0  # prompt tokens computed in the same step
    #: Per request, the n-gram proposer's draft length when its verified draft was planned (0: no
    #: match); None where the engine runs no n-gram index (not reported).
    ngram_proposal: np.ndarray | None = None

    def to_pb(self) -> pb.StepReport:
        """The step in the columnar wire form (``StepReport.columns``): one packed field per column."""
        used, class_idx = np.unique(self.class_index, return_inverse=True)
        names = self.class_names
        # A counterfactual nobody scored is left out, as the per-request rows leave the map entry out.
        scored = bool((self.cf_ngram != NOT_SCORED).any())
        return pb.StepReport(
            time_s=self.time_s,
            duration_s=self.duration_s,
            batch_size=self.batch_size,
            queue_length=self.queue_length,
            queue_wait_s=self.queue_wait_s,
            scheduled_k=self.scheduled_k,
            columns=pb.RequestColumns(
                request_id=self.request_id,
                classes=[names[i] for i in used.tolist()],
                traffic_class=class_idx.tolist(),
                method=self.method.tolist(),
                k=self.k.tolist(),
                drafted=self.drafted.tolist(),
                accepted=self.accepted.tolist(),
                counterfactual=[
                    pb.CounterfactualColumn(method=Method.NGRAM.value, accepted=self.cf_ngram.tolist())
                ]
                if scored
                else [],
                finished=self.finished.tolist(),
                ngram_proposal=self.ngram_proposal.tolist() if self.ngram_proposal is not None else [],
            ),
            directive_version=self.directive_version,
            prefill_tokens=self.prefill_tokens,
        )

    def to_json(self) -> str:
        prop = self.ngram_proposal
        d: dict[str, Any] = {
            "t": round(self.time_s, 6),
            "dur": round(self.duration_s, 6),
            "bs": self.batch_size,
            "queue": self.queue_length,
            "wait": round(self.queue_wait_s, 6),
            "k_step": self.scheduled_k,
            "dv": self.directive_version,
            "prefill": self.prefill_tokens,
            "reqs": [
                {
                    "id": rid,
                    "class": self.class_names[int(self.class_index[j])],
                    "method": METHODS_BY_CODE[int(self.method[j])].value,
                    "k": int(self.k[j]),
                    "drafted": int(self.drafted[j]),
                    "accepted": int(self.accepted[j]),
                    "cf_ngram": int(self.cf_ngram[j]),
                    "finished": bool(self.finished[j]),
                    **({} if prop is None else {"ngram_proposal": int(prop[j])}),
                }
                for j, rid in enumerate(self.request_id)
            ],
        }
        return json.dumps(d, separators=(",", ":"))
