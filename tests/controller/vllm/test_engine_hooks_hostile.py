"""The engine-core hooks driven through hundreds of synchronous steps of hostile traffic.

The fake scheduler admits requests with empty to 500-token prompts (ids reused after a request
leaves), schedules most of them each step, verifies the drafts they hold (some longer than max K),
samples what it accepted plus one (ids -1, 0, 1, 2, 2**31 - 1), finishes some in the update and aborts
others between steps, preempts and resumes some (their history restarts a few tokens shorter), and
the directive switches among off, n-gram and EAGLE-3 at K 1 and max K (K 0 <-> max mid-request).
(An aborted request's id is reused, now and then, in the very schedule that reports it finished: a
client that passes its own request ids and sends one again after an abort.)

What must hold: no hook raises; every step's report passes the sidecar's validation (one bad row
loses the whole batch it travels in); every live request's n-gram history is its own tokens; and
about 1,700 requests churning through the hooks leave the n-gram table sized by the requests live.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, read_batch, validate_hello
from controller.vllm.engine_hooks import EngineHooks
from controller.wire.convert import hello_from_engine_info
from policies.arms import Arm
from policies.context import ANY_CLASS
from policies.directive import PlanEntry
from tests.controller.vllm.test_engine_hooks import FakeLink, Req, _directive, _hooks_at

pytestmark = pytest.mark.usefixtures("kernels")
MAX_K = 4
ARMS = ("off", "ngram:1", f"ngram:{MAX_K}", "eagle3:1", f"eagle3:{MAX_K}")
IDS = (-1, 0, 1, 2, 2**31 - 1)


class Scheduler:
    """What the hooks read of vLLM's synchronous Scheduler."""

    def __init__(self) -> None:
        self.requests: dict[str, Req] = {}
        self.finished_req_ids: set[str] = set()
        self.waiting: list[Any] = []
        self.dynamic_sd_lookup = [MAX_K] * 1025


def _hooks() -> tuple[EngineHooks, FakeLink]:
    h = _hooks_at(
        MAX_K, _directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm.parse(f"eagle3:{MAX_K}"))), max_batch_size=1024
    )
    h.async_composite = False
    assert isinstance(h.link, FakeLink)
    return h, h.link


def _drive(
    seed: int,
    steps: int,
    *,
    max_live: int = 12,
    prompts: tuple[int, ...] = (0, 1, 2, 50, 500),
    labels: tuple[Any, ...] = ("c",),
    rid_prefix: str = "q",
) -> EngineHooks:
    rng = np.random.default_rng(seed)
    h, link = _hooks()
    info = validate_hello(hello_from_engine_info(h.controls.engine))
    s = Scheduler()
    held: dict[str, list[int]] = {}  # the draft each request holds for its next step
    aborted: list[str] = []
    for it in range(steps):
        if rng.random() < 0.2:
            link.d = _directive(
                it + 2, PlanEntry(ANY_CLASS, 1, 0, Arm.parse(ARMS[int(rng.integers(len(ARMS)))]))
            )
        for _ in range(int(rng.integers(0, max_live)) - len(s.requests)):
            # Ids reused, an aborted one's too: the schedule that reports it finished runs the new one.
            rid = f"{rid_prefix}{int(rng.integers(0, 3 * max_live))}"
            if rid not in s.requests:
                r = Req(rid, labels[int(rng.integers(len(labels)))])
                r._all_token_ids = [int(t) for t in rng.choice(IDS, int(rng.choice(prompts)))]
                s.requests[rid] = r
        ids = [rid for rid in s.requests if rng.random() < 0.9]
        spec = {rid: held[rid] for rid in ids if held.get(rid)}
        sampled = {rid: [int(t) for t in rng.choice(IDS, int(rng.integers(0, len(spec.get(rid, ())) + 1)) + 1)]
                   for rid in ids}  # fmt: skip
        for rid in ids:  # now and then a draft longer than max K (vLLM never verifies one)
            if rid in spec and rng.random() < 0.05:
                spec[rid] = spec[rid] + [5] * int(rng.integers(1, 4))
        resumed = {rid for rid in ids if rng.random() < 0.05}
        so = types.SimpleNamespace(
            num_scheduled_tokens={rid: 1 + len(spec.get(rid, ())) for rid in ids},
            scheduled_spec_decode_tokens=spec, finished_req_ids=set(aborted), total_num_scheduled_tokens=len(ids),
            num_spec_tokens_to_schedule=MAX_K, scheduled_new_reqs=[],
            scheduled_cached_reqs=types.SimpleNamespace(resumed_req_ids=resumed),
        )  # fmt: skip
        h.before_schedule(s)
        h.after_schedule(s, so)
        reqs = h.before_update(s, so)
        for rid in ids:  # vLLM's update: a resumed request may have lost output it resamples
            toks = s.requests[rid]._all_token_ids
            if rid in resumed:
                del toks[max(0, len(toks) - int(rng.integers(0, 4))) :]
            toks += sampled[rid]
        s.finished_req_ids = {rid for rid in ids if rng.random() < 0.1}
        mro = types.SimpleNamespace(sampled_token_ids=[sampled[r] for r in ids],
                                    req_id_to_index={r: i for i, r in enumerate(ids)})  # fmt: skip
        h.after_update(s, so, mro, reqs)
        for rid in s.finished_req_ids:
            del s.requests[rid]
        s.finished_req_ids = set()
        aborted = [rid for rid in s.requests if rng.random() < 0.02]  # in the next schedule's output
        for rid in aborted:
            del s.requests[rid]
        post = [rid for rid in ids if rid in s.requests]
        drafts = h.choose_drafts(post, [[5] * int(rng.integers(0, MAX_K + 1)) for _ in post])
        held = dict(zip(post, drafts, strict=True))
        assert h.scorer is not None
        for rid in post:  # each live request's n-gram history is its own tokens
            slot = h.controls.fast.slot_of(rid, -1)
            assert h.scorer.tokens(slot).tolist() == s.requests[rid]._all_token_ids, (it, rid)
        for rec in link.records:
            step = rec.to_pb()
            read_batch(pb.StepReportBatch(sequence=it + 1, steps=[step]), info, Limits())
            assert len(set(step.columns.request_id)) == len(step.columns.request_id)  # still one per request
        link.records.clear()
    return h


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_hostile_synchronous_traffic(seed: int) -> None:
    _drive(seed, 150)


#: Traffic-class labels as clients write them (``vllm_xargs``): a line break, a bidi override, a
#: terminal escape, 80 characters, a lone surrogate (JSON's "\ud800" decodes to one), not a string.
LABELS = ("c", "a\nb", "\u202eevil", "\x1b[31mred", "x" * 80, "\ud800", 123, "", "c\n")


def test_any_traffic_class_a_client_names_is_reported_as_one_the_sidecar_takes() -> None:
    """A request's class is its client's text. Reported as written, a control character in it made the
    sidecar refuse every batch holding a step of that request (all requests' steps, the stream ended
    each time), and a lone surrogate failed the link's encoding of the batch (its steps lost, not even
    counted). Distinct labels stay distinct classes."""
    h = _drive(3, 80, labels=LABELS)
    names = h.rows.class_names
    assert len(set(names)) == len(names) == len(LABELS)  # ("": the default class, named "default")


def test_any_request_id_a_client_names_is_reported_as_one_the_sidecar_takes() -> None:
    """vLLM's request ids carry the client's own (the request body's ``request_id``, the X-Request-Id
    header). Reported as they were, one over 256 characters made the sidecar refuse every batch holding
    a step of that request (request_id_too_long), and one holding a lone surrogate failed the link's
    encoding of the batch. Each request keeps an id of its own in the reports."""
    _drive(4, 40, rid_prefix="chatcmpl-\ud800" + "x" * 300)


def test_churning_requests_leave_the_table_sized_by_the_live_ones() -> None:
    """About 1,700 requests with prompts of up to 200 tokens pass through at most 16 live at once: the
    n-gram table stays within what 16 such requests need (2**13 rows here), not what all of them did
    (it reached 2**20 rows when sized by every entry it held, finished requests' included)."""
    h = _drive(11, 1500, max_live=16, prompts=(0, 30, 100, 200))
    assert h.scorer is not None
    assert h.controls.fast.slot_changes > 3000  # (a slot taken and given back per request)
    assert len(h.scorer.arrays()[2]) <= 1 << 16
