"""One engine step as the plugin records it: cheap to build in the step, converted to protobuf later.

The engine step only fills numpy columns (traffic classes as indices into the plugin's class table,
no Python object per request but the id); the background sender turns them into a ``StepReport`` (in
its columnar form, which the sidecar reads in one pass, naming only the classes the step uses) so
protobuf work never lands on the engine's critical path. What must hold: every report it makes is one
the sidecar takes, whatever ids vLLM gave the requests (``request_ids_for_wire``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from controller.v1 import controller_pb2 as pb
from controller.wire.codec import encode_columns
from controller.wire.names import request_ids_for_wire
from policies.arms import METHODS_BY_CODE, Method


# Not frozen: a frozen dataclass's __init__ sets each of these fields through object.__setattr__,
# about 8 µs per engine step; nothing changes a record after the step builds it. The engine hook
# builds it positionally (EngineHooks.after_update): a change of field order changes the call there.
@dataclass(slots=True)
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

    def to_pb(self, packed: bool = False) -> pb.StepReport:
        """The step in the columnar wire form (``StepReport.columns``): the integer columns as one byte
        string when ``packed`` (a sidecar that reads protocol 2), else one repeated field each."""
        return pb.StepReport(
            time_s=self.time_s,
            duration_s=self.duration_s,
            batch_size=self.batch_size,
            queue_length=self.queue_length,
            queue_wait_s=self.queue_wait_s,
            scheduled_k=self.scheduled_k,
            columns=encode_columns(
                class_names=self.class_names,
                class_index=self.class_index,
                method=self.method,
                k=self.k,
                drafted=self.drafted,
                accepted=self.accepted,
                request_id=request_ids_for_wire(self.request_id),  # (vLLM's ids carry the client's)
                counterfactual={Method.NGRAM: self.cf_ngram},
                finished=self.finished,
                ngram_proposal=self.ngram_proposal,
                packed=packed,
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
