"""Contexts: what a choice may depend on (batch-size bucket x traffic class).

Inside ``policies`` a context is a ``Context``; its string form (``"2-4/code"``, the bucket label, a
slash, the class) is made by ``Context.key`` and read back by ``Context.parse`` only where contexts
leave the process: metrics, status, snapshots and the wire. Contexts sort as their string forms do, so
an order written into a directive or a snapshot does not depend on which form was sorted.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from policies.params import shown

#: Upper bounds of the default buckets 1, 2-4, 5-8, 9-16, 17-32 and 33+.
DEFAULT_BUCKET_BOUNDS: tuple[int, ...] = (1, 4, 8, 16, 32)
#: The class used for requests that carry none, and for engines that cannot choose per request.
DEFAULT_CLASS = "default"
ANY_CLASS = "*"


#: vLLM's max_num_seqs is in the hundreds; a batch of a million sequences is not an engine (the wire
#: protocol's bound on a step's batch size, and on a policy's bucket bounds).
MAX_BATCH_SIZE = 1 << 20


@dataclass(frozen=True, slots=True)
class BatchBuckets:
    """Batch sizes grouped into buckets by their inclusive upper bounds; the last bucket is open."""

    bounds: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS

    def __post_init__(self) -> None:
        b = tuple(self.bounds)
        if not b:
            raise ValueError("batch buckets: need at least one bound")
        bad = next(
            (
                i
                for i, x in enumerate(b)
                if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= MAX_BATCH_SIZE
            ),
            None,
        )
        if bad is not None:  # the one bound, shortened: the list held a 4,000-digit integer in full
            raise ValueError(
                f"batch buckets: bounds[{bad}] must be an integer 1..{MAX_BATCH_SIZE}, got {shown(b[bad])}"
            )
        if any(x >= y for x, y in pairwise(b)):
            raise ValueError(f"batch buckets: bounds must be strictly increasing, got {list(b)}")
        object.__setattr__(self, "bounds", b)

    def __len__(self) -> int:
        return len(self.bounds) + 1

    def index(self, batch_size: int) -> int:
        return bisect_left(self.bounds, max(1, batch_size))

    def indices(self, batch_sizes: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.searchsorted(np.asarray(self.bounds), np.maximum(batch_sizes, 1), side="left")
        return out

    def range(self, i: int) -> tuple[int, int]:
        """Inclusive batch-size range of bucket i; the upper end is 0 for the open bucket."""
        lo = 1 if i == 0 else self.bounds[i - 1] + 1
        hi = self.bounds[i] if i < len(self.bounds) else 0
        return lo, hi

    def label(self, i: int) -> str:
        lo, hi = self.range(i)
        if hi == 0:
            return f"{lo}+"
        return str(lo) if lo == hi else f"{lo}-{hi}"

    def labels(self) -> list[str]:
        return [self.label(i) for i in range(len(self))]

    @classmethod
    def of(cls, bounds: Sequence[int]) -> BatchBuckets:
        return cls(tuple(bounds))


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """One bandit problem of the slow loop: a batch bucket (its label, e.g. ``"2-4"``) and a traffic
    class (``"*"``, ``ANY_CLASS``, pools every request of the bucket)."""

    bucket: str
    traffic_class: str = ANY_CLASS

    def __post_init__(self) -> None:
        for name in ("bucket", "traffic_class"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"context {name}: expected a non-empty string, got {v!r}")
        if "/" in self.bucket:
            raise ValueError(f"context bucket: a bucket label has no '/', got {self.bucket!r}")

    @property
    def key(self) -> str:
        """The string form used in metrics, status, snapshots and on the wire, e.g. ``"2-4/code"``."""
        return f"{self.bucket}/{self.traffic_class}"

    def __str__(self) -> str:
        return self.key

    def __lt__(self, other: Context) -> bool:
        return self.key < other.key

    @property
    def pooled(self) -> bool:
        """Whether this is the bucket's context over all classes."""
        return self.traffic_class == ANY_CLASS

    @classmethod
    def parse(cls, text: str) -> Context:
        """The context of a string form (``"2-4/code"``); the class may itself hold a ``/``.
        Raises ValueError naming the text when it is not ``BUCKET/CLASS``."""
        bucket, sep, traffic_class = text.partition("/") if isinstance(text, str) else ("", "", "")
        if not sep:
            raise ValueError(f"context {text!r}: expected BUCKET/CLASS, e.g. '2-4/code'")
        return cls(bucket=bucket, traffic_class=traffic_class)
