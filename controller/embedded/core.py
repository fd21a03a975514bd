"""The embedded engine's step function: scheduling, drafting, acceptance and cost, without a network.

It behaves like vLLM with the project's composite drafter (method and K per request): the directive
is read between steps, so one received while step t runs first shapes step t + 1; K never exceeds
the configured ``max_k``; the per-request rule (``policies.rules.FastLoop``) picks each request's
method from its own recent feedback; n-gram's would-be acceptance is scored on every request-step.
When no directive (new or a refresh) arrives within its TTL of wall time, the engine falls back to
its safe default arm, the one it was started with.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from controller.embedded.cost import StepCost
from controller.embedded.traffic import Request, Traffic
from controller.v1 import controller_pb2 as pb
from policies.arms import METHOD_CODES, Arm, Method
from policies.context import ANY_CLASS
from policies.directive import Directive, KRange, PlanEntry
from policies.engine import EngineInfo, Granularity
from policies.observation import NOT_SCORED
from policies.rules import FastLoop, method_names

ENGINE_VERSION = "embedded-sim 0.1"
DEFAULT_ARMS: tuple[Arm, ...] = (
    *(Arm(Method.EAGLE3, k) for k in range(1, 5)),
    *(Arm(Method.NGRAM, k) for k in range(1, 5)),
    Arm(Method.OFF, 0),
)
#: vLLM's start-up configuration in the demo: EAGLE-3 with three draft tokens.
SAFE_DEFAULT = Arm(Method.EAGLE3, 3)
_EAGLE = METHOD_CODES[Method.EAGLE3]
_NGRAM = METHOD_CODES[Method.NGRAM]
_OFF = METHOD_CODES[Method.OFF]


@dataclass(frozen=True, slots=True)
class EngineSettings:
    engine_id: str
    model: str = "llama-3.1-8b-instruct (simulated)"
    max_k: int = 4
    arms: tuple[Arm, ...] = DEFAULT_ARMS
    #: What the engine does before its first directive and after one expires (its start-up config).
    safe_default: Arm = SAFE_DEFAULT
    max_batch_size: int = 256

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine settings: engine_id is required")
        if not 1 <= self.max_k <= 16:
            raise ValueError(f"engine settings: max_k must be in 1..16, got {self.max_k}")
        if self.safe_default.k > self.max_k:
            raise ValueError(f"engine settings: safe_default {self.safe_default} exceeds max_k {self.max_k}")
        bad = [str(a) for a in self.arms if a.method not in (Method.EAGLE3, Method.NGRAM, Method.OFF)]
        if bad:
            raise ValueError(f"engine settings: the embedded engine cannot play {', '.join(bad)}")

    def info(self) -> EngineInfo:
        return EngineInfo(
            engine_id=self.engine_id,
            model=self.model,
            max_k=self.max_k,
            arms=self.arms,
            granularity=Granularity.REQUEST_METHOD,
            max_batch_size=self.max_batch_size,
            counterfactual_methods=(Method.NGRAM,),
        )


def safe_directive(arm: Arm) -> Directive:
    """The directive an engine runs on by itself (version 0)."""
    return Directive(
        version=0,
        policy="safe-default",
        reason="no directive in force",
        ttl_s=float("inf"),
        issued_at_s=0.0,
        k_table=(KRange(1, 0, arm.k),),
        method=arm.method,
        plan=(PlanEntry(ANY_CLASS, 1, 0, arm),),
    )


@dataclass(slots=True)
class EngineTotals:
    """What the engine measured itself; goodput = tokens / virtual seconds."""

    steps: int = 0
    tokens: int = 0
    virtual_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    requests_started: int = 0
    requests_finished: int = 0
    directives: int = 0
    stale_directives: int = 0
    fallbacks: int = 0
    #: Request-steps per arm actually played (e.g. ``{"eagle3:3": 1200}``).
    arm_steps: Counter[str] = field(default_factory=Counter)
    #: Tokens and virtual seconds per schedule phase (by phase index).
    phase_tokens: Counter[int] = field(default_factory=Counter)
    phase_s: dict[int, float] = field(default_factory=dict)

    def phase_goodput(self, phase: int) -> float:
        s = self.phase_s.get(phase, 0.0)
        return self.phase_tokens[phase] / s if s > 0 else 0.0

    @property
    def goodput(self) -> float:
        return self.tokens / self.virtual_s if self.virtual_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass(slots=True)
class _Live:
    req: Request
    emitted: int  # output tokens so far (prefill emits the first)


class EngineCore:
    """One simulated engine's state; ``step()`` runs one step and returns its report."""

    def __init__(
        self,
        *,
        settings: EngineSettings,
        traffic: Traffic,
        cost: StepCost | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.traffic = traffic
        self.cost = cost or StepCost()
        self._clock = clock
        self._safe = safe_directive(settings.safe_default)
        self._active: Directive = self._safe
        self._pending: Directive | None = None
        self._heard_at: float | None = None
        self._last_version = 0
        self._fast = FastLoop()
        self._running: list[_Live] = []
        self._next_index: dict[int, int] = {}
        self.totals = EngineTotals()

    # -- directives --------------------------------------------------------------------------------

    def receive(self, directive: Directive) -> None:
        """A directive from the sidecar; it takes effect at the next step. Refreshes restart the TTL."""
        if directive.version < self._last_version:
            self.totals.stale_directives += 1
            return
        self.totals.directives += 1
        self._heard_at = self._clock()
        if directive.version > self._last_version or self._active.version != directive.version:
            self._pending = directive
        self._last_version = directive.version

    @property
    def directive(self) -> Directive:
        """The directive the last step ran under."""
        return self._active

    def _between_steps(self) -> None:
        if self._pending is not None:
            self._active, self._pending = self._pending, None
        elif (
            self._active.version != 0
            and self._heard_at is not None
            and self._clock() - self._heard_at > self._active.ttl_s
        ):
            self._active = self._safe
            self.totals.fallbacks += 1

    # -- steps -------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.totals.virtual_s >= self.traffic.schedule.duration_s

    @property
    def phase(self) -> int:
        return self.traffic.schedule.index(self.totals.virtual_s)

    def _admit(self) -> tuple[int, int]:
        phase_i = self.phase
        phase = self.traffic.schedule.phases[phase_i]
        want = min(phase.concurrency, self.settings.max_batch_size)
        prefill = admitted = 0
        while len(self._running) < want:
            i = self._next_index.get(phase_i, 0)
            self._next_index[phase_i] = i + 1
            r = self.traffic.request(phase_i, i)
            self._running.append(_Live(r, emitted=1))
            prefill += r.prompt_tokens
            admitted += 1
        return prefill, admitted

    def step(self) -> pb.StepReport:
        self._between_steps()
        d = self._active
        s = self.settings
        decoding = list(self._running)  # requests admitted below only prefill in this step
        prefill, admitted = self._admit()
        n = len(decoding)
        batch = n + admitted
        ids = [x.req.request_id for x in decoding]
        classes = [x.req.traffic_class for x in decoding]
        methods, ks = self._fast.plan(d, ids, classes, max(batch, 1), s.max_k)
        ks = np.minimum(ks, s.max_k)
        # A method this engine cannot draft with (e.g. p_eagle) falls back to its safe default's.
        unknown = (methods != _EAGLE) & (methods != _NGRAM) & (methods != _OFF)
        methods[unknown] = METHOD_CODES[s.safe_default.method]
        methods[ks <= 0] = _OFF
        ks[methods == _OFF] = 0

        t = np.fromiter((x.emitted - 1 for x in decoding), dtype=np.int64, count=n)
        a_e = np.fromiter(
            (x.req.acc[Method.EAGLE3][i] for x, i in zip(decoding, t, strict=True)), np.int64, n
        )
        a_n = np.fromiter((x.req.acc[Method.NGRAM][i] for x, i in zip(decoding, t, strict=True)), np.int64, n)
        out = np.fromiter((x.req.output_tokens for x in decoding), dtype=np.int64, count=n)
        emitted = np.fromiter((x.emitted for x in decoding), dtype=np.int64, count=n)
        raw = np.where(methods == _EAGLE, a_e, np.where(methods == _NGRAM, a_n, 0))
        accepted = np.minimum(np.minimum(raw, ks), out - emitted - 1)
        step_tokens = accepted + 1
        drafted = ks.astype(np.int64)
        cf = np.where(methods == _NGRAM, NOT_SCORED, np.minimum(a_n, s.max_k))
        alpha = float(d.rule.params.get("alpha", 0.3))
        self._fast.feedback(ids, methods, accepted, {Method.NGRAM: cf}, alpha=alpha)

        prompts = np.fromiter((x.req.prompt_tokens for x in decoding), dtype=np.int64, count=n)
        duration = self.cost.duration(
            kv_tokens=prompts + emitted, methods=methods, ks=ks, prefill_tokens=prefill
        )

        new_emitted = emitted + step_tokens
        finished = new_emitted >= out
        for j, x in enumerate(decoding):
            x.emitted = int(new_emitted[j])
            if finished[j]:
                self._fast.release(x.req.request_id)
        if finished.any():
            self._running = [x for x in self._running if x.emitted < x.req.output_tokens]

        tot = self.totals
        phase = self.phase
        tot.phase_tokens[phase] += int(step_tokens.sum()) + admitted
        tot.phase_s[phase] = tot.phase_s.get(phase, 0.0) + duration
        tot.steps += 1
        tot.virtual_s += duration
        tot.tokens += int(step_tokens.sum()) + admitted
        tot.drafted += int(drafted.sum())
        tot.accepted += int(accepted.sum())
        tot.requests_started += admitted
        tot.requests_finished += int(finished.sum())
        names = method_names(methods)
        for m, k in zip(names, ks, strict=True):
            tot.arm_steps["off" if m == "off" else f"{m}:{int(k)}"] += 1

        return pb.StepReport(
            time_s=tot.virtual_s,
            duration_s=duration,
            batch_size=batch,
            queue_length=0,
            queue_wait_s=0.0,
            scheduled_k=int(ks.max()) if n else d.k_for_batch(max(batch, 1), s.max_k),
            columns=_columns(ids, classes, methods, ks, drafted, accepted, cf, finished),
            directive_version=d.version,
            prefill_tokens=int(prefill),
        )


def _columns(
    ids: list[str],
    classes: list[str],
    methods: np.ndarray,
    ks: np.ndarray,
    drafted: np.ndarray,
    accepted: np.ndarray,
    cf: np.ndarray,
    finished: np.ndarray,
) -> pb.RequestColumns:
    """The step's requests as columns (the wire form that is cheap at high step rates)."""
    index: dict[str, int] = {}
    class_idx = [index.setdefault(c, len(index)) for c in classes]
    scored = bool((cf != NOT_SCORED).any())
    return pb.RequestColumns(
        request_id=ids,
        classes=list(index),
        traffic_class=class_idx,
        method=methods.tolist(),
        k=ks.tolist(),
        drafted=drafted.tolist(),
        accepted=accepted.tolist(),
        counterfactual=[pb.CounterfactualColumn(method=Method.NGRAM.value, accepted=cf.tolist())]
        if scored
        else [],
        finished=finished.tolist(),
    )
