"""Composite drafting on vLLM's V2 model runner (the GPU default): a speculator wrapper that merges
n-gram drafts into EAGLE-3's by a per-request mask. EXPERIMENTAL, opt-in (``SPECCONTROL_V2_COMPOSITE=1``)
and NOT YET RUN ON A GPU: unit-tested against fakes only; ``scripts/gpu_check.sh`` runs it for real.

The V2 runner keeps drafts on the device (``RequestState.draft_tokens``) and builds one speculator
(``init_speculator``). The wrapper lets EAGLE propose unchanged (its draft state stays consistent),
asks vLLM's GPU n-gram speculator for its drafts on the same batch, and returns
``where(mask[idx_mapping, None], ngram, eagle)``: ``mask`` is indexed by request-state slot and set each
step from the scheduler output (``worker.NGRAM_ROWS_ATTR``). The runner gets the wrapper as an
instance of EAGLE's own class sharing EAGLE's attributes (``graft``): it loads the draft model and sets
its attention up only on a speculator of that type. What must hold: rows of requests not on
n-gram are EAGLE's, bit for bit; a dummy (warm-up / CUDA-graph capture) run returns EAGLE's drafts; any
error disables the merge for the runner's lifetime (logged once) and EAGLE's drafts pass through, on
every tensor-parallel rank (``ranks.py``). An error building the n-gram speculator (or the dense
history) inside vLLM's runner constructor is logged and vLLM's own speculator (or history) is kept: the
plugin never stops an engine from starting.
The GPU n-gram speculator needs the dense device token history, which the V2 runner keeps only for an
n-gram engine: the install turns it on (``max_num_seqs x max_model_len x 4`` bytes of device memory).
Its no-match rows repeat the last sampled token (verified and rejected, as vLLM's own n-gram does).
EAGLE runs at the table's K here (``num_spec_tokens_to_schedule``) for every row: the step's own EAGLE
K (``mode.EAGLE_K_ATTR``), which the V1 worker runs EAGLE at, is not read on this runner.
"""

from __future__ import annotations

import copy
import functools
import logging
import types
from collections.abc import Callable, Collection, Mapping
from typing import Any

from controller.vllm import compat
from controller.vllm.mode import NGRAM_ROWS_ATTR
from controller.vllm.ranks import agree, tensor_parallel_group

log = logging.getLogger("vllm.speccontrol")

V2_POINTS: tuple[compat.PatchPoint, ...] = (
    compat.PatchPoint(
        "vllm.v1.worker.gpu.model_runner", "init_speculator", ("vllm_config", "device", "req_states")
    ),
    compat.PatchPoint(
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model", ("self", "scheduler_output")
    ),
    compat.PatchPoint("vllm.v1.worker.gpu.states", "RequestState.__init__", ("self", "max_num_reqs")),
    compat.PatchPoint(
        "vllm.v1.worker.gpu.spec_decode.ngram.speculator",
        "NgramGPUSpeculator.__init__",
        ("self", "vllm_config", "device", "req_states"),
    ),
)


def merge_by_mask(eagle: Any, ngram: Any, mask: Any, idx_mapping: Any, where: Callable[..., Any]) -> Any:
    """Row ``i`` is ``ngram[i]`` where ``mask[idx_mapping[i]]``, else ``eagle[i]`` (torch or numpy)."""
    width = eagle.shape[1]
    return where(mask[idx_mapping][:, None], ngram[:, :width], eagle)


class CompositeSpeculator:
    """Stands in for the V2 runner's EAGLE speculator; everything but ``propose`` is EAGLE's own."""

    def __init__(
        self,
        *,
        eagle: Any,
        ngram: Any,
        mask: Any,
        req_id_to_index: Mapping[str, int],
        where: Callable[..., Any],
    ) -> None:
        self._eagle = eagle
        self._ngram = ngram
        self._where = where
        #: One flag per request-state slot (device memory in the engine).
        self.mask = mask
        self._slots = req_id_to_index  # the runner's live request -> slot map
        self._rows: Collection[str] = ()
        self._broken = False

    def __getattr__(self, name: str) -> Any:
        if name == "_eagle":  # not set yet (copy, pickle): no endless lookup of itself
            raise AttributeError(name)
        return getattr(self._eagle, name)

    def set_ngram_requests(self, scheduler_output: Any) -> None:
        """The requests the scheduler put on n-gram for the drafts proposed in this step."""
        self._rows = getattr(scheduler_output, NGRAM_ROWS_ATTR, None) or ()

    def propose(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        drafts = self._eagle.propose(input_batch, *args, **kwargs)
        # vLLM 0.33 asks for no drafts (K = 0) in a step where no request can use them (its
        # ``skip_drafts``); the runner then discards them, so there is nothing to merge.
        if not self._rows or kwargs.get("dummy_run", False) or kwargs.get("num_speculative_tokens") == 0:
            return drafts
        merged, failed = drafts, self._broken
        if not self._broken:
            try:
                # Slots resolved now: the step's new requests got theirs after set_ngram_requests.
                slots = [self._slots[r] for r in self._rows if r in self._slots]
                self.mask[:] = False
                if slots:
                    self.mask[slots] = True
                ngram = self._ngram.propose(input_batch, *args, **kwargs)
                merged = merge_by_mask(drafts, ngram, self.mask, input_batch.idx_mapping, self._where)
            except Exception:
                log.exception("speccontrol: V2 n-gram merge failed; disabled (EAGLE drafts pass through)")
                self._broken = True
                merged, failed = drafts, True
        # With tensor parallelism every rank must hand on the same drafts (ranks.py); the steps with
        # n-gram rows are the same on every rank.
        group = tensor_parallel_group(self)
        if group is None:
            return merged
        return agree(group, merged, drafts, failed=failed, device=getattr(drafts, "device", "cpu"))


def graft(eagle: Any, **composite: Any) -> CompositeSpeculator:
    """A ``CompositeSpeculator`` over ``eagle`` that is also an instance of ``eagle``'s own class and
    shares its attributes (one ``__dict__``).

    vLLM's V2 runner treats its speculator by type (``isinstance(self.speculator,
    DraftModelSpeculator)``: it loads the draft model, sets its attention up, feeds it the
    verification results only then) and sets attributes on it (``pcp_manager``): a plain wrapper would
    leave EAGLE without its model, its attention and those attributes, and its first proposal would
    fail. Here every method but ``propose`` is EAGLE's own, run on EAGLE's own state. Where the class
    cannot take that (no instance ``__dict__`` to share: slots, a built-in type), the plain wrapper,
    which serves a speculator the runner does not treat by type (vLLM's are Python classes)."""
    try:
        kind: Any = type(eagle)
        cls: Any = _grafted_class(kind)
        obj = cls.__new__(cls)
        obj.__dict__ = eagle.__dict__  # what vLLM sets on its speculator, EAGLE's own methods read
    except Exception as e:
        log.debug(
            "speccontrol: V2 speculator %s not grafted (%s: %s)", type(eagle).__name__, type(e).__name__, e
        )
        return CompositeSpeculator(eagle=eagle, **composite)
    taken = sorted(_FIELDS & eagle.__dict__.keys())
    if taken:  # EAGLE's own attributes of those names would be overwritten: vLLM's speculator as it is
        log.warning("speccontrol: V2 composite drafting not built (the speculator has attributes %s); "
                    "falling back to vLLM's speculator", ", ".join(taken))  # fmt: skip
        return eagle  # type: ignore[no-any-return]
    CompositeSpeculator.__init__(obj, eagle=eagle, **composite)
    return obj  # type: ignore[no-any-return]


#: ``CompositeSpeculator``'s own attributes (in EAGLE's ``__dict__`` once grafted).
_FIELDS = frozenset({"_eagle", "_ngram", "_where", "mask", "_slots", "_rows", "_broken"})


@functools.cache
def _grafted_class(cls: Any) -> type:
    """``CompositeSpeculator`` first (its ``propose``), then ``cls`` (every other method)."""
    return types.new_class(f"Composite{cls.__name__}", (CompositeSpeculator, cls))


def install_v2_runner(*, ngram_min: int, ngram_max: int) -> str | None:
    """Patch the V2 runner for composite drafting; the reason it cannot, or None. Call in the worker
    process before the runner is built (``WorkerWrapperBase.init_device`` runs first)."""
    bad = compat.problems(V2_POINTS, version=None)
    if bad:
        return "; ".join(bad)
    import torch  # type: ignore[import-not-found]
    from vllm.v1.worker.gpu import model_runner, states  # type: ignore[import-not-found]
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import (  # type: ignore[import-not-found]
        NgramGPUSpeculator,
    )

    if getattr(model_runner, "_speccontrol_patched", False):
        return None
    orig_init_speculator = model_runner.init_speculator
    orig_state_init = states.RequestState.__init__
    orig_execute = model_runner.GPUModelRunner.execute_model

    # Both run inside vLLM's GPUModelRunner constructor, where an exception stops the engine from
    # starting; the plugin must never do that, so each falls back to what vLLM builds on its own.
    def state_init(self: Any, *a: Any, **kw: Any) -> None:
        try:
            # The GPU n-gram speculator scans it every step: dense on the device, as for vLLM's n-gram.
            orig_state_init(self, *a, **{**kw, "use_dense_all_token_ids": True})
        except Exception as e:
            # E.g. out of device memory (it is allocated before vLLM profiles memory). The n-gram
            # speculator then reads vLLM's default host-backed (UVA) history: slower, still correct.
            log.warning(
                "speccontrol: V2 dense token history not allocated (%s: %s); falling back to vLLM's own",
                type(e).__name__,
                e,
            )
            orig_state_init(self, *a, **kw)

    def init_speculator(vllm_config: Any, device: Any, req_states: Any) -> Any:
        eagle = orig_init_speculator(vllm_config, device, req_states)
        try:
            spec = vllm_config.speculative_config
            if not spec.use_eagle():
                return eagle
            vc = copy.copy(vllm_config)
            vc.speculative_config = copy.copy(spec)
            vc.speculative_config.prompt_lookup_min = ngram_min
            vc.speculative_config.prompt_lookup_max = ngram_max
            mask = torch.zeros(req_states.max_num_reqs, dtype=torch.bool, device=device)
            return graft(
                eagle,
                ngram=NgramGPUSpeculator(vc, device, req_states),
                mask=mask,
                req_id_to_index=req_states.req_id_to_index,
                where=torch.where,
            )
        except Exception as e:
            # E.g. no Triton, or a device allocation: n-gram rows then verify EAGLE's drafts.
            log.warning(
                "speccontrol: V2 composite drafting not built (%s: %s); falling back to vLLM's speculator",
                type(e).__name__,
                e,
            )
            return eagle

    def execute_model(self: Any, scheduler_output: Any, *a: Any, **kw: Any) -> Any:
        sp = self.speculator
        if isinstance(sp, CompositeSpeculator):
            sp.set_ngram_requests(scheduler_output)
        return orig_execute(self, scheduler_output, *a, **kw)

    states.RequestState.__init__ = state_init
    model_runner.init_speculator = init_speculator
    model_runner.GPUModelRunner.execute_model = execute_model
    model_runner._speccontrol_patched = True
    log.warning(
        "speccontrol: V2 runner composite drafting installed (experimental, SPECCONTROL_V2_COMPOSITE=1)"
    )
    return None
