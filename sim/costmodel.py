"""Step-time cost model: profiles loaded from ``sim/profiles/*.yaml``.

A step's time is composed as in the simulator published with arXiv 2601.11580:

    step = T_target(kv tokens, batched tokens) [+ MoE expert reads] + drafting + overhead

* ``T_target`` is linear in the tokens held in the KV cache by the step's requests and in the tokens
  the step processes (sum of K + 1 over decoding requests, plus the prompts of requests prefilled in
  the step).
* EAGLE-3 drafting is priced one of two ways (``draft.eagle3.cost``):
  ``per_forward`` (default): sequential, one draft forward per draft position for the longest K in the
  batch; the published draft fit was measured at k = 3 (``fit_k``), so one forward costs
  ``T_draft / fit_k``. ``per_draft``: the whole draft priced once per step that drafts with EAGLE-3,
  ``T_draft = a * kv + b * spec_tokens + c`` whatever K is, as the simulator of arXiv 2601.11580 does.
* P-EAGLE drafts all K positions in one pass, costing ``pass_forwards`` EAGLE forwards plus
  ``slot_s`` per drafted position (the pass carries each request's K mask slots through the head and
  its LM head; 0 where a profile has no figure), so a deeper pass costs more at larger batches.
* n-gram drafting costs a fixed fraction of the verify time.
* MoE targets read more expert weights the more tokens a step verifies: the expected fraction of
  experts touched by ``n`` tokens is ``1 - (1 - top_k / experts) ** n``.

What the engine's host adds per step (``Profile.host_time``, optional sections, 0 when absent):

* ``scheduling.sync_step_s``: vLLM's own CPU time per step (scheduling, taking the step's output),
  which async scheduling hides behind the GPU step and synchronous scheduling pays on top of it.
* ``plugin.<mode>.step_s`` + ``plugin.<mode>.per_request_s`` x batch: the controller plugin's own work
  per step in the mode the engine runs it (``PLUGIN_MODES``: the K table only, the composite drafter
  under async or synchronous scheduling; the engine model names its mode), on engines a controller
  drives. Static arms run a plain vLLM and pay nothing. A flat ``plugin.step_s`` /
  ``plugin.per_request_s`` is one charge for every mode (a mode's own section overrides it).

``Profile.with_host`` adds that to a step's GPU time the way vLLM's scheduling does: in series where
the step waits (synchronous scheduling; a composite step with n-gram rows waits for its tokens), and
overlapped otherwise. Under async scheduling the engine core schedules step N+1 and hands it to the
workers before it takes step N's output (``vllm/v1/engine/core.py``, ``step_with_batch_queue``, 0.32),
and the plugin's hooks run inside that schedule and that output's update (the worker's, before its
launches): the host's work delays a step only where it outlasts the GPU's, ``max(gpu, host)``.

``Profile.step_time`` prices one step (floats) or a whole run at once (arrays, one entry per step)
with the same arithmetic.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, overload

import numpy as np

from policies import yamldoc
from policies.arms import Method
from policies.params import shown
from policies.physics import MAX_STEP_S, MIN_STEP_S, MIN_STEP_S_PER_REQUEST, step_floor_s
from policies.text import error_text, name_problem


class ProfileError(ValueError):
    pass


#: How EAGLE-3 drafting is priced (``draft.eagle3.cost``); the first is the default.
DraftCost = Literal["per_forward", "per_draft"]
DRAFT_COSTS: tuple[DraftCost, ...] = ("per_forward", "per_draft")
_X = TypeVar("_X", float, np.ndarray)
#: The modes the controller plugin runs in, each with its own measured cost (``plugin.<mode>``): the K
#: table only (batch-granular engines), the composite drafter under async scheduling (vLLM's GPU
#: default; also K per request), and the composite drafter under synchronous scheduling.
PluginMode = Literal["k_table", "composite", "composite_sync"]
PLUGIN_MODES: tuple[PluginMode, ...] = get_args(PluginMode)


@dataclass(frozen=True, slots=True)
class PluginCost:
    """The plugin's engine-thread seconds per step in one mode: ``step_s + per_request_s x batch``."""

    step_s: float = 0.0
    per_request_s: float = 0.0

    def at(self, batch: _X) -> _X:
        return self.step_s + self.per_request_s * batch  # type: ignore[return-value]


_NO_PLUGIN = PluginCost()


@dataclass(frozen=True, slots=True)
class Linear:
    kv_s_per_token: float
    batched_s_per_token: float
    const_s: float

    def __call__(self, kv: np.ndarray, batched: np.ndarray) -> np.ndarray:
        return self.kv_s_per_token * kv + self.batched_s_per_token * batched + self.const_s


@dataclass(frozen=True, slots=True)
class MoE:
    expert_bytes_per_gpu: float
    num_experts: int
    experts_per_token: int
    bandwidth_bytes_per_s: float
    efficiency: float

    def __call__(self, batched: np.ndarray) -> np.ndarray:
        touched = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** np.asarray(batched, np.float64)
        return touched * self.expert_bytes_per_gpu / (self.bandwidth_bytes_per_s * self.efficiency)


@dataclass(frozen=True, slots=True)
class Memory:
    gpu: str
    gpu_memory_gb: float
    num_gpus: int
    weights_gb: float
    draft_weights_gb: float
    kv_bytes_per_token: float
    reserve_gb: float
    gpu_memory_utilization: float

    def kv_capacity_tokens(self) -> int:
        room = self.kv_room_gb()
        return max(0, int(room * 1e9 / self.kv_bytes_per_token))

    def kv_room_gb(self) -> float:
        usable = self.gpu_memory_gb * self.num_gpus * self.gpu_memory_utilization
        return usable - self.weights_gb - self.draft_weights_gb - self.reserve_gb * self.num_gpus


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    model: str
    hardware: str
    derivation: str
    target: Linear
    eagle3_draft: Linear  # kv tokens, spec tokens -> time of one full draft at ``fit_k`` positions
    fit_k: int
    p_eagle_pass_forwards: float
    ngram_verify_fraction: float
    overhead_s: float
    memory: Memory
    gpu_price_key: str
    api_price_key: str
    moe: MoE | None = None
    sources: tuple[str, ...] = field(default_factory=tuple)
    eagle3_cost: DraftCost = "per_forward"
    #: Seconds per step that synchronous scheduling adds over async (``scheduling.sync_step_s``).
    sync_step_s: float = 0.0
    #: The controller plugin's engine-thread time per step in each mode it runs in (``plugin.*``;
    #: a mode without a figure costs nothing).
    plugin_k_table: PluginCost = _NO_PLUGIN
    plugin_composite: PluginCost = _NO_PLUGIN
    plugin_composite_sync: PluginCost = _NO_PLUGIN
    #: Seconds per drafted position in a P-EAGLE pass (``draft.p_eagle.slot_s``, default 0).
    p_eagle_slot_s: float = 0.0

    def plugin_cost(self, mode: PluginMode) -> PluginCost:
        return {
            "k_table": self.plugin_k_table,
            "composite": self.plugin_composite,
            "composite_sync": self.plugin_composite_sync,
        }[mode]

    def host_time(self, *, batch: _X, plugin: PluginMode | None) -> _X:
        """Seconds of host work per step of ``batch`` requests: vLLM's own (``sync_step_s``) and the
        controller plugin's in its mode (``plugin``; None: a plain vLLM). Floats or arrays alike."""
        if plugin is not None:
            return self.sync_step_s + self.plugin_cost(plugin).at(batch)  # type: ignore[return-value]
        return self.sync_step_s + 0.0 * batch  # type: ignore[return-value]

    def with_host(self, gpu: _X, *, batch: _X, waits: bool | np.ndarray, plugin: PluginMode | None) -> _X:
        """A step's seconds from its GPU time: the host's work (``host_time``) in series where the step
        waits (``waits``: synchronous scheduling, or a step whose drafts need its tokens on the host),
        overlapped with the GPU's otherwise (async scheduling: ``max(gpu, host)``). Floats, or arrays
        with one entry per step (``waits`` per step then, or one for all)."""
        host = self.host_time(batch=batch, plugin=plugin)
        if isinstance(gpu, np.ndarray) or isinstance(waits, np.ndarray) or isinstance(host, np.ndarray):
            return np.where(waits, gpu + host, np.maximum(gpu, host))  # type: ignore[return-value,no-any-return]
        return gpu + host if waits else max(gpu, host)  # type: ignore[return-value,operator]

    # -- step pricing (one step with floats, or many at once with arrays: the same arithmetic) --------

    def verify_time(self, kv: np.ndarray, batched: np.ndarray) -> np.ndarray:
        t = self.target(kv, batched)
        if self.moe is not None:
            t = t + self.moe(batched)
        return t

    def draft_forward_time(self, kv: np.ndarray, spec_tokens: np.ndarray) -> np.ndarray:
        """One sequential EAGLE draft forward over the batch."""
        return self.eagle3_draft(kv, spec_tokens) / self.fit_k

    def eagle_draft_time(self, kv: _X, spec_tokens: _X, forwards: _X) -> _X:
        """EAGLE-3 drafting in a step with ``forwards`` sequential forwards (0: none) over ``spec_tokens``
        draft tokens: ``forwards`` x one forward (``per_forward``) or one whole draft (``per_draft``).
        Floats or arrays alike (the stepwise and vectorised engines share it)."""
        d = self.eagle3_draft
        whole = d.kv_s_per_token * kv + d.batched_s_per_token * spec_tokens + d.const_s
        if self.eagle3_cost == "per_draft":
            return (forwards > 0) * whole  # type: ignore[return-value]
        return forwards * (whole / self.fit_k)  # type: ignore[no-any-return]

    @overload
    def step_time(
        self,
        *,
        kv: float,
        batched: float,
        eagle_forwards: float,
        eagle_spec: float,
        p_eagle_passes: float,
        p_eagle_spec: float,
        ngram_rows: float,
    ) -> float: ...

    @overload
    def step_time(
        self,
        *,
        kv: np.ndarray,
        batched: np.ndarray,
        eagle_forwards: np.ndarray,
        eagle_spec: np.ndarray,
        p_eagle_passes: np.ndarray,
        p_eagle_spec: np.ndarray,
        ngram_rows: np.ndarray,
    ) -> np.ndarray: ...

    def step_time(
        self,
        *,
        kv: Any,
        batched: Any,
        eagle_forwards: Any,
        eagle_spec: Any,
        p_eagle_passes: Any,
        p_eagle_spec: Any,
        ngram_rows: Any,
    ) -> Any:
        """Seconds per step. ``eagle_forwards``: sequential EAGLE forwards (longest EAGLE K, or 1 when
        the head runs without being verified); ``p_eagle_passes``: 1 where P-EAGLE drafted; ``ngram_rows``:
        > 0 where any request drafted with n-gram. Plain operators only, so floats (the stepping
        kernel's hot path) and arrays (the vectorised replay) get bit-identical results."""
        tg = self.target
        verify = tg.kv_s_per_token * kv + tg.batched_s_per_token * batched + tg.const_s
        if self.moe is not None:
            mo = self.moe
            touched = 1.0 - (1.0 - mo.experts_per_token / mo.num_experts) ** batched
            verify = verify + touched * mo.expert_bytes_per_gpu / (mo.bandwidth_bytes_per_s * mo.efficiency)
        t = verify + self.overhead_s
        d = self.eagle3_draft
        fwd = (
            d.kv_s_per_token * kv + d.batched_s_per_token * (eagle_spec + p_eagle_spec) + d.const_s
        ) / self.fit_k
        e3 = self.eagle_draft_time(kv, eagle_spec + p_eagle_spec, eagle_forwards)
        t = t + e3 + p_eagle_passes * self.p_eagle_pass_forwards * fwd + self.p_eagle_slot_s * p_eagle_spec
        return t + (ngram_rows > 0) * self.ngram_verify_fraction * verify

    def plain_step_time(self, batch: int, context: int) -> float:
        """A decode step without speculation, ``batch`` requests of ``context`` tokens each."""
        z = 0.0
        return self.step_time(
            kv=float(batch * context),
            batched=float(batch),
            eagle_forwards=z,
            eagle_spec=z,
            p_eagle_passes=z,
            p_eagle_spec=z,
            ngram_rows=z,
        )


# -- loading -------------------------------------------------------------------------------------


#: The largest batch a replay runs (``--concurrency`` of ``sim`` and ``sim autoscale`` stops there).
MAX_REPLAY_BATCH = 4096
#: The longest draft a profile's EAGLE-3 fit can have been measured at (K is at most 64 everywhere).
MAX_FIT_K = 64
#: A profile is a page of YAML; a larger file is refused before it is read.
MAX_PROFILE_BYTES = 1 << 20
#: What a profile file's name ends in (as written): ``load_profile`` reads any other as a profile name.
PROFILE_SUFFIXES = (".yaml", ".yml")
#: Physical ranges of a profile's figures (beyond them a replay's figures mean nothing, or overflow):
#: a step lasts as long as policies.physics allows (the sidecar's telemetry bounds), no GPU spends a
#: second per token, and memory sizes stay below a petabyte.
MAX_S_PER_TOKEN = 1.0
MAX_GB = 1e6


def _num(d: Mapping[str, Any], key: str, where: str, *, lo: float = 0.0, hi: float = MAX_STEP_S) -> float:
    v = d.get(key)
    # A comparison chain: NaN fails it, and so does an integer beyond a double's range (float() of it
    # would raise OverflowError).
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        hint = ""
        if isinstance(v, str):
            try:
                float(v)
                hint = " (a quoted number is text: write it without quotes)"
            except ValueError:
                pass
        raise ProfileError(f"{where}.{key}: expected a number {lo:g}..{hi:g}, got {shown(v)}{hint}")
    return float(v)


def _count(d: Mapping[str, Any], key: str, where: str, *, lo: int, hi: int) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProfileError(f"{where}.{key}: expected an integer {lo}..{hi}, got {v!r}")
    return v


def _map(d: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected a mapping")
    return d


def _text(d: Mapping[str, Any], key: str, where: str, *, default: str | None = None) -> str:
    """A string field (``str()`` took a list as its text: ``name: [1, 2]`` was the profile ``[1, 2]``)."""
    v = d.get(key, default)
    if v is None and default is not None:
        return default  # an empty optional field (``description:``) read "missing field 'description'"
    if v is None:
        raise KeyError(key)
    if not isinstance(v, str) or (default is None and not v):
        raise ProfileError(
            f"{where}{key}: expected {'a non-empty' if default is None else 'a'} string, got {shown(v)}"
        )
    return v


def _linear(d: Mapping[str, Any], where: str, batched_key: str = "batched_s_per_token") -> Linear:
    return Linear(
        _num(d, "kv_s_per_token", where, hi=MAX_S_PER_TOKEN),
        _num(d, batched_key, where, hi=MAX_S_PER_TOKEN),
        _num(d, "const_s", where),
    )


@functools.cache
def _gpu_price_keys() -> frozenset[str]:
    from sim.prices import load_prices

    return frozenset(load_prices().gpu_hour)


@functools.cache
def _api_price_keys() -> frozenset[str]:
    from sim.prices import load_prices

    return frozenset(load_prices().api_per_1m_output)


#: Every key a profile may hold, by section (``None``: a section of its own check, ``plugin``).
#: An unknown key is refused: a misspelt ``schedulng:`` silently priced host time at 0.
_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(
        {
            "name",
            "description",
            "model",
            "hardware",
            "derivation",
            "sources",
            "target",
            "draft",
            "overhead_s",
            "memory",
            "gpu_price",
            "api_price",
            "moe",
            "scheduling",
            "plugin",
            "fit",  # what ``profile fit`` measured (a record for the reader: not read, not checked)
        }
    ),
    "target": frozenset({"kv_s_per_token", "batched_s_per_token", "const_s"}),
    "draft": frozenset(m.value for m in (Method.EAGLE3, Method.P_EAGLE, Method.NGRAM)),
    "draft.eagle3": frozenset({"kv_s_per_token", "spec_s_per_token", "const_s", "fit_k", "cost"}),
    "draft.p_eagle": frozenset({"pass_forwards", "slot_s"}),
    "draft.ngram": frozenset({"verify_fraction"}),
    "memory": frozenset(
        {
            "gpu",
            "gpu_memory_gb",
            "num_gpus",
            "weights_gb",
            "draft_weights_gb",
            "kv_bytes_per_token",
            "reserve_gb",
            "gpu_memory_utilization",
        }
    ),
    "moe": frozenset(
        {"expert_bytes_per_gpu", "num_experts", "experts_per_token", "bandwidth_bytes_per_s", "efficiency"}
    ),
    "scheduling": frozenset({"sync_step_s"}),
}


def _unknown_keys(d: Mapping[str, Any]) -> None:
    """Refuse a key no section has (each section checked where it is a mapping; its own check says
    when it is not)."""
    for section, keys in _KEYS.items():
        sub: Any = d
        for part in section.split(".") if section else ():
            sub = sub.get(part) if isinstance(sub, Mapping) else None
        if not isinstance(sub, Mapping):
            continue
        unknown = sorted((str(k) for k in sub if k not in keys), key=str)
        if unknown:
            where = f"{section}.{unknown[0]}" if section else unknown[0]
            raise ProfileError(f"{where}: unknown key (expected {', '.join(sorted(keys))})")


def _check_physics(p: Profile) -> None:
    """What each figure in range can still get wrong together: a step that takes no time (its
    throughput is infinite, or 0 tok/s where a division guards it, and sim autoscale's learning curve
    had no samples) and a model that does not fit in the memory given to it."""
    t = p.plain_step_time(1, 0)
    if not t >= MIN_STEP_S:
        raise ProfileError(
            f"target.const_s: a step of one request takes {t:g} s (target + overhead_s): at least "
            f"{MIN_STEP_S:g} s, as every engine step"
        )
    # Each figure in its range still made steps of 1e18 s together (an expert read at 1 byte/s at
    # 0.1 % efficiency): a replay then reported 0 tok/s and $1e19 per 1M tokens as results.
    if p.moe is not None:
        mo = p.moe
        read = mo.expert_bytes_per_gpu / (mo.bandwidth_bytes_per_s * mo.efficiency)
        if not read <= MAX_STEP_S:
            raise ProfileError(
                f"moe.bandwidth_bytes_per_s: reading every expert takes {read:g} s (expert_bytes_per_gpu / "
                f"(bandwidth_bytes_per_s x efficiency)): at most {MAX_STEP_S:g} s, as every engine step"
            )
    if not t <= MAX_STEP_S:
        moe = " + one token's expert reads (moe)" if p.moe is not None else ""
        raise ProfileError(
            f"target.const_s: a step of one request takes {t:g} s (target + overhead_s{moe}): at most "
            f"{MAX_STEP_S:g} s, as every engine step"
        )
    # Per request the step time only falls as the batch grows (fixed costs shared, expert reads
    # concave), so the largest batch is the one to check. A profile faster than the sidecar's floor had
    # replays (and `sim tune`) teach the policies from steps the sidecar refuses from any engine.
    big = p.plain_step_time(MAX_REPLAY_BATCH, 0)
    if not big >= step_floor_s(MAX_REPLAY_BATCH):
        raise ProfileError(
            f"target.batched_s_per_token: a step of {MAX_REPLAY_BATCH} requests takes {big:g} s, "
            f"{big / MAX_REPLAY_BATCH:g} s per request: at least {MIN_STEP_S_PER_REQUEST:g} s per request, "
            "as every engine step (the sidecar refuses faster ones)"
        )
    m = p.memory
    if m.kv_room_gb() <= 0:
        usable = m.gpu_memory_gb * m.num_gpus * m.gpu_memory_utilization
        raise ProfileError(
            f"memory.weights_gb: weights {m.weights_gb:g} GB + draft {m.draft_weights_gb:g} GB + reserve "
            f"{m.reserve_gb * m.num_gpus:g} GB leave no room for the KV cache in the usable {usable:g} GB"
        )
    if p.gpu_price_key not in _gpu_price_keys():
        raise ProfileError(
            f"gpu_price: unknown GPU {p.gpu_price_key!r} (sim/data/prices.yaml has: "
            f"{', '.join(sorted(_gpu_price_keys()))})"
        )
    # An unknown model's price dropped the report's API price line and table without a word.
    if p.api_price_key and p.api_price_key not in _api_price_keys():
        raise ProfileError(
            f"api_price: unknown model {p.api_price_key!r} (sim/data/prices.yaml has: "
            f"{', '.join(sorted(_api_price_keys()))}; or leave api_price out)"
        )


def _draft_cost(e3: Mapping[str, Any], source: str) -> DraftCost:
    v = e3.get("cost", DRAFT_COSTS[0])
    if v == "per_forward" or v == "per_draft":
        return v  # type: ignore[no-any-return]
    raise ProfileError(f"{source}: draft.eagle3.cost: expected one of {', '.join(DRAFT_COSTS)}, got {v!r}")


_COST_KEYS = ("step_s", "per_request_s")


def _plugin_cost(d: Mapping[str, Any], where: str) -> PluginCost:
    return PluginCost(_num(d, "step_s", where), _num(d, "per_request_s", where))


def _host_section(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The optional ``scheduling`` and ``plugin`` sections (0 where a section or a mode is absent)."""
    sched = _map(d["scheduling"], f"{source}: scheduling") if "scheduling" in d else None
    out: dict[str, Any] = {
        "sync_step_s": _num(sched, "sync_step_s", "scheduling") if sched is not None else 0.0,
    }
    if "plugin" not in d:
        return out
    plugin = _map(d["plugin"], f"{source}: plugin")
    unknown = sorted(str(k) for k in plugin if k not in (*_COST_KEYS, *PLUGIN_MODES))
    if unknown:
        raise ProfileError(
            f"{source}: plugin.{unknown[0]}: unknown key (expected {', '.join((*_COST_KEYS, *PLUGIN_MODES))})"
        )
    flat = _plugin_cost(plugin, "plugin") if any(k in plugin for k in _COST_KEYS) else _NO_PLUGIN
    for mode in PLUGIN_MODES:
        where = f"plugin.{mode}"
        out[f"plugin_{mode}"] = (
            _plugin_cost(_map(plugin[mode], f"{source}: {where}"), where) if mode in plugin else flat
        )
    return out


def parse_profile(data: Any, *, source: str, lines: yamldoc.Lines | None = None) -> Profile:
    """A profile from its parsed YAML; ProfileError ``SOURCE[:LINE]: field: message`` (the line when
    ``lines``, the document's, is given)."""
    d = _map(data, source)
    try:
        _unknown_keys(d)
        draft = _map(d.get("draft"), f"{source}: draft")
        e3 = _map(draft.get(Method.EAGLE3.value), f"{source}: draft.eagle3")
        pe = _map(draft.get(Method.P_EAGLE.value), f"{source}: draft.p_eagle")
        ng = _map(draft.get(Method.NGRAM.value), f"{source}: draft.ngram")
        mem = _map(d.get("memory"), f"{source}: memory")
        moe_d = d.get("moe")
        moe = None
        if moe_d is not None:
            m = _map(moe_d, f"{source}: moe")
            experts = _count(m, "num_experts", "moe", lo=1, hi=1 << 16)
            moe = MoE(
                _num(m, "expert_bytes_per_gpu", "moe", hi=MAX_GB * 1e9),
                experts,
                _count(m, "experts_per_token", "moe", lo=1, hi=experts),  # a token reads at most all of them
                _num(m, "bandwidth_bytes_per_s", "moe", lo=1.0, hi=1e18),
                _num(m, "efficiency", "moe", lo=1e-3, hi=1.0),
            )
        sources = d.get("sources", [])
        if not isinstance(sources, list) or not all(isinstance(x, str) for x in sources):
            raise ProfileError(f"sources: expected a list of strings, got {shown(sources)}")
        profile = Profile(
            name=_text(d, "name", ""),
            description=_text(d, "description", "", default=""),
            model=_text(d, "model", ""),
            hardware=_text(d, "hardware", ""),
            derivation=_text(d, "derivation", "", default=""),
            target=_linear(_map(d.get("target"), f"{source}: target"), "target"),
            eagle3_draft=_linear(e3, "draft.eagle3", "spec_s_per_token"),
            fit_k=_count(e3, "fit_k", "draft.eagle3", lo=1, hi=MAX_FIT_K),
            eagle3_cost=_draft_cost(e3, source),
            p_eagle_pass_forwards=_num(pe, "pass_forwards", "draft.p_eagle", hi=MAX_FIT_K),
            p_eagle_slot_s=_num(pe, "slot_s", "draft.p_eagle") if "slot_s" in pe else 0.0,
            ngram_verify_fraction=_num(ng, "verify_fraction", "draft.ngram", hi=1.0),
            overhead_s=_num(d, "overhead_s", "profile"),
            memory=Memory(
                gpu=_text(mem, "gpu", "memory."),
                gpu_memory_gb=_num(mem, "gpu_memory_gb", "memory", lo=1.0, hi=MAX_GB),
                num_gpus=_count(mem, "num_gpus", "memory", lo=1, hi=4096),
                weights_gb=_num(mem, "weights_gb", "memory", hi=MAX_GB),
                draft_weights_gb=_num(mem, "draft_weights_gb", "memory", hi=MAX_GB),
                kv_bytes_per_token=_num(mem, "kv_bytes_per_token", "memory", lo=1.0, hi=MAX_GB * 1e9),
                reserve_gb=_num(mem, "reserve_gb", "memory", hi=MAX_GB),
                gpu_memory_utilization=_num(mem, "gpu_memory_utilization", "memory", lo=0.01, hi=1.0),
            ),
            gpu_price_key=_text(d, "gpu_price", ""),
            api_price_key=_text(d, "api_price", "", default=""),
            moe=moe,
            sources=tuple(sources),
            **_host_section(d, source),
        )
        bad_name = name_problem(profile.name)
        if bad_name is not None:
            raise ProfileError(f"name: {bad_name}")
        _check_physics(profile)
        return profile
    except KeyError as e:
        raise ProfileError(f"{source}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        # Every message names the file (and the field's line, when known), then the field.
        msg = str(e).removeprefix(f"{source}: ")
        fld = msg.partition(": ")[0]
        # A top-level figure is named profile.KEY (overhead_s): its line is KEY's, which went unfound.
        key = fld.removeprefix("profile.")
        line = lines.by_path.get(key) if lines is not None and " " not in fld else None
        if line is None and lines is not None and " " not in fld and "." in fld:
            line = lines.by_path.get(fld.rpartition(".")[0])  # a missing field: its section's line
        raise ProfileError(f"{source}:{line}: {msg}" if line else f"{source}: {msg}") from None


def _profile_dir() -> Path:
    return Path(str(importlib.resources.files("sim") / "profiles"))


def profile_names() -> list[str]:
    return sorted(p.stem for p in _profile_dir().glob("*.yaml"))


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (``sim/profiles/NAME.yaml``) or by path to a YAML file."""
    p = Path(name_or_path)
    if not (p.suffix in PROFILE_SUFFIXES and p.exists()):
        p = _profile_dir() / f"{name_or_path}.yaml"
        # A name is a shipped file's stem, never a path ('../x' read a file outside sim/profiles).
        if name_problem(name_or_path) is not None or not p.exists():
            raise ProfileError(f"unknown profile {name_or_path!r} (known: {', '.join(profile_names())})")
    try:
        # Only a regular file is read, and never past the limit: a FIFO named x.yaml blocked the run
        # forever, and a link to /dev/zero (st_size 0) was read until memory ran out.
        kind = p.stat().st_mode
        if stat.S_ISDIR(kind):
            raise ProfileError(f"{p}: cannot read: Is a directory")
        if not stat.S_ISREG(kind):
            raise ProfileError(f"{p}: not a regular file (a device, FIFO or socket), not a profile")
        with p.open("rb") as f:
            data = f.read(MAX_PROFILE_BYTES + 1)
        if len(data) > MAX_PROFILE_BYTES:
            raise ProfileError(f"{p}: larger than {MAX_PROFILE_BYTES} bytes, not a profile")
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ProfileError(f"{p}: not UTF-8 text") from None
    except OSError as e:
        raise ProfileError(f"{p}: cannot read: {error_text(e)}") from None
    return parse_profile_text(text, source=str(p))


#: Profile keys that take text (top level): one written like a YAML 1.2 float (``model: 2e5``), which
#: ``yamldoc`` reads as a number, keeps the text written, as YAML 1.1 read it.
_TEXT_KEYS = frozenset({"name", "description", "model", "hardware", "derivation", "gpu_price", "api_price"})
_SOURCE_ITEM = re.compile(r"sources\[[0-9]+\]")


def parse_profile_text(text: str, *, source: str) -> Profile:
    """A profile from its YAML text (``load_profile``'s file, or what ``profile fit`` writes)."""
    try:  # one YAML reader with the policies and the config: duplicate keys and deep nesting refused
        data, lines = yamldoc.load(text, max_depth=12, max_nodes=100_000)
    except yamldoc.YamlProblem as e:
        line, path, message = e.line, e.path, e.message
        where = f"{source}:{line}" if line else source
        raise ProfileError(f"{where}: {path + ': ' if path else ''}{message}") from None
    if isinstance(data, dict):
        for path, written in lines.yaml12_floats.items():
            if path in _TEXT_KEYS and isinstance(data.get(path), float):
                data[path] = written
            elif _SOURCE_ITEM.fullmatch(path) and isinstance(data.get("sources"), list):
                i = int(path[len("sources[") : -1])
                if isinstance(data["sources"][i], float):
                    data["sources"][i] = written
    return parse_profile(data, source=source, lines=lines)


DEFAULT_PROFILE = "llama-3.1-8b-h100"
