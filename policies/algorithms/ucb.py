"""UCB1 and sliding-window UCB on goodput.

Goodput is unbounded, so rewards are scaled by the context's largest mean seen: the confidence radius
is then on the same [0, 1] scale UCB1 assumes. Sliding-window UCB (Garivier & Moulines) keeps only the
last ``window`` rounds, so an arm whose goodput changed is judged on recent rounds alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.algorithms.base import MAX_REWARD, Learner, saved_context, saved_mapping, saved_number
from policies.arms import Arm, Method
from policies.context import Context
from policies.params import Param, shown


def _ucb_pick(n: np.ndarray, s: np.ndarray, allowed: Sequence[int], c: float, t: float) -> int:
    for i in allowed:
        if n[i] <= 0:
            return int(i)
    idx = np.asarray(allowed)
    means = s[idx] / n[idx]
    scale = float(np.abs(means).max()) or 1.0
    bonus = c * np.sqrt(2.0 * np.log(max(t, 2.0)) / n[idx])
    return int(idx[int(np.argmax(means / scale + bonus))])


class _Rounds:
    """A context's window: the newest ``maxlen`` (arm index, reward) pairs, oldest first, as a deque of
    them would hold them, kept in two ring arrays so the table is summed from them in C (``arrays``)."""

    __slots__ = ("_arm", "_len", "_r", "_start", "maxlen")

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        # Grown by doubling up to ``maxlen``: a window of 100000 rounds costs nothing until it fills.
        self._arm = np.zeros(min(maxlen, 64), dtype=np.int64)
        self._r = np.zeros(len(self._arm))
        self._start = self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, pair: tuple[int, float]) -> None:
        size = len(self._arm)
        if self._len == size and size < self.maxlen:  # full below maxlen: grow, oldest first at 0
            arm, r = self.arrays()
            size = min(2 * size, self.maxlen)
            self._arm, self._r = np.zeros(size, dtype=np.int64), np.zeros(size)
            self._arm[: len(arm)], self._r[: len(r)] = arm, r
            self._start = 0
        j = (self._start + self._len) % size
        self._arm[j], self._r[j] = pair
        if self._len == size:  # full at maxlen: the oldest goes
            self._start = (self._start + 1) % size
        else:
            self._len += 1

    def extend(self, pairs: Iterable[tuple[int, float]]) -> None:
        for pair in pairs:
            self.append(pair)

    def clear(self) -> None:
        self._start = self._len = 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(arm indices, rewards), oldest first."""
        a, n, size = self._start, self._len, len(self._arm)
        if a + n <= size:
            return self._arm[a : a + n], self._r[a : a + n]
        b = a + n - size  # wrapped: the oldest run from ``a`` to the end, then the rest from 0
        return np.concatenate([self._arm[a:], self._arm[:b]]), np.concatenate([self._r[a:], self._r[:b]])

    def __iter__(self) -> Iterator[tuple[int, float]]:
        arm, r = self.arrays()
        return zip(arm.tolist(), r.tolist(), strict=True)


class UCB1(Learner):
    NAME: ClassVar[str] = "ucb1"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "c": Param(1.0, "Scale of the confidence bonus (1: UCB1 as published).", 0.0, 10.0),
    }

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        t = self.table(ctx)
        return _ucb_pick(t.n, t.s, allowed, float(self.params["c"]), float(t.n.sum()))


class SlidingWindowUCB(Learner):
    NAME: ClassVar[str] = "sw_ucb"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "window": Param(100, "Rounds kept per context.", 2, 100000),
        "c": Param(0.2, "Scale of the confidence bonus (rewards are scaled by the largest mean).", 0.0, 10.0),
    }

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        super().__init__(arms=arms, params=params, rng=rng)
        self._hist: dict[Context, _Rounds] = {}

    def update(self, ctx: Context, rewards: Mapping[int, float]) -> None:
        h = self._hist.get(ctx)
        if h is None:
            h = self._hist[ctx] = _Rounds(int(self.params["window"]))
        for i, r in rewards.items():
            h.append((i, r))
        self._refill(ctx, h)

    def _refill(self, ctx: Context, h: _Rounds) -> None:
        """The context's table summed afresh from its window: the sums ``ArmTable.add`` would make one
        round at a time, oldest first, to the last bit (``bincount`` adds in order), in one pass in C.
        Added in Python, a window of 100000 rounds took about 0.1 s per context and round: with a few
        dozen contexts, more than the decision interval."""
        t = self.table(ctx)
        n = len(self.arms)
        arm, r = h.arrays()
        t.n[:] = np.bincount(arm, minlength=n)
        t.s[:] = np.bincount(arm, weights=r, minlength=n)
        t.q[:] = np.bincount(arm, weights=r * r, minlength=n)

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        t = self.table(ctx)
        return _ucb_pick(t.n, t.s, allowed, float(self.params["c"]), float(t.n.sum()))

    def on_drift(self, cls: str, method: Method, keep: float) -> None:
        """The window is the statistic: drop the drifted arms' rounds (their newest ``keep`` share stays)."""
        idx = {i for i, a in enumerate(self.arms) if a.method is method}
        for ctx, h in self._hist.items():
            if not idx or ctx.traffic_class != cls:
                continue
            rows = [(i, r) for i, r in h if i in idx]
            kept = set(range(len(rows) - int(len(rows) * keep), len(rows)))
            j = -1
            out: list[tuple[int, float]] = []
            for i, r in h:
                if i in idx:
                    j += 1
                    if j not in kept:
                        continue
                out.append((i, r))
            h.clear()
            h.extend(out)
            self._refill(ctx, h)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "hist": {c.key: list(map(list, h)) for c, h in self._hist.items()}}

    def _loaded(self, state: Mapping[str, Any]) -> dict[str, Any]:
        saved = saved_mapping(state.get("hist", {}), "hist", "a mapping of context to rounds")
        return {
            **super()._loaded(state),
            "_hist": {saved_context(c, "hist"): self._window(h, f"hist[{c!r}]") for c, h in saved.items()},
        }

    def _window(self, h: Any, where: str) -> _Rounds:
        """A saved window: [arm index, reward] pairs (an index beyond the arms failed the next update;
        a negative one played the last arm). The newest ``window`` are kept, as the window keeps them."""
        if not isinstance(h, list | tuple):
            raise ValueError(f"{where}: a list of [arm, reward] pairs expected, got {type(h).__name__}")
        n = len(self.arms)
        out = _Rounds(int(self.params["window"]))
        for j, pair in enumerate(h):
            at = f"{where}[{j}]"
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise ValueError(f"{at}: an [arm, reward] pair expected, got {shown(pair)}")
            i, r = pair
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                raise ValueError(f"{at}: {shown(i)} is not an arm index (0 to {n - 1})")
            out.append((i, saved_number(r, f"{at}[1]", lo=-MAX_REWARD, hi=MAX_REWARD)))
        return out
