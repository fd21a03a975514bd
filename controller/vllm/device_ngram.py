"""Composite drafting in the worker with the n-gram match on the device: no step waits for the device.

``worker.DraftMerger`` keeps the histories on the host, so a step with any request on n-gram must read
that step's sampled tokens on the host, which waits for the device to sample them: the engine thread
then schedules the next step only after this one ran, the overlap async scheduling exists for. This
drafter keeps the histories where the sampled tokens are (an int32 matrix on the runner's device, a row
per request, as vLLM's own ``ngram_gpu`` drafter does, though only as wide as the longest history) and
does the whole step with tensor operations queued behind the step's own work: this step's tokens are
scattered in, the n-gram rows matched (one pass for every n, on each history reversed; ``_merge``) and
their drafts written over EAGLE's rows with ``torch.where``. The host only decides which rows do what
(slots, requests on n-gram, partial prefills: all host state) and uploads new requests' prompts.

What must hold:
- the drafts equal ``DraftMerger.step``'s, step after step (and so ``policies.prompt_lookup.match_ngram``
  on each full history): the tests drive both with the same calls;
- nothing reads a device value on the host: no ``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero`` or
  data-dependent shape. The tests run every step on torch's ``meta`` device, which has no data, so any
  such read raises. Shapes come from host bounds: each slot's length is known to the host only up to the
  tokens it may have taken (``_bound``: its prompt plus the sampled width of every step), and the match
  runs over that many columns;
- a write that has no place (a rejected slot, a position at ``max_model_len``) goes to the matrix's
  last column, which is never read; the matrix grows (doubling, on the host's bounds) to the longest
  history, so device memory is ``slots x longest history x 4`` bytes, not ``max_model_len`` wide;
  the torch path's match takes the n-gram rows in groups of at most ``_MATCH_CELLS`` history positions
  (a few hundred MiB at once, whatever the batch and the context).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import numpy as np
import torch  # type: ignore[import-not-found]

log = logging.getLogger("vllm.speccontrol")

#: The device drafter's kernels (``DeviceDrafter.kernels``).
KERNELS = ("torch", "triton")
_MIN_ROWS = 16
_MIN_COLS = 256
#: Steps without n-gram rows whose appends may wait, to run as one (``DeviceDrafter.flush``).
_DEFER = 16
#: (rows x history positions) one group of the torch path's match takes at once (``_merge``).
_MATCH_CELLS = 1 << 21


class DeviceDrafter:
    """Per-request token histories as a device matrix, and the n-gram rows merged into EAGLE's drafts
    with tensor operations only (the module's docstring says why and what must hold)."""

    def __init__(
        self, *, max_k: int, min_n: int, max_n: int, max_model_len: int, device: Any, kernels: str = "torch"
    ) -> None:
        if not 1 <= min_n <= max_n or max_k < 1 or max_model_len < 1:
            raise ValueError(f"DeviceDrafter: need 1 <= min_n <= max_n and max_k, max_model_len >= 1, got "
                             f"{min_n}, {max_n}, {max_k}, {max_model_len}")  # fmt: skip
        if kernels not in KERNELS:
            raise ValueError(f"DeviceDrafter: kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        self.max_k, self.min_n, self.max_n, self.max_model_len = max_k, min_n, max_n, max_model_len
        self.device = torch.device(device)
        #: ``triton``: the append and the match one launch each (``device_kernels``; on CPU tensors
        #: through Triton's interpreter, for the tests); ``torch``: tensor operations only.
        self.kernels = kernels
        #: Why the Triton kernels were given up while serving ("": they were not).
        self.failure = ""
        problem = _triton_device_problem(self.device) if kernels == "triton" else None
        if problem is not None:
            raise ValueError(f"DeviceDrafter: {problem}")
        self._pin = self.device.type == "cuda"
        #: Columns in use (the longest history fits); column ``_cols`` takes the writes with no place.
        self._cols = min(_MIN_COLS, max_model_len)
        self._hist = torch.zeros((_MIN_ROWS, self._cols + 1), dtype=torch.int32, device=self.device)
        self._len = torch.zeros(_MIN_ROWS, dtype=torch.int64, device=self.device)
        self._bound = np.zeros(_MIN_ROWS, dtype=np.int64)  # host: each slot's length is at most this
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._arange = torch.arange(max_model_len + max_n + max_k, device=self.device)
        self._dev_slots: tuple[np.ndarray, Any] = (np.zeros(0, dtype=np.int64), None)
        #: Deferred appends (``_defer``): each step's tokens of the slots ``_pending_slots``.
        self._pending: list[Any] = []
        self._pending_slots = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._slot)

    def _upload(self, arr: np.ndarray) -> Any:
        t = torch.from_numpy(arr)
        if self._pin:  # a pinned, non-blocking copy: the host goes on at once
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _fit(self, rows: int, cols: int) -> None:
        """Grow the matrix (doubling) to hold ``rows`` slots and histories of ``cols`` tokens: device
        memory follows the longest history, not ``max_model_len``. Positions past a slot's length are
        never read, so what the old last column held does not matter."""
        old_rows, old_cols = self._hist.shape[0], self._cols
        if rows <= old_rows and cols <= old_cols:
            return
        new_rows = max(rows, 2 * old_rows) if rows > old_rows else old_rows
        new_cols = min(max(cols, 2 * old_cols), self.max_model_len) if cols > old_cols else old_cols
        hist = torch.zeros((new_rows, new_cols + 1), dtype=torch.int32, device=self.device)
        hist[:old_rows, :old_cols] = self._hist[:, :old_cols]
        self._hist, self._cols = hist, new_cols
        if new_rows > old_rows:
            ln = torch.zeros(new_rows, dtype=torch.int64, device=self.device)
            ln[:old_rows] = self._len
            self._len = ln
            self._bound = np.concatenate([self._bound, np.zeros(new_rows - old_rows, dtype=np.int64)])

    def _start(self, rid: str, known_tokens: Callable[[str], Sequence[int] | None]) -> int:
        base = known_tokens(rid)
        if base is None:  # prompt embeddings: never on n-gram
            return -1
        tokens = np.array([int(t) for t in base if t >= 0][: self.max_model_len], dtype=np.int32)
        s = self._free.pop() if self._free else len(self._slot)
        self._fit(s + 1, len(tokens))
        if len(tokens):
            self._hist[s, : len(tokens)] = self._upload(tokens)
        self._len[s] = len(tokens)
        self._bound[s] = len(tokens)
        self._slot[rid] = s
        return s

    def _release(self, rid: str) -> None:
        s = self._slot.pop(rid, None)
        if s is not None:
            self._free.append(s)

    def step(
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
    ) -> Any:
        """``DraftMerger.step`` with ``sampled`` (rows x width, negative: a rejected slot) and ``drafts``
        (rows x K, or None: no merge) as tensors on the device: returns the merged drafts as a new tensor
        on the device, or None when no row changes (no drafts, or no row on n-gram)."""
        gone = [*finished, *restarted]
        if gone:
            self.flush()  # a deferred append must reach the slot before another request may take it
        for rid in gone:
            self._release(rid)
        n = len(req_ids)
        stepped = min(int(sampled.shape[0]), n)
        skip = np.zeros(n, dtype=np.bool_) if discarded is None else np.asarray(discarded[:n], dtype=np.bool_)
        if len(skip) < n:
            skip = np.concatenate([skip, np.zeros(n - len(skip), dtype=np.bool_)])
        slots = np.fromiter(map(self._slot.get, req_ids, itertools.repeat(-1)), dtype=np.int64, count=n)
        for j in np.flatnonzero(slots[:stepped] < 0).tolist():
            if not skip[j]:
                slots[j] = self._start(req_ids[j], known_tokens)
        rows = np.flatnonzero((slots[:stepped] >= 0) & ~skip[:stepped])  # rows that take this step's tokens
        ng = np.zeros(0, dtype=np.int64)  # the rows whose drafts are n-gram's
        if drafts is not None and drafts.ndim == 2 and drafts.shape[1] > 0 and ngram_rows:
            on = np.fromiter(map(ngram_rows.__contains__, req_ids), dtype=np.bool_, count=n)
            ng = np.flatnonzero(on & (slots >= 0))
            ng = ng[ng < drafts.shape[0]]
        if len(rows) and sampled.shape[1] > 0:
            # Appended now only where a draft reads the histories: see ``_defer``.
            self._defer(self._rows_of(sampled, rows), slots[rows], copy=not len(ng))
        if not len(ng):
            return None
        self.flush()
        return self._merge(drafts, ng, slots[ng])

    def _rows_of(self, sampled: Any, rows: np.ndarray) -> Any:
        """The rows of ``sampled`` that take their tokens."""
        if len(rows) == rows[-1] + 1:  # rows 0..r-1 (the usual step): no gather
            return sampled[: len(rows)]
        return sampled.index_select(0, self._upload(rows))

    def _defer(self, tok: Any, slots: np.ndarray, *, copy: bool) -> None:
        """Keep a step's tokens (row ``i``: slot ``slots[i]``'s) for an append at the next ``flush``,
        which comes before anything reads the histories or a slot changes hands. The appends of up to
        ``_DEFER`` steps of the same slots then run as one: a step without n-gram rows costs one copy
        (``copy``: of rows of the runner's own tensor, which it may reuse), not a dozen operations."""
        if self._pending and (len(self._pending) >= _DEFER or not np.array_equal(slots, self._pending_slots)):
            self.flush()
        if copy and tok._is_view():
            tok = tok.clone()
        self._pending.append(tok)
        self._pending_slots = slots

    def flush(self) -> None:
        """Append the deferred steps' tokens: their columns side by side are the tokens in the order
        the steps took them, so one append places each where the appends one by one would have."""
        if not self._pending:
            return
        tok = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending, 1)
        slots = self._pending_slots
        self._pending = []
        self._append(tok, slots, self._on_device(slots))

    def _append(self, tok: Any, slots: np.ndarray, dev_slots: Any) -> None:
        """Row ``i`` of ``tok`` onto slot ``slots[i]``'s history (``dev_slots`` on the device)."""
        width = int(tok.shape[1])
        bound = np.minimum(self._bound[slots] + width, self.max_model_len)
        self._fit(0, int(bound.max()))  # every valid position now has a column
        if self.kernels == "triton" and self._launch("append_rows", self._hist, self._len, tok.contiguous(),
                                                     dev_slots, self.max_model_len):  # fmt: skip
            self._bound[slots] = bound
            return
        valid = tok >= 0
        count = valid.cumsum(1)  # (r, width): the tokens up to each place
        old = self._len[dev_slots]
        pos = count + (old - 1).unsqueeze(1)
        pos = torch.where(valid & (pos < self.max_model_len), pos, self._cols)
        self._hist[dev_slots.unsqueeze(1), pos] = tok.to(torch.int32)
        self._len[dev_slots] = (old + count[:, -1]).clamp_(max=self.max_model_len)
        self._bound[slots] = bound

    def _launch(self, name: str, *args: Any, **kwargs: Any) -> bool:
        """``device_kernels.<name>`` on this drafter's device (a launch goes to the thread's current
        device, a torch operation to its tensors'); False, and the torch path from now on, where it
        raises: a variant first compiled while serving (a new dtype or width) that fails costs this
        drafter its kernels, not the runner its n-gram drafts. (The launch failed before running, so
        the torch path redoes the same step.)"""
        from controller.vllm import device_kernels

        try:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    getattr(device_kernels, name)(*args, **kwargs)
            else:
                getattr(device_kernels, name)(*args, **kwargs)
        except Exception as e:
            self.kernels = "torch"
            self.failure = _first_line(e)
            log.warning(
                "speccontrol: the Triton kernels failed (%s); the device drafter goes on with torch's operations",
                self.failure,
            )
            return False
        return True

    def _on_device(self, slots: np.ndarray) -> Any:
        """``slots`` on the device: the last upload again while the batch has not changed."""
        if not np.array_equal(slots, self._dev_slots[0]):
            self._dev_slots = (slots.copy(), self._upload(slots))
        return self._dev_slots[1]

    def _merge(self, drafts: Any, rows: np.ndarray, slots: np.ndarray) -> Any:
        """``drafts`` with row ``rows[i]`` replaced by slot ``slots[i]``'s n-gram draft (padded with its
        last token) where that draft is not empty.

        One pass for every n, on each history reversed (``rev[c]`` is the token ``c`` places before the
        last): the suffix n-gram is then ``rev[:n]``, an occurrence ending ``c`` places before the last
        token is ``rev[c : c + n]``, and ``run[c]``, how many leading tokens of ``rev[c:]`` equal
        ``rev``'s own, says every n that occurs there. The longest n wins, then the largest ``c`` (the
        earliest occurrence); the draft is ``rev[c - 1], rev[c - 2], ...``: vLLM's rule, in a fixed
        number of tensor operations (a GPU launch each), whatever ``max_n``."""
        cols = int(drafts.shape[1])
        if self.kernels == "triton":
            dev_rows, dev_slots = self._upload(np.stack([rows, slots]))
            merged = drafts.clone(memory_format=torch.contiguous_format)
            if self._launch("match_rows", self._hist, self._len, dev_slots, dev_rows, merged, min_n=self.min_n,
                            max_n=self.max_n, max_k=self.max_k, max_model_len=self.max_model_len):  # fmt: skip
                return merged
        merged = drafts.clone()
        # The match holds about 90 bytes per (row, history position) at once: rows in groups of at most
        # _MATCH_CELLS positions together (host bounds only), so that 1024 rows of 32k tokens take a few
        # hundred MiB at a time, not gigabytes (an allocation that fails switches the drafter off).
        bound = np.maximum(self._bound[slots], 2)
        if len(rows) * int(bound.max()) <= _MATCH_CELLS:  # the usual step: one group
            self._match(merged, rows, slots, cols)
            return merged
        start = 0
        while start < len(rows):
            end, widest = start + 1, int(bound[start])
            while end < len(rows) and (end + 1 - start) * max(widest, int(bound[end])) <= _MATCH_CELLS:
                widest = max(widest, int(bound[end]))
                end += 1
            self._match(merged, rows[start:end], slots[start:end], cols)
            start = end
        return merged

    def _match(self, merged: Any, rows: np.ndarray, slots: np.ndarray, cols: int) -> None:
        """``_merge``'s torch path for one group of rows, written into ``merged``."""
        big = self.max_n
        dev_rows, dev_slots = self._upload(np.stack([rows, slots]))
        width = max(int(self._bound[slots].max()), 2)  # every history in the match is at most this long
        total = self._len[dev_slots].unsqueeze(1)  # (b, 1)
        # c >= total reads the first token (never a match: n <= total - c below).
        at = (total - 1 - self._steps(width + big - 1)).clamp_(min=0)
        rev = self._hist[dev_slots.unsqueeze(1), at]  # (b, width + max_n - 1)
        run = (
            (rev.unfold(1, big, 1)[:, 1:width] == rev[:, None, :big]).cumprod(-1).sum(-1)
        )  # c = 1 .. width - 1
        c = self._steps(width)[1:]
        n_at = torch.minimum(
            run, total - c
        )  # the longest n-gram ending there (one starts at token 0 or after)
        best = n_at.amax(1, keepdim=True)  # the longest that occurs anywhere
        far = torch.where(n_at == best, c, 0).amax(1, keepdim=True)  # its earliest occurrence
        # Tokens after the occurrence: c of them, cut to K and to max_model_len; 0 where best < min_n.
        room = (self.max_model_len - total).clamp_(max=min(self.max_k, cols))
        out = torch.minimum(far, room) * (best >= self.min_n)
        take = (far - 1) - torch.minimum(self._steps(cols), out - 1)  # padded with the last (out = 0: unread)
        ngram = rev.gather(1, take).to(merged.dtype)  # (b, cols)
        merged[dev_rows] = torch.where(out > 0, ngram, merged[dev_rows])

    def _steps(self, n: int) -> Any:
        """``arange(n)`` on the device (a view of one made at start)."""
        return self._arange[:n]


def triton_problem(device: Any, *, max_k: int, min_n: int, max_n: int) -> str | None:
    """Why the Triton kernels should not be used on ``device`` (None: they compile there and give the
    torch path's drafts and histories on a scripted run of growing, repeating histories, requests
    leaving and arriving, rejected slots and ``max_model_len`` reached). Run once, when the worker
    builds its drafter: it reads results on the host, which no serving step does."""
    dev = torch.device(device)
    problem = _triton_device_problem(dev)
    if problem is not None:
        return problem
    try:
        # As serving runs them: the sampled tokens as int32 (vLLM's) and int64, the drafts as int32
        # and int64; a stretch of steps without n-gram rows, whose appends wait and then run as one
        # (wider than one block of the append); discarded rows; requests leaving and arriving.
        for tokens, out in ((torch.int32, torch.int64), (torch.int64, torch.int32)):
            why = _compare_kernels(dev, tokens, out, max_k=max_k, min_n=min_n, max_n=max_n)
            if why is not None:
                return why
    except Exception as e:
        return _first_line(e)
    return None


def _triton_device_problem(dev: Any) -> str | None:
    """Why the Triton kernels cannot run on ``dev`` at all: not importable, or not CUDA (CPU tensors
    only in Triton's interpreter, ``TRITON_INTERPRET=1``, for the tests)."""
    try:
        from controller.vllm.device_kernels import interpreted
    except Exception as e:
        return f"triton cannot be imported ({_first_line(e)})"
    if dev.type != ("cpu" if interpreted() else "cuda"):
        return f"Triton kernels run on CUDA (on CPU in Triton's interpreter), not on {dev} (TRITON_INTERPRET={int(interpreted())})"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _compare_kernels(dev: Any, tokens: Any, out: Any, *, max_k: int, min_n: int, max_n: int) -> str | None:
    """``triton_problem``'s run with sampled tokens of dtype ``tokens`` and drafts of dtype ``out``."""
    kw = {"max_k": max_k, "min_n": min_n, "max_n": max_n, "max_model_len": 400, "device": dev}
    ref, tri = DeviceDrafter(**kw), DeviceDrafter(**kw, kernels="triton")
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": (rng.integers(0, 5, 40 + 30 * i)).tolist() for i in range(12)}
    ids = [f"r{i}" for i in range(6)]
    drafts = torch.full((6, max_k), -7, dtype=out, device=dev)
    for t in range(60):
        sampled = rng.integers(0, 5, (6, max_k + 1))
        sampled[rng.random(sampled.shape) < 0.3] = -1
        quiet = 20 <= t < 40  # appends wait (up to _DEFER steps), then run as one
        on = set() if quiet or t % 3 == 0 else {r for r in ids if rng.random() < 0.6}
        finished = []
        if t % 8 == 7 and not quiet:  # a request leaves, another takes its row
            finished = [ids[t % 6]]
            ids[t % 6] = f"r{6 + t // 8}"
        discarded = rng.random(6) < (0.0 if quiet else 0.1)  # (a batch that changes appends at once)
        got = [d.step(ids, torch.from_numpy(sampled).to(device=dev, dtype=tokens), drafts, on, prompts.get,
                      discarded=discarded, finished=finished) for d in (ref, tri)]  # fmt: skip
        want, have = ((drafts if g is None else g).cpu().tolist() for g in got)
        if want != have:
            return f"its drafts differ from the torch path's at step {t} ({tokens} tokens)"
        if tri.kernels != "triton":
            return f"a launch failed: {tri.failure}"
    ref.flush()
    tri.flush()
    for r, sl in ref._slot.items():
        n = int(ref._len[sl])
        if (
            n != int(tri._len[tri._slot[r]])
            or ref._hist[sl, :n].tolist() != tri._hist[tri._slot[r], :n].tolist()
        ):
            return f"its history of {r} differs from the torch path's ({tokens} tokens)"
    return None


__all__ = ["KERNELS", "DeviceDrafter", "triton_problem"]
