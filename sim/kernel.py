"""The one stepping kernel: admit, plan, apply acceptance, price with a ``Profile``.

Every engine step the simulator and the demo engine run goes through ``StepKernel.step``: the
requests admitted for this step prefill (their first output token), every other running request
decodes under the plan (the directive's K table on a batch-granular engine; the per-request rule's
plan, made playable by ``policies.engine_rules.clamp_plan``, on the others), accepts
``min(acc[t], K)`` drafts of its method at its position ``t`` and emits that plus the bonus token
(never past its end), and the step is priced by ``Profile.step_time``. The per-request rule hears
each request's feedback, as the plugin's rule does.

What is scheduled, and when, is the caller's: the trace replay (closed or open loop) and the demo
engine (phases of virtual time) decide which requests to admit; the kernel holds the running ones.
Requests are indices into one ``Trace``; its acceptance arrays are read by position, never copied.
``sim.vectorised`` is an accelerator for plans fixed in advance and is held equal to this by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.arms import METHOD_CODES, Method
from policies.directive import Directive
from policies.engine import Granularity
from policies.engine_rules import clamp_plan, drafter_k_guess, rule_alpha
from policies.observation import NOT_SCORED
from policies.rules import FastLoop
from sim.costmodel import Profile
from sim.engines import EngineModel
from sim.trace import Trace

_OFF = METHOD_CODES[Method.OFF]
_E3 = METHOD_CODES[Method.EAGLE3]
_PE = METHOD_CODES[Method.P_EAGLE]
_NG = METHOD_CODES[Method.NGRAM]
_EMPTY = np.zeros(0, dtype=np.int64)


def check_engine(trace: Trace, engine: EngineModel) -> None:
    """Refuse an engine that drafts with a method the trace has no acceptance data for."""
    missing = [m for m in engine.methods if m not in trace.acc]
    if missing:
        raise ValueError(
            f"engine {engine.name!r} drafts with {missing[0].value}, which trace {trace.name!r} lacks"
        )


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step: the decoding requests' plan and outcome, the prefills, the price."""

    #: Trace indices of the requests that decoded (in batch order), and their ids and classes.
    requests: np.ndarray
    ids: tuple[str, ...]
    classes: tuple[str, ...]
    #: Per decoding request: method code, K, accepted drafts, tokens emitted.
    method: np.ndarray
    k: np.ndarray
    accepted: np.ndarray
    emitted: np.ndarray
    #: Methods scored without being verified: accepted counts, ``NOT_SCORED`` where not scored.
    counterfactual: dict[Method, np.ndarray]
    #: Trace indices admitted (prefilled) in this step, and their prompt tokens in all.
    admitted: np.ndarray
    prefill_tokens: int
    #: Trace indices that finished with this step (decoders that ended, then one-token prefills).
    finished: np.ndarray
    duration_s: float
    #: Per decoding request: the n-gram proposer's draft length the plan saw (None: no signal).
    ngram_proposal: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.requests) + len(self.admitted)

    @property
    def drafted(self) -> int:
        return int(self.k.sum())

    @property
    def tokens(self) -> int:
        """Output tokens the step produced (decodes and first tokens of prefills)."""
        return int(self.emitted.sum()) + len(self.admitted)


class StepKernel:
    """The running requests of one engine over one trace, stepped under directives."""

    def __init__(
        self,
        *,
        trace: Trace,
        profile: Profile,
        engine: EngineModel,
        fast: FastLoop | None = None,
        max_k: int | None = None,
        ngram_signal: bool = True,
        controlled: bool = False,
    ) -> None:
        check_engine(trace, engine)
        self.trace = trace
        self.profile = profile
        self.engine = engine
        self.max_k = trace.max_k if max_k is None else min(max_k, trace.max_k)
        self.fast = fast if fast is not None else FastLoop()
        #: A controller drives this engine (its plugin's cost is charged per step; static arms: False).
        self.controlled = controlled
        self._plugin = engine.plugin_mode if controlled else None
        self._base = trace.offsets[:-1]
        self._out = trace.output_tokens
        self._prompt = trace.prompt_tokens
        self._acc = {METHOD_CODES[m]: a for m, a in trace.acc.items()}
        self._cf = [(m, METHOD_CODES[m], trace.acc[m]) for m in engine.counterfactual if m in trace.acc]
        head = (
            next((m for m in engine.always_runs if m in trace.acc), None)
            if engine.head_first_position
            else None
        )
        self._head = head
        self._head_code = METHOD_CODES[head] if head is not None else -1
        #: The head's first position is exact for drafts of one token only.
        self.counterfactual_depth: dict[Method, int] = {head: 1} if head is not None else {}
        self._batch_k = engine.granularity is Granularity.BATCH_STEP
        self._per_request_k = engine.granularity is Granularity.REQUEST_K
        self._primary = engine.primary
        self._primary_code = METHOD_CODES[engine.primary]
        # With the composite drafter n-gram is played beside the primary method; an engine with K per
        # request has one method only.
        self._composite = Method.NGRAM in engine.methods and not self._per_request_k
        self._e3_always = Method.EAGLE3 in engine.always_runs
        self._pe_always = Method.P_EAGLE in engine.always_runs
        #: Each request's method in its last decode step (-1: none yet): its pending plan when the
        #: next step's drafter K is guessed (``eagle_guessed``).
        self._pending = np.full(len(self._out), -1, dtype=np.int8)
        # The n-gram proposer's match per position: the engine has it before drafting (causal), where
        # it runs the proposer (an engine that drafts n-gram per request) and the trace recorded it.
        self._proposal = (
            trace.ngram_proposal
            if ngram_signal and Method.NGRAM in engine.methods and not self._batch_k
            else None
        )
        # The running requests, as parallel arrays rebuilt only when membership changes.
        self._req = _EMPTY
        self._done = _EMPTY
        self._m_out = self._m_prompt = self._m_base = _EMPTY
        self._ids: tuple[str, ...] = ()
        self._classes: tuple[str, ...] = ()

    @property
    def running(self) -> int:
        return len(self._req)

    @property
    def running_requests(self) -> np.ndarray:
        return self._req

    def step(self, directive: Directive, admit: np.ndarray = _EMPTY) -> Step:
        """One step under ``directive``; the requests ``admit`` (trace indices) prefill in it."""
        req, ids, classes = self._req, self._ids, self._classes
        nd = len(req)
        take = len(admit)
        batch_size = nd + take
        d = self._done
        prefill = int(self._prompt[admit].sum()) if take else 0
        max_k = self.max_k
        prop: np.ndarray | None = None
        drafter_k = -1  # the K EAGLE-3 was guessed to run at (eagle_guessed)
        if nd:
            pos = self._m_base + d - 1
            remaining = self._m_out - d
            if self._batch_k:
                # One K for the whole step: the per-request rule has nothing to act on.
                kk = directive.k_for_batch(batch_size, max_k)
                code = self._primary_code if kk > 0 else _OFF
                methods = np.full(nd, code, dtype=np.int8)
                ks = np.full(nd, kk, dtype=np.int64)
                if kk > 0:
                    e = np.minimum(np.minimum(self._acc[code][pos], kk) + 1, remaining)
                else:
                    e = np.ones(nd, dtype=np.int64)
            else:
                prop = self._proposal[pos] if self._proposal is not None else None
                planned, ks32 = self.fast.plan(
                    directive, self._ids, self._classes, batch_size, max_k, ngram_proposal=prop
                )
                methods, ks = clamp_plan(
                    planned,
                    ks32.astype(np.int64),
                    configured=self._primary,
                    composite=self._composite,
                    max_k=max_k,
                )
                if self.engine.eagle_guessed:  # synchronous scheduling: EAGLE-3 at the K guessed before
                    drafter_k = self._guess_drafter_k(directive, batch_size)
                    e3 = methods == self._primary_code
                    if e3.any() and int(ks[e3].max()) > drafter_k:  # a draft is no longer than drafted
                        ks = np.where(e3, np.minimum(ks, drafter_k), ks)
                        methods = np.where(ks > 0, methods, _OFF).astype(methods.dtype)
                    self._pending[req] = methods
                if self.engine.table_cap:  # the async placeholders: the plugin can only shorten them
                    width = directive.width_for_batch(batch_size, max_k)
                    if int(ks.max()) > width:
                        ks = np.minimum(ks, width)
                        methods = np.where(ks > 0, methods, _OFF).astype(methods.dtype)
                a = np.zeros(nd, dtype=np.int64)
                for code_m, arr in self._acc.items():
                    sel = methods == code_m
                    if sel.any():
                        a[sel] = arr[pos[sel]]
                e = np.minimum(np.minimum(a, ks) + 1, remaining)
            ksum = int(ks.sum())
        else:
            methods = np.zeros(0, dtype=np.int8)
            ks = e = pos = _EMPTY
            ksum = 0
        dt = self._price(d, methods, ks, ksum, nd, prefill, drafter_k)

        accepted = e - 1
        cf: dict[Method, np.ndarray] = {}
        if nd:
            # A draft of max_k scored against the tokens that follow (the plugin can score it once they
            # exist, at most max_k tokens later; that delay is not modelled).
            for m, code_m, arr in self._cf:
                v = np.minimum(arr[pos], max_k).astype(np.int32)
                v[methods == code_m] = NOT_SCORED
                cf[m] = v
            head = self._head
            if head is not None:
                hv = cf[head] if head in cf else np.minimum(self.trace.acc[head][pos], 1).astype(np.int32)
                hv[methods == self._head_code] = NOT_SCORED
                cf[head] = hv
            if not self._batch_k:
                self.fast.feedback(
                    self._ids,
                    methods,
                    accepted,
                    cf,
                    alpha=rule_alpha(directive.rule),
                    depth=self.counterfactual_depth,
                    drafted=ks,
                )
        finished = self._advance(e, admit)
        return Step(
            requests=req,
            ids=ids,
            classes=classes,
            method=methods,
            k=ks,
            accepted=accepted,
            emitted=e,
            counterfactual=cf,
            admitted=admit,
            prefill_tokens=prefill,
            finished=finished,
            ngram_proposal=prop,
            duration_s=dt,
        )

    def _price(
        self,
        done: np.ndarray,
        methods: np.ndarray,
        ks: np.ndarray,
        ksum: int,
        nd: int,
        prefill: int,
        drafter_k: int = -1,
    ) -> float:
        kv = float((self._m_prompt + done).sum()) if nd else 0.0
        batched = float(ksum + nd + prefill)
        if self._batch_k:
            mk = int(ks[0]) if nd else 0
            is_e3 = nd > 0 and mk > 0 and methods[0] == _E3
            is_pe = nd > 0 and mk > 0 and methods[0] == _PE
            is_ng = nd > 0 and mk > 0 and methods[0] == _NG
            eagle_fwd = float(mk) if is_e3 else 0.0
            if self._e3_always:  # K = 0 still runs the head's first forward (no positions verified)
                eagle_fwd = max(eagle_fwd, 1.0)
            e3_spec = float(ksum) if is_e3 else 0.0
            pe_spec = float(ksum) if is_pe else 0.0
            pe_used = is_pe
        else:
            e3 = methods == _E3
            pe = methods == _PE
            any_e3 = bool(e3.any())
            # EAGLE-3 proposes for every row of the step (its draft state must stay current, whatever
            # each row verifies), at the longest K a row drafting it has (the plugin's async worker) or
            # at the K guessed before the step (synchronous scheduling: ``eagle_guessed``).
            eagle_fwd = float(ks[e3].max()) if any_e3 else 0.0
            if self.engine.eagle_guessed and drafter_k >= 0:
                eagle_fwd = float(drafter_k)
            if self._e3_always:
                eagle_fwd = max(eagle_fwd, 1.0)
            e3_spec = eagle_fwd * nd
            pe_used = bool(pe.any())
            pe_spec = float(ks[pe].sum()) if pe_used else 0.0
            is_ng = bool((methods == _NG).any())
        gpu = self.profile.step_time(
            kv=kv,
            batched=batched,
            eagle_forwards=eagle_fwd,
            eagle_spec=e3_spec,
            p_eagle_passes=1.0 if (pe_used or self._pe_always) else 0.0,
            p_eagle_spec=pe_spec,
            ngram_rows=float(is_ng),
        )
        return self.profile.with_host(
            gpu, batch=float(nd), waits=self.engine.waits(is_ng), plugin=self._plugin
        )

    def _guess_drafter_k(self, directive: Directive, batch_size: int) -> int:
        """Synchronous scheduling: the K EAGLE-3 runs at in this step, guessed before it as the plugin
        does (``policies.engine_rules.drafter_k_guess``: each request's class arm, except one whose
        pending plan, the method of its previous step here, is n-gram's), at least 1, at most the
        K table's entry (0 there: no drafts). Every K is taken as prepared."""
        table_k = directive.k_for_batch(batch_size, self.max_k)
        if table_k <= 0:
            return 0
        cm, ck = self.fast.class_plan(directive, self._classes, batch_size, self.max_k)
        guess = drafter_k_guess(cm, ck, self._pending[self._req], configured=self._primary,
                                composite=self._composite, max_k=self.max_k)  # fmt: skip
        return min(max(guess, 1), table_k)

    def _advance(self, emitted: np.ndarray, admit: np.ndarray) -> np.ndarray:
        """Move the decoders on, retire the finished ones, let the prefilled ones join."""
        fin: list[np.ndarray] = []
        changed = False
        if len(self._req):
            self._done = self._done + emitted
            ended = self._done >= self._m_out
            if ended.any():
                fin.append(self._req[ended])
                if not self._batch_k:
                    for i in self._req[ended].tolist():
                        self.fast.release(self.trace.ids[i])
                keep = ~ended
                self._req, self._done = self._req[keep], self._done[keep]
                changed = True
        if len(admit):
            single = self._out[admit] <= 1
            if single.any():
                fin.append(admit[single])
            joining = admit[~single]
            self._req = np.concatenate([self._req, joining])
            self._done = np.concatenate([self._done, np.ones(len(joining), dtype=np.int64)])
            changed = True
        if changed:
            req = self._req
            self._m_out, self._m_prompt, self._m_base = self._out[req], self._prompt[req], self._base[req]
            ids, classes = self.trace.ids, self.trace.classes
            self._ids = tuple(ids[i] for i in req.tolist())
            self._classes = tuple(classes[i] for i in req.tolist())
        if not fin:
            return _EMPTY
        return fin[0] if len(fin) == 1 else np.concatenate(fin)
