import numpy as np
import pytest

from policies.context import BatchBuckets


def test_default_buckets_match_design() -> None:
    b = BatchBuckets()
    assert b.labels() == ["1", "2-4", "5-8", "9-16", "17-32", "33+"]
    assert [b.index(x) for x in (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 500)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert b.indices(np.array([1, 4, 5, 33])).tolist() == [0, 1, 2, 5]
    assert b.range(5) == (33, 0)


@pytest.mark.parametrize("bounds", [(), (4, 4), (0, 2), (8, 4)])
def test_invalid_bounds(bounds: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="batch buckets"):
        BatchBuckets(bounds)
