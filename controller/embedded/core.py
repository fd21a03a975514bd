"""The embedded engine's step function: scheduling by phase, the simulator's kernel for the step.

It behaves like vLLM with the project's composite drafter (method and K per request): the directive
is read between steps, so one received while step t runs first shapes step t + 1; the step itself
is ``sim.kernel.StepKernel``'s (the per-request rule, the plan made playable, acceptance and the
``Profile``'s price), the same as in the decision-quality replays; n-gram's would-be acceptance is
scored on every request-step. When no directive (new or a refresh) arrives within its TTL of wall
time, the engine falls back to its safe default arm, the one it was started with; a TTL of zero or
less never expires, as in the vLLM plugin (``controller.vllm.link``), so both engines do the same with
one directive.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from controller.embedded.workload import Workload
from controller.v1 import controller_pb2 as pb
from controller.wire.codec import encode_columns, index_classes
from policies.arms import Arm, Method
from policies.context import MAX_BATCH_SIZE
from policies.directive import Directive
from policies.engine import EngineInfo, Granularity
from policies.engine_rules import safe_default_directive
from policies.observation import NOT_SCORED
from policies.rules import FastLoop, method_names
from sim.costmodel import DEFAULT_PROFILE, Profile, load_profile
from sim.engines import ENGINES, EngineModel
from sim.kernel import StepKernel

ENGINE_VERSION = "embedded-sim 0.2"
#: The most draft tokens the demo engine drafts (vLLM's num_speculative_tokens).
MAX_K = 8
DEFAULT_ARMS: tuple[Arm, ...] = (
    *(Arm(Method.EAGLE3, k) for k in range(1, MAX_K + 1)),
    *(Arm(Method.NGRAM, k) for k in range(1, MAX_K + 1)),
    Arm(Method.OFF, 0),
)
#: Time bins of the goodput-over-time series over the whole schedule.
BINS = 80
#: vLLM's start-up configuration in the demo: EAGLE-3 with three draft tokens.
SAFE_DEFAULT = Arm(Method.EAGLE3, 3)
#: The composite drafter as the simulator models it. The wire reports no counterfactual depth, so
#: the EAGLE-3 head's first position (which it always drafts) is not reported, as from the plugin.
ENGINE_MODEL: EngineModel = replace(ENGINES["composite"], head_first_position=False)
#: A plain vLLM serving one static arm (the demo's baselines): no EAGLE-3 head runs unless it drafts,
#: and no step waits for its tokens (as ``stock-vllm-ngram``: vLLM's ``ngram_gpu`` runs async).
PLAIN_MODEL: EngineModel = replace(ENGINE_MODEL, always_runs=(), scheduling="async")


@dataclass(frozen=True, slots=True)
class EngineSettings:
    engine_id: str
    model: str = "llama-3.1-8b-instruct (simulated)"
    max_k: int = MAX_K
    arms: tuple[Arm, ...] = DEFAULT_ARMS
    #: What the engine does before its first directive and after one expires (its start-up config).
    safe_default: Arm = SAFE_DEFAULT
    max_batch_size: int = 256
    #: A plain vLLM with one static arm, no controller plugin (the demo's baselines): the plugin's cost
    #: per step is not charged, and the EAGLE-3 head does not run on steps that do not draft with it.
    plain: bool = False

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine settings: engine_id is required")
        if not 1 <= self.max_k <= 16:
            raise ValueError(f"engine settings: max_k must be in 1..16, got {self.max_k}")
        # (0 or less admitted no request: the engine stepped on empty batches, 0 tokens, in silence,
        # while its Hello's 0 reads as "not said", 256, at the sidecar)
        if not 1 <= self.max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(
                f"engine settings: max_batch_size must be in 1..{MAX_BATCH_SIZE}, got {self.max_batch_size}"
            )
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

    #: Tokens and virtual seconds per time bin (``bin_s`` wide), for goodput over time; the schedule
    #: holds ``bins`` of them (0: no bound). Bins past the schedule's end only ever hold zero (no step
    #: starts there) and would show as a drop to nothing at the end; with a schedule shorter than a
    #: step they would number millions (``--seconds 1e-9``: virtual_s / bin_s bins).
    bin_s: float = 0.25
    bins: int = 0
    bin_tokens: Counter[int] = field(default_factory=Counter)

    def phase_goodput(self, phase: int) -> float:
        s = self.phase_s.get(phase, 0.0)
        return self.phase_tokens[phase] / s if s > 0 else 0.0

    @property
    def goodput(self) -> float:
        return self.tokens / self.virtual_s if self.virtual_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def goodput_over_time(self) -> list[tuple[float, float]]:
        """(bin start in virtual seconds, tokens per virtual second in it), for every full bin of the
        schedule."""
        last = int(self.virtual_s / self.bin_s)
        if self.bins > 0:
            last = min(last, self.bins)
        return [(i * self.bin_s, self.bin_tokens[i] / self.bin_s) for i in range(last)]


class EngineCore:
    """One simulated engine's state; ``step()`` runs one step and returns its report."""

    def __init__(
        self,
        *,
        settings: EngineSettings,
        workload: Workload,
        profile: Profile | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.workload = workload
        self.profile = profile if profile is not None else load_profile(DEFAULT_PROFILE)
        self._clock = clock
        self._safe = safe_default_directive(settings.safe_default, max_k=settings.max_k)
        self._active: Directive = self._safe
        self._pending: Directive | None = None
        self._heard_at: float | None = None
        self._last_version = 0
        self.kernel = StepKernel(
            trace=workload.trace,
            profile=self.profile,
            engine=PLAIN_MODEL if settings.plain else ENGINE_MODEL,
            fast=FastLoop(capacity=max(64, 2 * settings.max_batch_size)),
            max_k=settings.max_k,
            controlled=not settings.plain,
        )
        self._next_index: dict[int, int] = {}
        self.totals = EngineTotals(bin_s=workload.schedule.duration_s / BINS, bins=BINS)

    # -- directives --------------------------------------------------------------------------------

    def new_stream(self) -> None:
        """A new stream to the sidecar: its directives are ordered among themselves only (a sidecar
        that restarted without its state numbers from 1 again), so the first is taken whatever its
        version."""
        self._last_version = 0

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
            and self._active.ttl_s > 0
            and self._clock() - self._heard_at > self._active.ttl_s
        ):
            self._active = self._safe
            self.totals.fallbacks += 1

    # -- steps -------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.totals.virtual_s >= self.workload.schedule.duration_s

    @property
    def phase(self) -> int:
        return self.workload.schedule.index(self.totals.virtual_s)

    def _admit(self) -> np.ndarray:
        """Trace rows of the requests that start in this step (up to the phase's concurrency)."""
        phase_i = self.phase
        want = min(self.workload.schedule.phases[phase_i].concurrency, self.settings.max_batch_size)
        room = want - self.kernel.running
        if room <= 0:
            return np.zeros(0, dtype=np.int64)
        i = self._next_index.get(phase_i, 0)
        self._next_index[phase_i] = i + room
        return np.array([self.workload.index(phase_i, j) for j in range(i, i + room)], dtype=np.int64)

    def step(self) -> pb.StepReport:
        self._between_steps()
        d = self._active
        st = self.kernel.step(d, self._admit())
        n = len(st.requests)
        finished = np.isin(st.requests, st.finished) if len(st.finished) else np.zeros(n, dtype=bool)
        tot = self.totals
        phase = self.phase
        tokens = st.tokens
        tot.phase_tokens[phase] += tokens
        tot.phase_s[phase] = tot.phase_s.get(phase, 0.0) + st.duration_s
        tot.bin_tokens[int(tot.virtual_s / tot.bin_s)] += tokens
        tot.steps += 1
        tot.virtual_s += st.duration_s
        tot.tokens += tokens
        tot.drafted += st.drafted
        tot.accepted += int(st.accepted.sum())
        tot.requests_started += len(st.admitted)
        tot.requests_finished += len(st.finished)
        for m, k in zip(method_names(st.method), st.k.tolist(), strict=True):
            tot.arm_steps["off" if m == "off" else f"{m}:{k}"] += 1
        cf = st.counterfactual.get(Method.NGRAM, np.full(n, NOT_SCORED, dtype=np.int32))
        table, class_index = index_classes(st.classes)
        return pb.StepReport(
            time_s=tot.virtual_s,
            duration_s=st.duration_s,
            batch_size=st.batch_size,
            queue_length=0,
            queue_wait_s=0.0,
            scheduled_k=int(st.k.max()) if n else d.k_for_batch(max(st.batch_size, 1), self.settings.max_k),
            columns=encode_columns(
                class_names=table,
                class_index=class_index,
                method=st.method,
                k=st.k,
                drafted=st.k,
                accepted=st.accepted,
                request_id=st.ids,
                counterfactual={Method.NGRAM: cf},
                finished=finished,
            ),
            directive_version=d.version,
            prefill_tokens=st.prefill_tokens,
        )
