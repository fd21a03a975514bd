"""The device drafter's two steps as one Triton kernel each: a few launches a step instead of dozens.

``device_ngram.DeviceDrafter`` does a step with n-gram rows in about 46 small torch operations (the
append of the waiting steps' tokens, then the match), each a kernel launch that the engine thread pays
for on the host. The same two steps here are one launch each (``append_rows``, ``match_rows``), one
program per row: the append writes a row's valid tokens after its history and moves its length; the
match scans the row's history once, a block of end positions at a time, and keeps the best (longest
n-gram, then earliest occurrence) as one integer key, then writes the draft over EAGLE's row.

What must hold: the drafts and histories equal the torch path's (``DeviceDrafter`` with
``kernels="torch"``), which the tests check call after call with Triton's interpreter on CPU tensors,
and which ``device_ngram.triton_problem`` checks on the device itself before the plugin uses these
kernels there; nothing is read on the host (the launches take host bounds only); a write with no place
(a rejected slot, a position at ``max_model_len``) is masked out, not spilled.
"""

from __future__ import annotations

import functools
from typing import Any

import triton  # type: ignore[import-not-found]
import triton.language as tl  # type: ignore[import-not-found]

#: Positions per block of the match's scan and of the append's loop.
BLOCK = 256
APPEND_BLOCK = 64
_SHIFT = tl.constexpr(1 << 32)  # key = n * _SHIFT + (_SHIFT - 1 - position): the longest n, then the earliest


def _append_rows(hist, hist_stride, lens, tok, tok_stride, slots, width, max_model_len,  # type: ignore[no-untyped-def]
                 BLOCK_W: tl.constexpr):  # fmt: skip
    """Row ``i`` of ``tok`` (negative: a rejected slot) after slot ``slots[i]``'s history."""
    i = tl.program_id(0)
    s = tl.load(slots + i)
    row = hist + s * hist_stride
    n = tl.load(lens + s)
    for start in range(0, width, BLOCK_W):
        t = start + tl.arange(0, BLOCK_W)
        x = tl.load(tok + i * tok_stride + t, mask=t < width, other=-1)
        valid = x >= 0
        v = valid.to(tl.int64)
        pos = n + tl.cumsum(v, 0) - 1
        tl.store(row + pos, x.to(tl.int32), mask=valid & (pos < max_model_len))
        n += tl.sum(v, 0)
    tl.store(lens + s, tl.minimum(n, max_model_len))


def _match_rows(hist, hist_stride, lens, slots, rows, out, out_stride, cols, min_n, room_max,  # type: ignore[no-untyped-def]
                max_model_len, MAX_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Slot ``slots[i]``'s n-gram draft over row ``rows[i]`` of ``out`` (``cols`` wide, padded with the
    draft's last token), where the draft is not empty: vLLM's rule (the longest suffix n-gram of
    ``min_n..MAX_N`` tokens that occurred earlier, its earliest occurrence; the tokens after it, at most
    ``room_max`` and up to ``max_model_len``)."""
    i = tl.program_id(0)
    s = tl.load(slots + i)
    r = tl.load(rows + i)
    row = hist + s * hist_stride
    total = tl.load(lens + s)
    last = total - 1
    shift = tl.full([], _SHIFT, tl.int64)
    best = total * 0 - 1  # the best key so far (int64; -1: none)
    for start in range(0, last, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)  # where an earlier occurrence ends (before the last token)
        alive = p < last
        run = tl.zeros([BLOCK_P], dtype=tl.int64)
        for j in tl.static_range(MAX_N):  # how many tokens ending at p equal the suffix's
            q = p - j
            alive = alive & (q >= 0)
            a = tl.load(row + q, mask=alive, other=0)
            b = tl.load(row + tl.maximum(last - j, 0))
            alive = alive & (a == b)
            run += alive.to(tl.int64)
        key = tl.where(p < last, run * shift + (shift - 1 - p), -1)
        best = tl.maximum(best, tl.max(key, 0))
    n = best // shift
    p = shift - 1 - best % shift
    room = tl.minimum(max_model_len - total, room_max)
    count = tl.minimum(last - p, room)
    count = tl.where((best >= 0) & (n >= min_n), count, 0)
    t = tl.arange(0, BLOCK_K)
    src = p + 1 + tl.minimum(t, count - 1)
    keep = (t < cols) & (t * 0 + count > 0)  # (a vector: a scalar mask is not one)
    tok = tl.load(row + src, mask=keep, other=0)
    tl.store(out + r * out_stride + t, tok.to(out.dtype.element_ty), mask=keep)


_INTS = ["hist_stride", "tok_stride", "width", "max_model_len", "out_stride", "cols", "min_n", "room_max"]


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` before triton was
    imported): on CPU tensors, for the tests; never what a GPU should run."""
    return bool(triton.knobs.runtime.interpret)


@functools.cache
def kernels() -> tuple[Any, Any]:
    """(append, match), compiled at their first launch (or interpreted: ``interpreted``). The integer
    arguments are not specialised on: a new history width or batch must not compile anew while
    serving."""
    return tuple(  # type: ignore[return-value]
        triton.jit(fn, do_not_specialize=[a for a in _INTS if a in _args(fn)])
        for fn in (_append_rows, _match_rows)
    )


def _args(fn: Any) -> tuple[str, ...]:
    return tuple(fn.__code__.co_varnames[: fn.__code__.co_argcount])


def append_rows(hist: Any, lens: Any, tok: Any, slots: Any, max_model_len: int) -> None:
    """``tok``'s row ``i`` (valid tokens: >= 0) after slot ``slots[i]``'s history, in one launch; the
    caller has made ``hist`` wide enough."""
    n, width = int(tok.shape[0]), int(tok.shape[1])
    if n == 0 or width == 0:
        return
    append, _ = kernels()
    append[(n,)](
        hist, hist.stride(0), lens, tok, tok.stride(0), slots, width, max_model_len, BLOCK_W=APPEND_BLOCK
    )


def match_rows(hist: Any, lens: Any, slots: Any, rows: Any, out: Any, *, min_n: int, max_n: int, max_k: int,
               max_model_len: int) -> None:  # fmt: skip
    """Slot ``slots[i]``'s n-gram draft over ``out``'s row ``rows[i]`` where it is not empty, in one
    launch."""
    n, cols = int(slots.shape[0]), int(out.shape[1])
    if n == 0 or cols == 0:
        return
    _, match = kernels()
    match[(n,)](hist, hist.stride(0), lens, slots, rows, out, out.stride(0), cols, min_n, min(max_k, cols),
                max_model_len, MAX_N=max_n, BLOCK_P=BLOCK, BLOCK_K=triton.next_power_of_2(cols))  # fmt: skip


__all__ = ["append_rows", "interpreted", "kernels", "match_rows"]
