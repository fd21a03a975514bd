"""n-gram drafts and their counterfactual acceptance, from each request's own token history.

n-gram drafting is a pure function of the token history, so the plugin computes the n-gram draft of
every request every step (in the engine-core process, from the tokens the scheduler already holds).
That one draft serves twice: it is the draft the composite drafter hands the scheduler where the rule
picks n-gram, and, where another method was verified, it is scored against the tokens that follow
("counterfactual acceptance", exact under greedy decoding) once they are known.

The rule is vLLM's prompt lookup (``_find_longest_matched_ngram_and_propose_tokens``): the longest
suffix n-gram of ``min_n..max_n`` tokens that occurred earlier, its earliest occurrence; the draft is
the (at most k) tokens that followed it. ``policies.prompt_lookup.match_ngram`` states it directly (a
rescan of the whole history, the reference the tests hold the index to). ``NgramIndex`` gives the
same drafts from an incremental index, so a step costs O(new tokens), not O(history), for the whole
batch in one kernel:

* every request has a slot (the fast loop's); its tokens live in one shared arena (``pool``), in a
  region that moves (doubling) when it fills up; the arena is compacted when it runs out;
* one open-addressing table maps (slot, generation, n-gram) to the n-gram's first start position.
  Entries hold a hash and the position; a hit is confirmed by comparing the tokens, so any vocabulary
  and any ``max_n`` work. Releasing a slot bumps its generation, which makes its entries stale; stale
  entries are dropped when the table is rebuilt (at half load), to a size set by the entries that
  survive, so requests churning through the slots do not grow it;
* both are given back after a burst: every ``_TRIM_EVERY`` releases, an arena 8x or more what the
  live slots hold is compacted into 2x that, and a table 16x or more the entries the live slots can
  have (at most ``max_n - min_n + 1`` a token) is rebuilt to 4x them (the load a rebuild leaves). A
  shrink needs what is live to fall to a quarter of what the last growth sized for, and growing again
  needs it to double, so the two cannot alternate; a rebuild costs O(old size), once per such change.

What must hold: ``NgramIndex`` drafts equal ``match_ngram``'s (and vLLM's) on every history; counts
of a counterfactual are final (a draft is scored once, when the tokens after it are all known or one
differs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from policies.jit import kernel, prefetch
from policies.observation import NOT_SCORED
from policies.prompt_lookup import MAX_NGRAM

# Per-slot state columns (int64).
BASE, CAP, LEN, INDEXED, GEN, PEND_START, PEND_LEN, DRAFT_LEN = range(8)
_COLS = 8
# Table columns: hash + 1 (0: empty), owner (slot << 31 | generation), start << 6 | n.
_KEY, _OWNER, _POS = range(3)
_MASK = (1 << 62) - 1
_GEN_MASK = (1 << 31) - 1
_M1 = 0x9E3779B97F4A7C1
_M2 = 0xBF58476D1CE4E5B
_MIN_REGION = 64
#: The arena's and the table's initial (and least) sizes: tokens, rows.
_MIN_POOL = 1 << 16
_MIN_TABLE = 1 << 12
#: Releases between two checks whether the arena or the table should shrink (``NgramIndex._trim``).
_TRIM_EVERY = 16
#: meta: entries in the table (stale included), arena top, what a refused call needs.
_USED, _TOP, _NEED_POOL, _NEED_TABLE = range(4)


@kernel
def _hash(pool: np.ndarray, at: int, n: int, owner: int) -> int:
    h = (owner * _M1 + n) & _MASK
    for j in range(n):
        h = ((h ^ int(pool[at + j])) * _M2) & _MASK
    return h ^ (h >> 31)


@kernel
def _find(
    table: np.ndarray, pool: np.ndarray, base: int, owner: int, at: int, n: int, h: int
) -> tuple[int, int]:
    """(first start of the n-gram at ``pool[at:at+n]`` in the slot at ``base``, or -1; table row)."""
    mask = len(table) - 1
    i = h & mask
    key = h + 1
    while True:
        kk = int(table[i, _KEY])
        if kk == 0:
            return -1, i
        if kk == key and int(table[i, _OWNER]) == owner and (int(table[i, _POS]) & 63) == n:
            st = int(table[i, _POS]) >> 6
            same = True
            for j in range(n):
                if pool[base + st + j] != pool[at + j]:
                    same = False
                    break
            if same:
                return st, i
        i = (i + 1) & mask


@kernel
def _index_to(
    state: np.ndarray,
    pool: np.ndarray,
    table: np.ndarray,
    meta: np.ndarray,
    s: int,
    upto: int,
    min_n: int,
    max_n: int,
) -> None:
    """Index every n-gram of slot ``s`` that ends before position ``upto`` (first occurrences only)."""
    base = int(state[s, BASE])
    owner = s * (1 << 31) + int(state[s, GEN])
    used = int(meta[_USED])
    for end in range(int(state[s, INDEXED]), upto):
        for n in range(min_n, max_n + 1):
            st = end - n + 1
            if st < 0:
                break
            h = _hash(pool, base + st, n, owner)
            found, i = _find(table, pool, base, owner, base + st, n, h)
            if found < 0:
                table[i, _KEY] = h + 1
                table[i, _OWNER] = owner
                table[i, _POS] = st * 64 + n
                used += 1
    meta[_USED] = used
    if upto > int(state[s, INDEXED]):
        state[s, INDEXED] = upto


@kernel
def _propose(
    state: np.ndarray,
    pool: np.ndarray,
    table: np.ndarray,
    meta: np.ndarray,
    drafts: np.ndarray,
    s: int,
    min_n: int,
    max_n: int,
    max_model_len: int,
) -> int:
    """Slot ``s``'s n-gram draft into ``drafts[s]`` (returns its length), indexing on the way the
    n-grams that end at the last token.

    The lookups are the indexing: probing the suffix n-grams longest first, the first one found has
    every shorter suffix indexed already (they occurred where it did), and each one not found is new
    at this position, so it goes where its probe ended (no lookup of another size matches it, and a
    size is looked up once: a draft never matches itself).
    """
    base = int(state[s, BASE])
    total = int(state[s, LEN])
    owner = s * (1 << 31) + int(state[s, GEN])
    k = min(drafts.shape[1], max_model_len - total)
    out = 0
    if int(state[s, INDEXED]) < total:
        used = int(meta[_USED])
        for n in range(min(max_n, total), min_n - 1, -1):
            at = base + total - n
            h = _hash(pool, at, n, owner)
            found, i = _find(table, pool, base, owner, at, n, h)
            if found >= 0:
                if k > 0:
                    start = found + n
                    out = min(k, total - start)
                    for j in range(out):
                        drafts[s, j] = pool[base + start + j]
                break
            table[i, _KEY] = h + 1
            table[i, _OWNER] = owner
            table[i, _POS] = (total - n) * 64 + n
            used += 1
        meta[_USED] = used
        state[s, INDEXED] = total
    elif total >= min_n and k > 0:  # already indexed (a repeated proposal): look up without the suffix
        for n in range(min(max_n, total - 1), min_n - 1, -1):
            at = base + total - n
            found, _ = _find(table, pool, base, owner, at, n, _hash(pool, at, n, owner))
            if found >= 0 and found + n < total:
                start = found + n
                out = min(k, total - start)
                for j in range(out):
                    drafts[s, j] = pool[base + start + j]
                break
    state[s, DRAFT_LEN] = out
    return out


@kernel
def room(
    state: np.ndarray,
    pool: np.ndarray,
    table: np.ndarray,
    meta: np.ndarray,
    slots: np.ndarray,
    sizes: np.ndarray,
    nn: int,
) -> bool:
    """Whether the arena and the table can take ``sizes[j]`` more tokens for each ``slots[j]``; if
    not, ``meta`` says how much each needs."""
    top = int(meta[_TOP])
    pool_need = 0
    table_need = 0
    for j in range(len(slots)):
        s = int(slots[j])
        need = int(state[s, LEN]) + int(sizes[j])
        if need > int(state[s, CAP]):
            pool_need += max(_MIN_REGION, 2 * need)
        table_need += (int(sizes[j]) + 1) * nn  # the draft indexes the suffix
    meta[_NEED_POOL] = pool_need
    meta[_NEED_TABLE] = table_need
    return top + pool_need <= len(pool) and 2 * (int(meta[_USED]) + table_need) <= len(table)


@kernel
def append_row(
    state: np.ndarray, pool: np.ndarray, meta: np.ndarray, s: int, src: np.ndarray, a: int, b: int
) -> None:
    """Append ``src[a:b]`` to slot ``s`` (``room`` said yes; its region moves to the arena's top when
    it is full): ``step_row``'s first half for a batch kernel, ``advance_row`` the second (after
    ``prefetch_row`` for every row).

    (The batch kernels once also read here the table rows ``advance_row`` would probe: the hooks were
    2-8% faster without those reads. ``prefetch_row`` only hints them, and pays.)"""
    n = int(state[s, LEN])
    need = n + b - a
    base = int(state[s, BASE])
    if need > int(state[s, CAP]):
        cap = max(_MIN_REGION, 2 * need)
        top = int(meta[_TOP])
        for j in range(n):
            pool[top + j] = pool[base + j]
        base = top
        state[s, BASE] = top
        state[s, CAP] = cap
        meta[_TOP] = top + cap
    for j in range(a, b):
        pool[base + n + j - a] = src[j]
    state[s, LEN] = need


@kernel
def _start(
    state: np.ndarray,
    pool: np.ndarray,
    table: np.ndarray,
    meta: np.ndarray,
    s: int,
    tokens: np.ndarray,
    min_n: int,
    max_n: int,
) -> bool:
    """Slot ``s`` takes a whole history (no draft yet). False (slot left free) when the arena or the
    table needs room first."""
    one = np.full(1, s, dtype=np.int64)
    size = np.full(1, len(tokens), dtype=np.int64)
    state[s, LEN] = 0
    state[s, CAP] = 0
    if not room(state, pool, table, meta, one, size, max_n - min_n + 1):
        state[s, LEN] = -1
        return False
    state[s, INDEXED] = 0
    state[s, PEND_LEN] = -1
    state[s, DRAFT_LEN] = 0
    append_row(state, pool, meta, s, tokens, 0, len(tokens))
    _index_to(state, pool, table, meta, s, len(tokens) - 1, min_n, max_n)
    return True


@kernel
def prefetch_row(
    state: np.ndarray, pool: np.ndarray, table: np.ndarray, s: int, min_n: int, max_n: int
) -> None:
    """Start loading the table rows where ``advance_row``'s probes for slot ``s``'s new n-grams begin
    (after ``append_row``): a batch kernel calls it for every row first, so that the rows' cache
    misses overlap instead of coming one after another."""
    base = int(state[s, BASE])
    owner = s * (1 << 31) + int(state[s, GEN])
    mask = len(table) - 1
    for end in range(int(state[s, INDEXED]), int(state[s, LEN])):
        for n in range(min_n, max_n + 1):
            st = end - n + 1
            if st < 0:
                break
            prefetch(table, _hash(pool, base + st, n, owner) & mask)


@kernel
def _step(
    state: np.ndarray,
    pool: np.ndarray,
    table: np.ndarray,
    meta: np.ndarray,
    drafts: np.ndarray,
    pending: np.ndarray,
    slots: np.ndarray,
    tokens: np.ndarray,
    offsets: np.ndarray,
    propose: np.ndarray,
    cf: np.ndarray,
    min_n: int,
    max_n: int,
    max_model_len: int,
) -> bool:
    """One step for a batch: append each slot's new tokens (``tokens[offsets[j]:offsets[j+1]]``),
    score its pending draft into ``cf[j]``, and draft anew where ``propose[j]``. False (and nothing
    changed) when the arena or the table needs room first."""
    sizes = offsets[1:] - offsets[:-1]
    if not room(state, pool, table, meta, slots, sizes, max_n - min_n + 1):
        return False
    for j in range(len(slots)):
        append_row(state, pool, meta, int(slots[j]), tokens, int(offsets[j]), int(offsets[j + 1]))
    for j in range(len(slots)):
        prefetch_row(state, pool, table, int(slots[j]), min_n, max_n)
    for j in range(len(slots)):
        cf[j] = advance_row(state, pool, table, meta, drafts, pending, int(slots[j]), bool(sizes[j] > 0), propose[j],
                            min_n, max_n, max_model_len)  # fmt: skip
    return True


@kernel
def step_row(
    state: np.ndarray,
    pool: np.ndarray,
    table: np.ndarray,
    meta: np.ndarray,
    drafts: np.ndarray,
    pending: np.ndarray,
    s: int,
    tokens: np.ndarray,
    a: int,
    b: int,
    propose: bool,
    min_n: int,
    max_n: int,
    max_model_len: int,
) -> int:
    """Slot ``s`` takes ``tokens[a:b]`` (``room`` said yes); returns the counterfactual count they
    resolved (NOT_SCORED: none) and drafts anew if ``propose``."""
    append_row(state, pool, meta, s, tokens, a, b)
    return int(
        advance_row(state, pool, table, meta, drafts, pending, s, b > a, propose, min_n, max_n, max_model_len)
    )


@kernel
def advance_row(
    state: np.ndarray,
    pool: np.ndarray,
    table: np.ndarray,
    meta: np.ndarray,
    drafts: np.ndarray,
    pending: np.ndarray,
    s: int,
    fresh: bool,
    propose: bool,
    min_n: int,
    max_n: int,
    max_model_len: int,
) -> int:
    """``step_row``'s second half, once slot ``s`` holds its new tokens (``fresh``: it got some): index
    them, score the pending draft (the count, or NOT_SCORED) and draft anew if ``propose``."""
    total = int(state[s, LEN])
    _index_to(state, pool, table, meta, s, total - 1, min_n, max_n)
    score = NOT_SCORED
    plen = int(state[s, PEND_LEN])
    if plen >= 0 and fresh:
        ps = int(state[s, PEND_START])
        seen = min(total, ps + plen) - ps
        base = int(state[s, BASE])
        prefix = 0
        while prefix < seen and pending[s, prefix] == pool[base + ps + prefix]:
            prefix += 1
        if prefix < seen or seen == plen:
            state[s, PEND_LEN] = -1
            score = prefix
    if propose:
        d = _propose(state, pool, table, meta, drafts, s, min_n, max_n, max_model_len)
        if int(state[s, PEND_LEN]) < 0:  # an empty draft scores 0: n-gram would have drafted nothing
            for i in range(d):
                pending[s, i] = drafts[s, i]
            state[s, PEND_START] = total
            state[s, PEND_LEN] = d
    return score


@kernel
def _compact(state: np.ndarray, old: np.ndarray, new: np.ndarray, meta: np.ndarray) -> None:
    """Copy every live slot's region into the new arena, back to back."""
    top = 0
    for s in range(len(state)):
        n = int(state[s, LEN])
        if n < 0:
            continue
        base = int(state[s, BASE])
        for j in range(n):
            new[top + j] = old[base + j]
        state[s, BASE] = top
        top += int(state[s, CAP])
    meta[_TOP] = top


@kernel
def _live_entries(state: np.ndarray, table: np.ndarray) -> int:
    """How many of the table's entries belong to live slots (``_rehash`` keeps just these)."""
    live = 0
    for r in range(len(table)):
        if int(table[r, _KEY]) == 0:
            continue
        owner = int(table[r, _OWNER])
        s = owner >> 31
        if s < len(state) and int(state[s, LEN]) >= 0 and int(state[s, GEN]) == (owner & _GEN_MASK):
            live += 1
    return live


@kernel
def _rehash(state: np.ndarray, old: np.ndarray, new: np.ndarray, meta: np.ndarray) -> None:
    """Move the live slots' entries into the new table (stale generations stay behind)."""
    mask = len(new) - 1
    used = 0
    for r in range(len(old)):
        key = int(old[r, _KEY])
        if key == 0:
            continue
        owner = int(old[r, _OWNER])
        s = owner >> 31
        if s >= len(state) or int(state[s, LEN]) < 0 or int(state[s, GEN]) != (owner & _GEN_MASK):
            continue
        i = (key - 1) & mask
        while int(new[i, _KEY]) != 0:
            i = (i + 1) & mask
        new[i, 0] = key
        new[i, 1] = owner
        new[i, 2] = old[r, _POS]
        used += 1
    meta[_USED] = used


def _pow2(n: int) -> int:
    return 1 << max(10, (max(n, 1) - 1).bit_length())


class NgramIndex:
    """Token histories, n-gram drafts and counterfactual scoring for the requests in slots 0..capacity-1.

    Slots are the caller's (the fast loop's): ``start`` a slot with a request's history, ``step`` the
    batch each engine step, ``release`` the slot when the request leaves.
    """

    def __init__(
        self, *, max_k: int, min_n: int = 1, max_n: int = 3, max_model_len: int = 1 << 30, capacity: int = 64
    ) -> None:
        if not 1 <= min_n <= max_n <= MAX_NGRAM:
            raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n <= {MAX_NGRAM}, got {min_n}, {max_n}")
        if max_k < 1:
            raise ValueError(f"max_k: need >= 1, got {max_k}")
        self.max_k = max_k
        self.min_n, self.max_n = min_n, max_n
        self.max_model_len = max_model_len
        self._state = np.zeros((0, _COLS), dtype=np.int64)
        self._drafts = np.zeros((0, max_k), dtype=np.int32)
        self._pending = np.zeros((0, max_k), dtype=np.int32)
        self._pool = np.zeros(_MIN_POOL, dtype=np.int32)
        self._table = np.zeros((_pow2(_MIN_TABLE), 3), dtype=np.int64)
        self._meta = np.zeros(4, dtype=np.int64)
        self._releases = 0  # since the last ``_trim``
        self._grow_slots(capacity)

    @property
    def capacity(self) -> int:
        return len(self._state)

    def reserve(self, capacity: int) -> None:
        """Room for slots below ``capacity``."""
        if capacity > len(self._state):
            self._grow_slots(capacity)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(state, pool, table, meta, drafts, pending) for a caller's own kernel (``room`` then
        ``step_row``); replaced when they grow (``reserve``, ``make_room``)."""
        return self._state, self._pool, self._table, self._meta, self._drafts, self._pending

    def live(self, slot: int) -> bool:
        return 0 <= slot < len(self._state) and int(self._state[slot, LEN]) >= 0

    def __len__(self) -> int:
        return int((self._state[:, LEN] >= 0).sum())

    def start(self, slot: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Slot ``slot`` holds this history from now on (replacing what it held); its first draft
        comes with its first ``step`` (which may bring no tokens)."""
        if slot >= len(self._state):
            self._grow_slots(slot + 1)
        self.release(slot)
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        while not _start(self._state, self._pool, self._table, self._meta, slot, arr, self.min_n, self.max_n):
            self.make_room()

    def step(
        self, slots: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, propose: np.ndarray
    ) -> np.ndarray:
        """Append each live slot's new tokens (``tokens[offsets[j]:offsets[j + 1]]``, int32), return the
        counterfactual accepted count each resolved (NOT_SCORED where none did), and draft anew where
        ``propose[j]``."""
        cf = np.empty(len(slots), dtype=np.int32)
        while not _step(
            self._state,
            self._pool,
            self._table,
            self._meta,
            self._drafts,
            self._pending,
            slots,
            tokens,
            offsets,
            propose,
            cf,
            self.min_n,
            self.max_n,
            self.max_model_len,
        ):
            self.make_room()
        return cf

    def draft(self, slot: int) -> np.ndarray:
        """The slot's latest n-gram draft (empty if it has none)."""
        if not self.live(slot):
            return self._drafts[0, :0]
        return self._drafts[slot, : int(self._state[slot, DRAFT_LEN])]

    def drafts(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The slots' latest drafts, padded (rows of ``max_k``), and their lengths."""
        return self._drafts[slots], self._state[slots, DRAFT_LEN]

    def tokens(self, slot: int) -> np.ndarray:
        base, n = int(self._state[slot, BASE]), int(self._state[slot, LEN])
        return self._pool[base : base + max(n, 0)]

    def release(self, slot: int) -> None:
        if self.live(slot):
            st = self._state[slot]
            st[LEN] = -1
            st[GEN] = (int(st[GEN]) + 1) & _GEN_MASK
            st[DRAFT_LEN] = 0
            st[PEND_LEN] = -1
            self._releases += 1
            if self._releases >= _TRIM_EVERY:
                self._trim()

    def _trim(self) -> None:
        """Give back what a burst of long requests left: compact an arena 8x or more what the live
        slots hold into 2x that, and rebuild a table of 16x or more the entries they can have (a
        token adds at most one per n-gram size) to 4x them, as ``make_room`` sizes a rebuild (which
        grows to at most 8x the live entries, so a shrink needs them to fall to a quarter). Arrays
        are replaced, as by ``make_room``."""
        self._releases = 0
        st, meta = self._state, self._meta
        live = st[:, LEN] >= 0
        held = int(st[live, CAP].sum())
        if len(self._pool) > _MIN_POOL and 8 * held <= len(self._pool):
            pool = np.zeros(max(_MIN_POOL, 2 * held), dtype=np.int32)
            _compact(st, self._pool, pool, meta)
            self._pool = pool
        bound = (self.max_n - self.min_n + 1) * int(st[live, LEN].sum())
        rows = _pow2(max(4 * bound, _MIN_TABLE))
        if 4 * rows <= len(self._table):  # (so 16x or more the entries: rows >= 4 * bound)
            table = np.zeros((rows, 3), dtype=np.int64)
            _rehash(st, self._table, table, meta)
            self._table = table

    def _grow_slots(self, n: int) -> None:
        old = len(self._state)
        n = max(n, 2 * old)
        state = np.zeros((n, _COLS), dtype=np.int64)
        state[:old] = self._state
        state[old:, LEN] = -1
        state[old:, PEND_LEN] = -1
        self._state = state
        for name in ("_drafts", "_pending"):
            arr = np.zeros((n, self.max_k), dtype=np.int32)
            arr[:old] = getattr(self, name)
            setattr(self, name, arr)

    def make_room(self) -> None:
        """After ``room`` said no: compact or grow the arena, and rebuild or grow the table, to what the refused call needs."""
        st, meta = self._state, self._meta
        live = st[:, LEN] >= 0
        held = int(st[live, CAP].sum())
        need_pool = int(meta[_NEED_POOL])
        if int(meta[_TOP]) + need_pool > len(self._pool):
            size = 2 * (held + need_pool)  # (smaller than now only where 4x smaller: see ``_trim``)
            size = max(_MIN_POOL, size) if 4 * size <= len(self._pool) else max(len(self._pool), size)
            pool = np.zeros(size, dtype=np.int32)
            _compact(st, self._pool, pool, meta)
            self._pool = pool
        need_table = int(meta[_NEED_TABLE])
        if 2 * (int(meta[_USED]) + need_table) > len(self._table):
            # Sized by the entries that survive the rebuild, not by ``_USED`` (stale ones included):
            # with requests churning through the slots nearly every entry is stale, and sizing by
            # them doubled the table at every rebuild (6 GiB after 10^5 short requests, 64 live).
            live_entries = _live_entries(st, self._table)
            table = np.zeros((_pow2(4 * (live_entries + need_table)), 3), dtype=np.int64)
            _rehash(st, self._table, table, meta)
            self._table = table
