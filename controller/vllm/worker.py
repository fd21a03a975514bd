"""Composite drafting in the worker (V1 model runner), for async scheduling.

Under async scheduling the drafts never reach the scheduler (it only hands out ``-1`` placeholders),
so the choice between EAGLE and n-gram is made where the drafts are: the engine-core hooks size each
request's placeholders to its own K and name the requests on n-gram in an attribute of the
``SchedulerOutput`` (``NGRAM_ROWS_ATTR``, pickled to the worker with it); the wrapped
``GPUModelRunner.propose_draft_token_ids`` lets EAGLE propose unmodified (its draft state stays
consistent whatever is verified) and then overwrites the rows of n-gram requests with the n-gram draft.

What must hold: the merge only ever replaces whole rows of requests named in the attribute; a row
whose n-gram draft is empty keeps EAGLE's draft (the scheduler has already reserved its slots); any
exception disables the merge for the runner's lifetime (logged once) and EAGLE's drafts pass through.
Each request's token history is kept here from its prompt plus every token the runner sampled
(rejected positions are ``-1``, partial-prefill rows are discarded), exactly the tokens the n-gram
matcher in the engine core sees one step later.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import numpy as np

from controller.vllm import compat
from controller.vllm.mode import NGRAM_ROWS_ATTR, configured_method, is_async, k_table_only_reason
from controller.vllm.ngram import NgramIndex
from controller.vllm.peagle import install_depth_fix
from controller.vllm.settings import PluginSettings
from controller.vllm.v2 import install_v2_runner
from policies.arms import Method

log = logging.getLogger("vllm.speccontrol")


class DraftMerger:
    """Per-request token histories in the worker, and the n-gram rows merged into a draft matrix.

    The histories live in the incremental n-gram index (``NgramIndex``, the engine core's), one slot
    per request: a step costs O(new tokens) per request in one compiled call, not a rescan of each
    n-gram row's whole history."""

    def __init__(self, *, max_k: int, min_n: int, max_n: int, max_model_len: int) -> None:
        self._index = NgramIndex(max_k=max_k, min_n=min_n, max_n=max_n, max_model_len=max_model_len)
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._all = np.ones(64, dtype=np.bool_)  # "draft every row" (a slice of it per step)

    def __len__(self) -> int:
        return len(self._slot)

    def _release(self, rid: str) -> None:
        s = self._slot.pop(rid, None)
        if s is not None:
            self._index.release(s)
            self._free.append(s)

    def observe(
        self,
        req_ids: Sequence[str],
        sampled: Sequence[Sequence[int]],
        discarded: Sequence[bool],
        known_tokens: Callable[[str], Sequence[int] | None],
        finished: Iterable[str] = (),
        restarted: Iterable[str] = (),
    ) -> None:
        """One step's sampled tokens, row ``i`` for ``req_ids[i]`` (negative ids are rejected slots).

        ``known_tokens(rid)``: the request's tokens before this step (prompt plus outputs) when first
        seen; None when they are unknown (prompt embeddings): the request is then never on n-gram.
        ``restarted``: requests resumed after preemption (their history is rebuilt)."""
        for rid in finished:
            self._release(rid)
        for rid in restarted:
            self._release(rid)
        slots: list[int] = []
        new: list[list[int]] = []
        for rid, row, skip in zip(req_ids, sampled, discarded, strict=True):
            if skip:
                continue  # a partial prefill: what it "sampled" is thrown away
            s = self._slot.get(rid)
            if s is None:
                base = known_tokens(rid)
                if base is None:
                    continue
                s = self._free.pop() if self._free else len(self._slot)
                self._index.start(s, [int(t) for t in base if t >= 0])
                self._slot[rid] = s
            slots.append(s)
            new.append([t for t in row if t >= 0])
        if not slots:
            return
        n = len(slots)
        offsets = np.fromiter(itertools.accumulate(map(len, new), initial=0), dtype=np.int64, count=n + 1)
        tokens = np.fromiter(itertools.chain.from_iterable(new), dtype=np.int32, count=int(offsets[-1]))
        if len(self._all) < n:
            self._all = np.ones(2 * n, dtype=np.bool_)
        # Every stepped row drafts (one lookup each): a row named on n-gram reads its draft in merge.
        self._index.step(np.array(slots, dtype=np.int64), tokens, offsets, self._all[:n])

    def merge(
        self, req_ids: Sequence[str], drafts: np.ndarray, ngram_rows: Collection[str]
    ) -> np.ndarray | None:
        """``drafts`` (rows x K) with n-gram requests' rows replaced; None when no row changes.

        An n-gram draft shorter than K is padded with its last token: the scheduler verifies at most
        the request's own K slots, and a padded token is only verified after its predecessors were
        accepted."""
        if not ngram_rows or drafts.ndim != 2 or drafts.shape[1] == 0:
            return None
        width = drafts.shape[1]
        out: np.ndarray | None = None
        for i, rid in enumerate(req_ids):
            s = self._slot.get(rid) if rid in ngram_rows else None
            if s is None:
                continue
            d = self._index.draft(s)[:width]
            if len(d) == 0:
                continue
            if out is None:
                out = drafts.copy()
            out[i, : len(d)] = d
            out[i, len(d) :] = d[-1]
        return out


def _rows(sampled: Any) -> list[list[int]]:
    if isinstance(sampled, list):
        return [list(r) for r in sampled]
    return [list(r) for r in sampled.tolist()]


def _discarded(runner: Any, n: int) -> list[bool]:
    mask = getattr(runner, "discard_request_mask", None)
    arr = getattr(mask, "np", None)
    if arr is None:
        return [False] * n
    return [bool(x) for x in arr[:n]]


def _known_tokens(runner: Any) -> Callable[[str], Sequence[int] | None]:
    def known(rid: str) -> Sequence[int] | None:
        st = runner.requests.get(rid)
        prompt = getattr(st, "prompt_token_ids", None)
        if prompt is None:
            return None
        return [*prompt, *(getattr(st, "output_token_ids", None) or ())]

    return known


def install_worker_hook(settings: PluginSettings) -> None:
    """Wrap ``WorkerWrapperBase.init_device`` (idempotent; the caller checked it, see
    ``compat.INSTALL_POINTS``): in an engine that drafts with P-EAGLE, install the depth fix
    (``peagle.py``); once the worker and its model runner exist in this process, patch the V1
    runner when the engine runs async scheduling with composite drafting. Runs in whichever process
    hosts the worker (the engine core with the in-process executor, else each worker process), and
    imports nothing heavy before vLLM's own worker initialisation."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase  # type: ignore[import-not-found]

    if getattr(WorkerWrapperBase, "_speccontrol_patched", False):
        return
    orig = WorkerWrapperBase.init_device

    def init_device(self: Any, *a: Any, **kw: Any) -> Any:
        vc = getattr(self, "vllm_config", None)
        if configured_method(getattr(vc, "speculative_config", None)) is Method.P_EAGLE:
            install_depth_fix()  # logs and leaves vLLM as it is when it cannot
        v2 = bool(getattr(vc, "use_v2_model_runner", False))
        if v2:
            _guarded(_v2_runner_for, vc, settings)  # before the runner (and its speculator) is built
        out = orig(self, *a, **kw)
        if not v2:
            _guarded(_runner_for, vc, settings)
        return out

    WorkerWrapperBase.init_device = init_device
    WorkerWrapperBase._speccontrol_patched = True


def _guarded(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:  # the worker serves on with EAGLE's drafts
        log.error("speccontrol: worker-side composite drafting not installed: %s: %s", type(e).__name__, e)


def _wanted(vc: Any, settings: PluginSettings) -> Any:
    """The speculative config when this engine runs the worker-side merge (async composite), else None."""
    spec = getattr(vc, "speculative_config", None)
    method = configured_method(spec) if spec is not None else None
    if spec is None or method is None or not is_async(vc):
        return None  # synchronous scheduling: the engine core chooses drafts, nothing to do here
    if k_table_only_reason(settings=settings, method=method, vllm_config=vc) is not None:
        return None
    return spec


def _v2_runner_for(vc: Any, settings: PluginSettings) -> None:
    if _wanted(vc, settings) is None:
        return
    why = install_v2_runner(ngram_min=settings.ngram_min, ngram_max=settings.ngram_max)
    if why is not None:
        log.error("speccontrol: V2 composite drafting not installed: %s", why)


def _runner_for(vc: Any, settings: PluginSettings) -> None:
    spec = _wanted(vc, settings)
    if spec is None:
        return
    bad = compat.problems(compat.V1_WORKER_POINTS, version=None)
    if bad:
        log.error("speccontrol: worker-side composite drafting not installed: %s", "; ".join(bad))
        return
    install_v1_runner(
        max_k=int(spec.num_speculative_tokens),
        min_n=settings.ngram_min,
        max_n=settings.ngram_max,
    )


def install_v1_runner(*, max_k: int, min_n: int, max_n: int) -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` (idempotent). The caller has checked the symbol
    (``compat.V1_WORKER_POINTS``). Each runner builds its merger on its first draft (after the model
    loaded: the index's kernels compile there, not before vLLM's own start-up)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # type: ignore[import-not-found]

    if getattr(GPUModelRunner, "_speccontrol_patched", False):
        return
    orig = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(
        self: Any, scheduler_output: Any, sampled_token_ids: Any, *a: Any, **kw: Any
    ) -> Any:
        drafts = orig(self, scheduler_output, sampled_token_ids, *a, **kw)
        state = self.__dict__.get("_speccontrol_merger", 0)
        if state is None:
            return drafts  # disabled after an error
        try:
            if state == 0:
                state = self._speccontrol_merger = DraftMerger(
                    max_k=max_k,
                    min_n=min_n,
                    max_n=max_n,
                    max_model_len=int(self.max_model_len),
                )
            return _merge_step(self, state, scheduler_output, sampled_token_ids, drafts)
        except Exception:
            log.exception(
                "speccontrol: worker-side n-gram merge failed; disabled (EAGLE drafts pass through)"
            )
            self._speccontrol_merger = None
            return drafts

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._speccontrol_patched = True
    log.info(
        "speccontrol: V1 model runner hook installed (worker-side composite drafting, pid %d)", os.getpid()
    )


def _merge_step(runner: Any, merger: DraftMerger, so: Any, sampled: Any, drafts: Any) -> Any:
    req_ids = list(runner.input_batch.req_ids)
    rows = _rows(sampled)[: len(req_ids)]
    cached = getattr(so, "scheduled_cached_reqs", None)
    merger.observe(
        req_ids[: len(rows)],
        rows,
        _discarded(runner, len(rows)),
        _known_tokens(runner),
        finished=getattr(so, "finished_req_ids", ()) or (),
        restarted=getattr(cached, "resumed_req_ids", ()) or (),
    )
    ngram_rows = getattr(so, NGRAM_ROWS_ATTR, None)
    if not ngram_rows:
        return drafts
    if isinstance(drafts, list):
        width = max((len(d) for d in drafts), default=0)
        if width == 0 or any(len(d) != width for d in drafts):
            return drafts
        merged = merger.merge(req_ids[: len(drafts)], np.asarray(drafts, dtype=np.int64), ngram_rows)
        return drafts if merged is None else merged.tolist()
    host = drafts.cpu().numpy()
    merged = merger.merge(req_ids[: host.shape[0]], host, ngram_rows)
    if merged is None:
        return drafts
    import torch  # type: ignore[import-not-found]

    return torch.from_numpy(merged).to(device=drafts.device, dtype=drafts.dtype)
