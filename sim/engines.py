"""Engine models: what an engine can apply and what feedback it returns.

Every policy is scored under the constraints and the information a real engine has:

* ``stock-vllm``: one EAGLE-3 drafter, one K per batch step (vLLM's batch-size -> K table); K = 0
  still runs the head's first forward, and that first position is reported (it ran unverified).
* ``stock-vllm-ngram``: vLLM's n-gram proposer, one K per batch step.
* ``stock-vllm-p-eagle``: P-EAGLE, one K per step, every K (vLLM 0.32 misassigns drafts at
  0 < K < max unless the plugin's depth fix is in, ``controller/vllm/peagle.py``; a static deployment
  at K is aligned in any vLLM); the head runs one pass even at K = 0.
* ``per-request-k``: EAGLE-3 only, but K per request (the per-request plan's K applies).
* ``composite``: the plugin's composite drafter, method and K per request (EAGLE-3 and n-gram in one
  engine), as it runs under async scheduling (vLLM's GPU default) with the V1 runner; n-gram is scored
  counterfactually on every request and step; EAGLE-3 runs for every row, at least its first forward
  (its hidden states must stay current), so its first position is reported when a request used
  n-gram. vLLM gives every request of a step ``num_spec_tokens_to_schedule`` placeholders (the K
  table at the step's batch size) and the plugin can only shorten them, so each request's K is at most
  the table's (``table_cap``; the policy sets the table to ``max_k`` where its rule drafts n-gram);
  the plugin's worker runs EAGLE-3 at the longest K a row drafting it has, not at the table's
  (``controller/vllm/worker.py``). A step in which a request drafts n-gram waits for its sampled
  tokens on the host (the n-gram draft starts after them), so it pays ``scheduling.sync_step_s`` as
  synchronous scheduling does; a step without n-gram rows does not.
* ``composite-device``: ``composite`` with the worker's n-gram matched on the device
  (``controller/vllm/device_ngram.py``, the plugin's default on CUDA): no step waits. Its own device
  time (46 small tensor operations on a step with n-gram rows, one on a step without, as
  ``benchmarks/worker_drafter.py`` counts them) is not charged, because it has not
  been measured on a GPU: ``composite`` (the wait) and this (no cost at all) bracket that path.
* ``composite-sync``: the composite drafter with synchronous scheduling (the plugin's first path): it
  pays the profile's ``scheduling.sync_step_s`` on every step; the drafts reach vLLM whole (no
  placeholders to fit). The plans of the drafts a step makes are made after it, so the plugin guesses
  the K vLLM's EAGLE-3 proposer runs at (for every row) before the step, from each request's class
  arm and its pending plan (``policies.engine_rules.drafter_k_row``), at most the step's K-table entry;
  a request that then plans a longer EAGLE-3 draft gets what was drafted (``eagle_guessed``). The
  plugin takes a request it has not admitted yet at the largest arm of any class; the model, which
  knows every request's class, at its own.
* ``no-spec``: speculation not configured at all (the baseline for "speedup vs no spec").

Every model assumes vLLM's GPU default, async scheduling, unless it says ``sync`` (or, ``composite``,
waits on n-gram steps). ``stock-vllm-ngram`` is charged as async too, which favours that baseline:
vLLM runs its CPU ``ngram`` drafter only with synchronous scheduling (``config/vllm.py:1597-1610`` in
0.32) and only ``ngram_gpu`` under async. The controller
plugin's own cost per step, in the mode it runs on the model (``EngineModel.plugin_mode``: the K table
only on batch-granular engines, the composite drafter's per-request path otherwise; the profile's
``plugin.<mode>``), is charged by the stepping kernel to engines a controller drives (static arms are
a plain vLLM), with vLLM's own host time: in series on a step that waits, overlapped with the GPU's
work otherwise (``Profile.with_host``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from policies.arms import OFF, Arm, Method
from policies.engine import EngineInfo, Granularity
from sim.costmodel import PluginMode

KS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
#: "async-ngram-waits": async, except that a step with an n-gram row waits for its tokens (pays
#: ``sync_step_s``).
Scheduling = Literal["async", "sync", "async-ngram-waits"]
SCHEDULINGS: tuple[Scheduling, ...] = ("async", "sync", "async-ngram-waits")


@dataclass(frozen=True, slots=True)
class EngineModel:
    name: str
    description: str
    granularity: Granularity
    methods: tuple[Method, ...]  # drafters loaded (their arms can be played)
    #: Drafters whose first forward runs every step whether or not they are verified.
    always_runs: tuple[Method, ...] = ()
    #: Methods scored counterfactually on every request and step, as a draft of max_k.
    counterfactual: tuple[Method, ...] = ()
    #: Report an always-running head's first position (0/1) on rows where it was not verified.
    head_first_position: bool = False
    p_eagle_partial_k_safe: bool = False
    #: vLLM's scheduling: "async" (the GPU default), "sync" (pays ``Profile.sync_step_s`` every step) or
    #: "async-ngram-waits" (pays it on the steps where a request drafts n-gram).
    scheduling: Scheduling = "async"
    #: Each request's K is at most the directive's K table at the step's batch size (the async
    #: scheduler's placeholders; per-request engines only).
    table_cap: bool = False
    #: EAGLE-3 proposes for every row at the K guessed before the step (``drafter_k_guess``: the
    #: plugin under synchronous scheduling), at most the step's K-table entry, and a row's EAGLE-3
    #: draft is no longer than that; False: at the longest K a row drafting EAGLE-3 has (the plugin's
    #: async worker, which plans before the step). Per-request engines only.
    eagle_guessed: bool = False

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULINGS:
            raise ValueError(f"engine model {self.name}: scheduling must be one of {SCHEDULINGS}")

    @property
    def sync(self) -> bool:
        return self.scheduling == "sync"

    def waits(self, ngram_rows: bool) -> bool:
        """Whether a step pays the host's time in series with the GPU's, as synchronous scheduling does
        (``ngram_rows``: a request drafts n-gram; ``Profile.with_host``)."""
        return self.scheduling == "sync" or (ngram_rows and self.scheduling == "async-ngram-waits")

    @property
    def plugin_mode(self) -> PluginMode:
        """The mode a controller's plugin runs in on this engine (what it costs: the profile's
        ``plugin.<mode>``): the K table only on batch-granular engines, else the composite drafter's
        per-request path under this engine's scheduling."""
        if self.granularity is Granularity.BATCH_STEP:
            return "k_table"
        return "composite_sync" if self.sync else "composite"

    def arms(self, max_k: int) -> tuple[Arm, ...]:
        out: list[Arm] = []
        for m in self.methods:
            ks = [max_k] if m is Method.P_EAGLE and not self.p_eagle_partial_k_safe else KS
            out.extend(Arm(m, k) for k in ks if k <= max_k)
        return (*out, OFF)

    @property
    def primary(self) -> Method:
        return self.methods[0] if self.methods else Method.OFF

    def info(self, max_k: int, *, model: str = "sim") -> EngineInfo:
        return EngineInfo(
            engine_id=f"sim-{self.name}",
            model=model,
            max_k=max_k,
            arms=self.arms(max_k),
            granularity=self.granularity,
            counterfactual_methods=self.counterfactual,
            p_eagle_partial_k_safe=self.p_eagle_partial_k_safe,
        )

    def can_play(self, arm: Arm, max_k: int) -> bool:
        return arm in self.arms(max_k)


_COMPOSITE = EngineModel(
    "composite",
    "the plugin's composite drafter: method and K per request",
    Granularity.REQUEST_METHOD,
    (Method.EAGLE3, Method.NGRAM),
    always_runs=(Method.EAGLE3,),
    counterfactual=(Method.NGRAM,),
    head_first_position=True,
    scheduling="async-ngram-waits",
    table_cap=True,
)

ENGINES: Mapping[str, EngineModel] = {
    e.name: e
    for e in (
        EngineModel(
            "stock-vllm",
            "stock vLLM, EAGLE-3, one K per batch step",
            Granularity.BATCH_STEP,
            (Method.EAGLE3,),
            always_runs=(Method.EAGLE3,),
            head_first_position=True,
        ),
        EngineModel(
            "stock-vllm-ngram",
            "stock vLLM, n-gram, one K per batch step",
            Granularity.BATCH_STEP,
            (Method.NGRAM,),
        ),
        EngineModel(
            "stock-vllm-p-eagle",
            "stock vLLM, P-EAGLE, one K per batch step (every K: the plugin's depth fix)",
            Granularity.BATCH_STEP,
            (Method.P_EAGLE,),
            always_runs=(Method.P_EAGLE,),
            head_first_position=True,
            p_eagle_partial_k_safe=True,
        ),
        EngineModel(
            "per-request-k",
            "EAGLE-3 with K per request (one method)",
            Granularity.REQUEST_K,
            (Method.EAGLE3,),
            always_runs=(Method.EAGLE3,),
            head_first_position=True,
        ),
        _COMPOSITE,
        replace(
            _COMPOSITE,
            name="composite-device",
            description="the composite drafter, the worker's n-gram on the device: no step waits (its device time uncharged)",
            scheduling="async",
        ),
        replace(
            _COMPOSITE,
            name="composite-sync",
            description="the plugin's composite drafter under synchronous scheduling (EAGLE-3 at a guessed K)",
            scheduling="sync",
            table_cap=False,
            eagle_guessed=True,
        ),
        EngineModel("no-spec", "speculation not configured", Granularity.BATCH_STEP, ()),
    )
}


def engine_for_arm(arm: Arm) -> EngineModel:
    """The stock engine a static arm runs on (how an operator would deploy that configuration)."""
    return {
        Method.EAGLE3: ENGINES["stock-vllm"],
        Method.NGRAM: ENGINES["stock-vllm-ngram"],
        Method.P_EAGLE: ENGINES["stock-vllm-p-eagle"],
        Method.OFF: ENGINES["no-spec"],
    }[arm.method]
