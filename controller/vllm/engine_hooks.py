"""The plugin inside vLLM's engine-core process: patches on the V1 ``Scheduler`` (vLLM 0.32).

Everything the plugin does happens in the engine-core process, between steps:

* ``schedule`` (before): the directive in force (or the safe default once its TTL lapsed) becomes the
  scheduler's ``dynamic_sd_lookup`` (batch size -> K, clamped to ``num_speculative_tokens``);
  (after): queue length and the queue wait of requests that left the queue.
* ``update_from_output`` (after): per request, the drafted and accepted counts of the draft verified
  this step, with the method and K the plugin chose for it; n-gram's counterfactual acceptance from
  the request's token history; the fast loop's feedback; one ``StepRecord`` offered to the link.
* ``update_draft_token_ids`` (before; synchronous scheduling only, EngineCore.post_step): the
  composite drafter. The worker ran the configured EAGLE-3 / P-EAGLE drafter as usual (so its draft KV
  cache always sees the verified tokens, whatever was verified); here the fast loop plans each
  request's next draft and the scheduler receives, per request, the EAGLE draft, the n-gram draft
  (vLLM's n-gram matcher on the same tokens) or nothing, cut to that request's K.

* ``AsyncScheduler._update_after_schedule`` (after; async scheduling only): each request's placeholders
  cut to its own planned K, the n-gram requests named for the worker (``NGRAM_ROWS_ATTR``) and the K
  the worker runs EAGLE at (``EAGLE_K_ATTR``: the largest of its own rows', at least 1, a prepared K;
  V1 runner only, see ``worker.py``).

Under synchronous scheduling the drafter's K is lowered too, in ``schedule`` (after): the step's
``num_spec_tokens_to_schedule`` becomes the largest K the step's EAGLE rows are likely to plan next
(``_narrow_drafter``; their plans are made only after the step), so a batch of n-gram rows does not
pay EAGLE forwards at the table's K.

The per-request work of both update hooks runs as one compiled batch kernel each (``hotpath.py``).

Because the choice is made where the scheduler holds the drafts, no per-request choice has to travel
to the worker process. Any exception in a hook disables the plugin for the engine's lifetime (logged
once) and leaves vLLM's behaviour as configured: a plugin bug must never stop serving.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import operator
import os
import socket
import time
from collections.abc import Callable, Collection
from typing import Any, TextIO

import numpy as np

from controller.vllm import compat
from controller.vllm.control import Controls, describe_safe_default, engine_info
from controller.vllm.hotpath import StepKernel
from controller.vllm.link import SidecarLink
from controller.vllm.mode import (
    EAGLE_K_ATTR,
    NGRAM_ROWS_ATTR,
    PER_REQUEST_COMPOSITE,
    configured_method,
    is_async,
    k_table_only_reason,
    plugin_mode,
)
from controller.vllm.ngram import NgramIndex
from controller.vllm.peagle import depth_fix_problem
from controller.vllm.record import StepRecord
from controller.vllm.rows import RequestTable
from controller.vllm.settings import MAX_ENGINE_ID_SETTING, PluginSettings
from controller.vllm.v2 import V2_POINTS
from controller.wire.convert import hello_from_engine_info
from controller.wire.names import traffic_class_name
from policies.arms import METHOD_CODES, Arm, Method
from policies.jit import compiling

log = logging.getLogger("vllm.speccontrol")
_spec_token_ids = operator.attrgetter("spec_token_ids")

_OFF = METHOD_CODES[Method.OFF]
_NGRAM = METHOD_CODES[Method.NGRAM]
#: SchedulerOutput attribute (async scheduling): the plans of the drafts it verifies, as
#: (requests, one row each: method code, K, n-gram proposal; -1 method: none recorded, -1 proposal:
#: unknown when planned); see ``verifying_plans``.
VERIFYING_ATTR = "speccontrol_verifying"
#: SchedulerOutput attribute: set once the hooks released the requests it reports finished (see
#: ``EngineHooks._release_finished``), so that no later hook of that step releases them again.
RELEASED_ATTR = "speccontrol_released"


def verifying_plans(scheduler_output: Any) -> dict[str, tuple[int, int, int]]:
    """The plans a scheduler output carries (``VERIFYING_ATTR``), per request that has one."""
    ids, plans = getattr(scheduler_output, VERIFYING_ATTR, ([], np.zeros((0, 3))))
    return {rid: (m, k, p) for rid, (m, k, p) in zip(ids, plans.tolist(), strict=True) if m >= 0}


def engine_id_of(settings: PluginSettings, model: str, vllm_config: Any) -> str:
    """The id the engine core says Hello with: ``SPECCONTROL_ENGINE_ID``, else ``<model>@<host>``. With
    data parallelism every rank has its own engine core, scheduler and stream, often on one host and
    with one environment, so ``/dp<rank>`` is added: under one id the ranks' streams would be taken
    for one engine. A ``<model>@<host>`` beyond the sidecar's limit (a long model path) keeps its
    tail behind a short hash of the whole, so it still attaches and stays distinct."""
    base = settings.engine_id or _fit(f"{model}@{socket.gethostname()}", MAX_ENGINE_ID_SETTING)
    pc = vllm_config.parallel_config
    if int(getattr(pc, "data_parallel_size", 1) or 1) <= 1:
        return base
    return f"{base}/dp{int(getattr(pc, 'data_parallel_rank', 0) or 0)}"


def _fit(name: str, limit: int) -> str:
    if len(name) <= limit:
        return name
    digest = hashlib.blake2s(name.encode(), digest_size=4).hexdigest()
    return f"{digest}~{name[len(name) - (limit - len(digest) - 1) :]}"


def fixed_table_reason(vllm_config: Any, lookup: list[int] | None) -> str | None:
    """Why the plugin must leave vLLM's K table alone (None: it may swap it).

    The table is swapped only in an engine vLLM started with ``num_speculative_tokens_per_batch_size``
    (so vLLM set up dynamic K: per-K CUDA graphs, the PIECEWISE override, uniform-decode padding) and
    never with data parallelism, where ranks choosing different K diverge and deadlock (vLLM drops the
    schedule under DP for that reason)."""
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
    if dp > 1:
        return f"data parallel size {dp}: every rank must draft the same K per step"
    if lookup is None:
        return (
            "the engine was not started with speculative_config.num_speculative_tokens_per_batch_size, "
            "so vLLM did not prepare dynamic K"
        )
    return None


class EngineHooks:
    """The plugin's state for one scheduler."""

    def __init__(
        self,
        *,
        settings: PluginSettings,
        controls: Controls,
        link: SidecarLink,
        scorer: NgramIndex | None,
        method: Method,
        trace: TextIO | None = None,
        wall: Callable[[], float] = time.time,
        perf: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.settings = settings
        self.controls = controls
        self.link = link
        self.scorer = scorer
        self.method = method
        self.trace = trace
        self.wall, self.perf = wall, perf
        self.directive = controls.safe
        self._alpha = float(self.directive.rule.params.get("alpha", 0.3))  # the fast loop's, per directive
        self.rows = RequestTable(configured=method, max_k=controls.engine.max_k)
        self.kernels = StepKernel(controls=controls, rows=self.rows, scorer=scorer)
        self._t0 = 0.0
        self._queue_len = 0
        self._queue_wait = 0.0
        #: The requests of the last update that sampled nothing (None: none; ``choose_drafts``).
        self._idle: set[str] | None = None
        self.original_lookup: list[int] | None = None
        #: "per-request composite" or "K table only: <reason>" (Hello.plugin_mode).
        self.mode = PER_REQUEST_COMPOSITE
        #: Async scheduling with the worker-side merge: plans are made when placeholders are sized.
        self.async_composite = False
        #: Synchronous scheduling with the composite drafter and EAGLE-3 / P-EAGLE: the drafter runs at
        #: the K its rows need (``_narrow_drafter``; where the table may be swapped), not the table's.
        self.sync_drafter_k = False
        #: Whether the scheduler's K table may be swapped (see ``fixed_table_reason``).
        self.swap_table = True
        #: vLLM's ``-1`` placeholders for a draft of K tokens, index K (async scheduling).
        self._placeholder_lists = [[-1] * k for k in range(controls.engine.max_k + 1)]
        #: Per largest K planned for the configured drafter's rows, the K it runs at (``EAGLE_K_ATTR``).
        self._drafter_ks = controls.drafter_ks
        #: Whether the scheduler may hold finished requests (a connector; see ``before_update``).
        self._holds_finished: bool | None = None

    @classmethod
    def create(cls, scheduler: Any, settings: PluginSettings) -> EngineHooks | None:
        vc = scheduler.vllm_config
        spec = vc.speculative_config
        if spec is None:
            log.warning("speccontrol: the engine has no speculative_config; plugin inactive")
            return None
        method = configured_method(spec)
        if method is None:
            log.warning("speccontrol: drafting method %r is not supported; plugin inactive", spec.method)
            return None
        max_k = int(spec.num_speculative_tokens)
        async_sched = is_async(vc)
        reason = k_table_only_reason(settings=settings, method=method, vllm_config=vc)
        if reason is None and async_sched:
            v2 = bool(getattr(vc, "use_v2_model_runner", False))
            bad = compat.problems(V2_POINTS if v2 else compat.V1_WORKER_POINTS, version=None)
            if bad:
                runner = "V2" if v2 else "V1"
                reason = f"async scheduling, and the {runner} model runner does not match: " + "; ".join(bad)
        composite = reason is None
        # P-EAGLE at 0 < K < max needs the depth fix, which the worker installs after the same check.
        depths_problem = depth_fix_problem() if method is Method.P_EAGLE else None
        p_eagle_depths = method is Method.P_EAGLE and depths_problem is None
        mode = plugin_mode(reason, p_eagle_depths=depths_problem)
        fixed = fixed_table_reason(vc, scheduler.dynamic_sd_lookup)
        if fixed is not None and not composite:
            log.error(
                "speccontrol: refused, plugin inactive (vLLM runs as configured): %s, and without the "
                "composite drafter (%s) there is nothing else to control",
                fixed,
                reason,
            )
            return None
        schedule = getattr(spec, "num_speculative_tokens_per_batch_size", None) or ()
        table_ks = frozenset(int(entry[2]) for entry in schedule) or None
        if not composite and method is not Method.NGRAM and settings.composite:
            log.warning("speccontrol: composite drafting off: %s; only the K table is controlled", reason)
        names = vc.model_config.served_model_name
        model = str(names[0] if isinstance(names, list | tuple) else names or vc.model_config.model)
        info = engine_info(
            engine_id=engine_id_of(settings, model, vc),
            model=model,
            method=method,
            max_k=max_k,
            max_batch_size=int(vc.scheduler_config.max_num_seqs),
            composite=composite,
            table_ks=table_ks,
            p_eagle_depths=p_eagle_depths,
        )
        import vllm  # type: ignore[import-not-found]

        hello = hello_from_engine_info(info, engine_version=f"vllm {vllm.__version__}", plugin_mode=mode)
        link = SidecarLink(
            target=settings.sidecar,
            hello=hello,
            queue_size=settings.queue_size,
            batch_max=settings.batch_max,
            flush_s=settings.flush_s,
            credentials=settings.credentials(),
        )
        scorer = (
            NgramIndex(
                max_k=max_k,
                min_n=settings.ngram_min,
                max_n=settings.ngram_max,
                max_model_len=int(vc.model_config.max_model_len),
            )
            if composite
            else None
        )
        controls = Controls(
            engine=info,
            method=method,
            safe_default=settings.safe_default or Arm(method, max_k),
            composite=composite,
            capacity=int(vc.scheduler_config.max_num_seqs) * 2,
            table_ks=table_ks,
            p_eagle_depths=p_eagle_depths,
            placeholders=composite and async_sched,
            # Without SPECCONTROL_SAFE_DEFAULT the engine on its own runs as vLLM was started: its
            # start-up K per batch size where it has one (it ran its largest K at every batch size).
            safe_table=(
                list(scheduler.dynamic_sd_lookup) if settings.safe_default is None and fixed is None else None
            ),
        )
        safe_arm = controls.safe_arm
        if settings.safe_default is not None and safe_arm != settings.safe_default:
            log.warning(
                "speccontrol: SPECCONTROL_SAFE_DEFAULT=%s is not playable here (%s, max K %d%s); "
                "the safe default runs as %s",
                settings.safe_default,
                method.value,
                max_k,
                ", with n-gram" if composite and method is not Method.NGRAM else "",
                safe_arm,
            )
        trace = open(settings.trace_path, "a", buffering=1) if settings.trace_path else None  # noqa: SIM115
        hooks = cls(
            settings=settings, controls=controls, link=link, scorer=scorer, method=method, trace=trace
        )
        hooks.mode = mode
        hooks.swap_table = fixed is None
        hooks.async_composite = composite and async_sched
        hooks.sync_drafter_k = composite and not async_sched and method is not Method.NGRAM
        hooks.original_lookup = scheduler.dynamic_sd_lookup
        hooks.warm_up()  # compile the step kernels now (workers are up), not in the first steps
        link.start()
        log.info(
            "speccontrol: engine %s attaching to %s (%s, max K %d, %s, %s scheduling, plugin mode: %s; "
            "safe default: %s)",
            info.engine_id,
            settings.sidecar,
            method.value,
            max_k,
            info.granularity.name,
            "async" if async_sched else "synchronous",
            mode,
            describe_safe_default(controls.safe),
        )
        if fixed is not None:
            log.warning("speccontrol: the K table stays as vLLM set it (%s); K is cut per request", fixed)
        return hooks

    # -- schedule ---------------------------------------------------------------------------------

    def before_schedule(self, scheduler: Any) -> None:
        self._t0 = self.perf()
        d = self.controls.in_force(self.link.fresh_directive())
        if d is not self.directive:
            self.directive = d
            self._alpha = float(d.rule.params.get("alpha", 0.3))
        if self.swap_table:
            scheduler.dynamic_sd_lookup = self.controls.k_table(self.directive)

    def after_schedule(self, scheduler: Any, out: Any) -> None:
        if out.finished_req_ids:  # (the call only where one finished: this runs every step)
            self._release_finished(out)
        if self.sync_drafter_k:
            self._narrow_drafter(out)
        self._queue_len = len(scheduler.waiting)
        new = out.scheduled_new_reqs
        if new:
            now = self.wall()
            waits = [
                now - r.arrival_time
                for r in (scheduler.requests.get(n.req_id) for n in new)
                if r is not None and r.arrival_time
            ]
            self._queue_wait = max(0.0, sum(waits) / len(waits)) if waits else 0.0
        else:
            self._queue_wait = 0.0

    def _narrow_drafter(self, out: Any) -> None:
        """Synchronous scheduling: the K vLLM runs the configured drafter at after this step
        (``num_spec_tokens_to_schedule``: vLLM's V1 runner reads it for nothing else, and the drafts
        reach the scheduler whole, so no request's n-gram draft is cut by it) lowered from the
        table's entry to the largest K its own rows are likely to plan (``drafter_k_guess``: their
        pending plans are this step's, the new ones are made after it), at least 1, raised to a K
        vLLM prepared: as under async scheduling (``size_placeholders``), a step whose rows all draft
        n-gram or nothing runs the drafter's first forward only. A row whose plan then wants more
        gets what was drafted (``StepKernel.choose`` cuts the plan to the drafts' length). The guess
        is usually ``choose``'s own (``StepKernel.chosen_drafter_k``)."""
        width = out.num_spec_tokens_to_schedule
        scheduled = out.num_scheduled_tokens
        # (not where vLLM did not prepare dynamic K, nor under data parallelism: fixed_table_reason)
        if width <= 1 or not scheduled or not self.swap_table:
            return
        # The usual step schedules the rows the last update_draft_token_ids planned, or fewer: its
        # kernel made the guess then. New or resumed requests (no plan pending) need it made afresh.
        top = self.kernels.chosen_drafter_k(self.directive, len(scheduled))
        cached = getattr(out, "scheduled_cached_reqs", None)
        if top < 0 or out.scheduled_new_reqs or getattr(cached, "resumed_req_ids", None):
            ids = list(scheduled)
            top = self.kernels.drafter_k_guess(self.directive, ids, len(ids))
        k = min(self._drafter_ks[top], width)
        if k < width:
            out.num_spec_tokens_to_schedule = k

    # -- update_from_output -----------------------------------------------------------------------

    def before_update(self, scheduler: Any, scheduler_output: Any) -> dict[str, Any]:
        """The Request objects of this step that the scheduler holds (the update frees finished ones),
        less those that finished before this update: vLLM skips their rows. Only a scheduler with a
        KV (or encoder) connector holds finished requests (it may delay freeing one until its cache
        is sent), and under async scheduling the step after the one a request stopped in runs it
        still: reported, its row would admit it again after the schedule that reported it finished
        released it, and nothing would release it then."""
        reqs = scheduler.requests
        known = list(filter(reqs.__contains__, scheduler_output.num_scheduled_tokens))
        got = dict(zip(known, map(reqs.__getitem__, known), strict=True))
        if self._holds_finished is None:
            self._holds_finished = any(
                getattr(scheduler, name, None) is not None for name in ("connector", "ec_connector")
            )
        if self._holds_finished:
            for rid in [rid for rid, r in got.items() if r.is_finished()]:
                del got[rid]
        return got

    def after_update(self, scheduler: Any, scheduler_output: Any, mro: Any, requests: dict[str, Any]) -> None:
        sampled = mro.sampled_token_ids
        n_sampled = len(sampled) if sampled else 0
        index = mro.req_id_to_index.get
        spec = scheduler_output.scheduled_spec_decode_tokens
        # The rows: requests that sampled this step (a prefill chunk samples nothing). Comprehensions
        # and map (C loops) only: on the hot path one numpy call costs more than a Python row.
        rows = None
        if sampled:
            try:  # the usual step: every request has its row (no default, no clamp, no copy)
                rows = list(map(sampled.__getitem__, map(mro.req_id_to_index.__getitem__, requests)))
            except (KeyError, IndexError):
                rows = None
        if rows is None:
            past = itertools.repeat(n_sampled)  # a request without a row reads the empty one past the end
            rows = list(map([*(sampled or ()), ()].__getitem__, map(min, map(index, requests, past), past)))
        if all(rows):  # every request sampled (no prefill chunk)
            ids, gens = list(requests), rows
            self._idle = None
        else:
            ids = list(itertools.compress(requests, rows))
            gens = list(filter(None, rows))
            self._idle = set(itertools.compress(requests, map(operator.not_, rows)))
        n = len(ids)
        done = getattr(scheduler, "finished_req_ids", None)
        is_finished: Callable[[str], bool] | None
        if isinstance(done, set):  # vLLM adds every request it finishes or frees (kept until next schedule)
            is_finished = done.__contains__ if done else None
        else:
            live = scheduler.requests

            def is_finished(rid: str) -> bool:
                return bool(requests[rid].is_finished()) or rid not in live

        def start(j: int, slot: int) -> None:  # a request the plugin has not seen
            req = requests[ids[j]]
            self.rows.set_class(slot, self._traffic_class(req))
            if self.scorer is not None:
                self.scorer.start(slot, req._all_token_ids)

        if scheduler_output.finished_req_ids:  # (the schedule hooks did, unless they did not run)
            self._release_finished(scheduler_output)
        # A resumed request's history restarts from its own tokens: vLLM may have dropped output the
        # index already took (drop-mode stale output after a preemption, a failed KV load) and
        # resamples those positions. Only on a step that resumes a request (no cost on the others).
        # Its plan too: the draft planned before its preemption was never verified (vLLM cleared it).
        # So does a request scheduled as new under an id the hooks hold: the V2 runner's schedules
        # list resumed requests as new (resumed_req_ids stays empty), and a streaming-input session's
        # next chunk comes as new with the last sampled token dropped and the chunk appended.
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        resumed = getattr(cached, "resumed_req_ids", None)
        new = getattr(scheduler_output, "scheduled_new_reqs", None)
        if new:
            resumed = {*(resumed or ()), *(r.req_id for r in new)}
        indexed = self._restart(resumed, ids, requests) if resumed else ()
        # async scheduling: the plans the verified drafts were made with travelled with the output
        plans = getattr(scheduler_output, VERIFYING_ATTR, None)
        cols, finished, ended = self.kernels.after_update(
            ids,
            gens,
            spec,
            is_finished,
            self._alpha,
            start,
            plans,
            indexed,
        )
        now = self.wall()
        duration = max(self.perf() - self._t0, 0.0)
        # A decode row schedules one token plus its draft; anything beyond that is prompt (a prefill
        # chunk), whose time is in this step's duration too. (vLLM trims a row's draft to what it
        # schedules, so no row holds less than its one token plus its draft.)
        scheduled = scheduler_output.num_scheduled_tokens
        prefill = max(sum(scheduled.values()) - len(scheduled) - sum(map(len, spec.values())), 0)
        # Positional, in StepRecord's field order: 19 keywords cost the step about 1.5 µs more.
        # Rows by index: unpacking the array (its iterator) costs about 2 us more.
        method, k, drafted, accepted, cf, cls, proposal = (cols[0], cols[1], cols[2], cols[3], cols[4], cols[5],
                                                           cols[6])  # fmt: skip
        rec = StepRecord(
            now,
            duration,
            max(len(scheduled), n),
            self._queue_len,
            self._queue_wait,
            int(scheduler_output.num_spec_tokens_to_schedule or 0),
            self.directive.version,
            tuple(ids),
            self.rows.class_names,
            cls,
            method,
            k,
            drafted,
            accepted,
            cf,
            finished,
            prefill,
            proposal if self.scorer is not None else None,
        )
        if ended:
            for rid in itertools.compress(ids, finished.tolist()):
                self._release(rid)
        if not n and not scheduler_output.total_num_scheduled_tokens:
            return  # an idle step: nothing ran
        self.link.offer(rec)
        if self.trace is not None:
            self.trace.write(rec.to_json() + "\n")

    def _release_finished(self, so: Any) -> None:
        """Release the requests the scheduler output ``so`` reports finished, once per output, before
        any hook of its step looks a request up. They finished (or were aborted) before ``so`` was
        scheduled, so none of them is a row of its step or of a step still in flight; but ``so`` may
        schedule a new request under one of their ids (a client's own request id, reused after an
        abort), which must start with its own class, history and no plan, not take the old slot. So
        this runs where the step's output first reaches the hooks: ``size_placeholders`` (async
        scheduling, inside ``schedule``), else ``after_schedule``. (Released after the update instead,
        under async scheduling they would take along a new request that the next schedule, run before
        that update, admitted under such an id.)"""
        done = so.finished_req_ids
        if done and not getattr(so, RELEASED_ATTR, False):
            for rid in done:
                self._release(rid)
            setattr(so, RELEASED_ATTR, True)

    def _restart(self, resumed: Collection[str], ids: list[str], requests: dict[str, Any]) -> list[int]:
        """Forget each resumed request's pending plan, take its class again (a streaming session's
        chunk brings its own sampling parameters), and restart the n-gram history of each one the
        index holds from the request's own tokens (after vLLM's update: this step's included); the
        rows of ``ids`` restarted so, which then bring no tokens to the index. A request the hooks
        have not seen is left alone: it starts from its tokens anyway."""
        row = {rid: j for j, rid in enumerate(ids)}
        out = []
        verifying, _, admitted = self.rows.arrays()
        for rid in resumed:
            req = requests.get(rid)
            s = self.controls.fast.slot_of(rid, -1)
            if 0 <= s < len(verifying):
                verifying[s] = -1
                if req is not None and admitted[s]:  # (admitted: its class was set)
                    self.rows.set_class(s, self._traffic_class(req))
            if req is None or s < 0 or self.scorer is None or not self.scorer.live(s):
                continue
            self.scorer.start(s, req._all_token_ids)
            j = row.get(rid)
            if j is not None:
                out.append(j)
        return out

    def _traffic_class(self, req: Any) -> str:
        sp = getattr(req, "sampling_params", None)
        extra = getattr(sp, "extra_args", None) or {}
        c = extra.get(self.settings.class_key)
        # The client's text: reported as a name the sidecar takes (one it refuses loses the batch).
        return traffic_class_name(str(c)) if c else "default"

    def _release(self, rid: str) -> None:
        s = self.controls.fast.release(rid)
        if s is not None:
            self.rows.release(s)
            if self.scorer is not None:
                self.scorer.release(s)

    # -- update_draft_token_ids (synchronous scheduling) -----------------------------------------

    def choose_drafts(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        # vLLM drops the draft of a row that sampled nothing in the update just before (a prefill
        # chunk, scheduler.py:2560-2564): its plan must not be read as the plan of the draft its next
        # sampling step verifies (none). The usual step (every row sampled) checks one attribute.
        idle = self._idle
        unplanned = [j for j, rid in enumerate(req_ids) if rid in idle] if idle else []
        return self.kernels.choose(self.directive, req_ids, drafts, unplanned)

    def warm_up(self) -> None:
        """Run every step kernel once on throwaway state, so numba compiles before serving (growth
        paths included: a tiny arena and a table past half load)."""
        if not compiling():
            return
        t = time.perf_counter()
        method, max_k = self.method, self.controls.engine.max_k
        ctl = Controls(engine=self.controls.engine, method=method, safe_default=Arm(method, max_k),
                       composite=self.controls.composite, capacity=4,
                       p_eagle_depths=self.controls.p_eagle_depths)  # fmt: skip
        rows = RequestTable(configured=method, max_k=max_k, capacity=4)
        ix = None
        if self.scorer is not None:
            ix = NgramIndex(max_k=max_k, min_n=self.scorer.min_n, max_n=self.scorer.max_n, capacity=4)
            ix._pool = ix._pool[:8]
        k = StepKernel(controls=ctl, rows=rows, scorer=ix)
        history = (np.arange(3000) % 1009).tolist()

        def start(j: int, slot: int) -> None:
            rows.set_class(slot, "default")
            if ix is not None:
                ix.start(slot, history)

        for _ in range(2):
            k.after_update(["a"], [[1]], {"a": [1]}, lambda rid: False, 0.3, start)
            k.choose(ctl.safe, ["a"], [[1] * max_k])
            k.place(ctl.safe, ["a"], [max_k], 1, ["a"])  # async scheduling's plan
            k.drafter_k_guess(ctl.safe, ["a", "b"], 2)  # synchronous scheduling's afresh
        log.info("speccontrol: step kernels compiled in %.1f s", time.perf_counter() - t)

    # -- AsyncScheduler._update_after_schedule (async scheduling) ------------------------------

    def size_placeholders(self, scheduler: Any, scheduler_output: Any) -> None:
        """Each request's next draft: its own number of ``-1`` placeholders (its K) and, for the
        worker, which requests get the n-gram draft (``NGRAM_ROWS_ATTR`` on the scheduler output) and
        the K the configured drafter proposes at (``EAGLE_K_ATTR``: the largest K of its own rows, at
        least 1, raised to a K vLLM prepared, at most ``num_spec_tokens_to_schedule``; the V1 worker
        runs EAGLE at it and n-gram rows fill the rest of the width).

        The plan made here is verified in the next step that schedules the request; it travels on
        that step's output (``VERIFYING_ATTR``), because with the batch queue the update of step N
        can run after step N+1 was scheduled."""
        so = scheduler_output
        if so.finished_req_ids:  # first: a new request may reuse the id of one reported finished
            self._release_finished(so)
        reqs = scheduler.requests
        scheduled = so.num_scheduled_tokens
        rq = list(map(reqs.get, scheduled))
        held = list(map(_spec_token_ids, rq)) if None not in rq else []
        if held and all(held):  # the usual step: every scheduled request has placeholders
            ids = list(scheduled)
        else:
            ids = [rid for rid in scheduled if (r := reqs.get(rid)) is not None and r.spec_token_ids]
            rq = list(map(reqs.__getitem__, ids))
            held = list(map(_spec_token_ids, rq))
        # vLLM gives every row the same placeholder list: one room then (count compares by identity first).
        rooms = [len(held[0])] if held and held.count(held[0]) == len(held) else list(map(len, held))
        # The plan in one kernel call (as update_draft_token_ids plans under synchronous scheduling),
        # cut to each row's placeholders and kept per slot; the plans of the drafts verified in this
        # step are taken out to travel with it. The rest in C loops (map, compress), no row of Python.
        ks, on_ngram, verifying = self.kernels.place(
            self.directive,
            ids,
            rooms,
            len(scheduled),
            so.scheduled_spec_decode_tokens,
            lambda j, slot: self.rows.set_class(slot, self._traffic_class(rq[j])),  # a request's first plan
        )
        setattr(so, VERIFYING_ATTR, verifying)
        # Each row's own placeholders (one shared list per K; nobody mutates them: vLLM shares one too).
        collections.deque(
            map(
                setattr, rq, itertools.repeat("spec_token_ids"), map(self._placeholder_lists.__getitem__, ks)
            ),
            maxlen=0,
        )
        # The K the configured drafter proposes at in the worker: its own rows' largest (n-gram rows
        # only fill placeholders; off rows have none), raised to a prepared K, at most the width.
        top = max(itertools.compress(ks, map(operator.not_, on_ngram)), default=0)
        width = so.num_spec_tokens_to_schedule
        # (the full width where vLLM did not prepare dynamic K, or ranks must agree: fixed_table_reason)
        eagle_k = min(self._drafter_ks[top], width) if self.swap_table else width
        setattr(so, NGRAM_ROWS_ATTR, frozenset(itertools.compress(ids, on_ngram)))
        setattr(so, EAGLE_K_ATTR, eagle_k)  # last: set only where the plan above is whole

    def close(self) -> None:
        self.link.close()
        if self.trace is not None:
            self.trace.close()


def install(settings: PluginSettings) -> bool:
    """Patch the V1 Scheduler (idempotent); False, with one log line, when vLLM is outside the tested
    range or a patch point differs (nothing is patched then). Only the engine-core process builds a
    Scheduler, so only it attaches."""
    with contextlib.suppress(Exception):
        if getattr(compat.resolve(compat.SCHEDULER_CLASS), "_speccontrol_patched", False):
            return True  # our own wrappers no longer have vLLM's signatures
    bad = compat.problems(compat.INSTALL_POINTS, version=compat.installed_version())
    if bad:
        log.error("speccontrol: plugin not installed, vLLM left unpatched: %s", "; ".join(bad))
        return False
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # type: ignore[import-not-found]
    from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore[import-not-found]
    from vllm.v1.outputs import DraftTokenIds  # type: ignore[import-not-found]

    orig_init = Scheduler.__init__
    orig_after_async = AsyncScheduler._update_after_schedule
    orig_schedule = Scheduler.schedule
    orig_update = Scheduler.update_from_output
    orig_drafts = Scheduler.update_draft_token_ids

    def _disable(self: Any, where: str) -> None:
        log.exception(
            "speccontrol: %s failed; plugin disabled for this engine (vLLM runs as configured)", where
        )
        hooks = getattr(self, "_speccontrol", None)
        self._speccontrol = None
        if hooks is not None:
            self.dynamic_sd_lookup = hooks.original_lookup
            with contextlib.suppress(Exception):
                hooks.close()

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        self._speccontrol = None
        try:
            self._speccontrol = EngineHooks.create(self, settings)
        except Exception:
            _disable(self, "start-up")

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        h = self._speccontrol
        if h is not None:
            try:
                h.before_schedule(self)
            except Exception:
                _disable(self, "schedule")
                h = None
        out = orig_schedule(self, *args, **kwargs)
        if h is not None:
            try:
                h.after_schedule(self, out)
            except Exception:
                _disable(self, "schedule")
        return out

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        h = self._speccontrol
        reqs = None
        if h is not None:
            try:
                reqs = h.before_update(self, scheduler_output)
            except Exception:
                _disable(self, "update_from_output")
                h = None
        result = orig_update(self, scheduler_output, model_runner_output)
        if h is not None and reqs is not None:
            try:
                h.after_update(self, scheduler_output, model_runner_output, reqs)
            except Exception:
                _disable(self, "update_from_output")
        return result

    def update_draft_token_ids(self: Any, draft_token_ids: Any) -> None:
        h = self._speccontrol
        if h is not None:
            try:
                ids = list(draft_token_ids.req_ids)
                drafts = h.choose_drafts(ids, draft_token_ids.draft_token_ids)  # new lists: input untouched
                draft_token_ids = DraftTokenIds(ids, drafts)
            except Exception:
                _disable(self, "update_draft_token_ids")
        orig_drafts(self, draft_token_ids)

    def _update_after_schedule(self: Any, scheduler_output: Any) -> None:
        orig_after_async(self, scheduler_output)
        h = self._speccontrol
        if h is not None and h.async_composite:
            try:
                h.size_placeholders(self, scheduler_output)
            except Exception:
                _disable(self, "_update_after_schedule")
                setattr(scheduler_output, NGRAM_ROWS_ATTR, frozenset())

    Scheduler.__init__ = __init__  # type: ignore[method-assign]
    Scheduler.schedule = schedule  # type: ignore[method-assign]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
    Scheduler.update_draft_token_ids = update_draft_token_ids  # type: ignore[method-assign]
    AsyncScheduler._update_after_schedule = _update_after_schedule  # type: ignore[method-assign]
    Scheduler._speccontrol_patched = True  # type: ignore[attr-defined]
    # Every process vLLM starts (API server, engine core, workers) gets here; only an engine core
    # attaches, and says so (EngineHooks.create), so this line is for debugging only.
    log.debug("speccontrol: scheduler hooks installed (pid %d)", os.getpid())
    return True
