import numpy as np
import pytest

from controller.embedded.cost import StepCost
from policies.arms import METHOD_CODES, Method


def _d(n: int, method: Method, k: int, ctx: int = 1000) -> float:
    return StepCost().duration(
        kv_tokens=np.full(n, ctx),
        methods=np.full(n, METHOD_CODES[method], dtype=np.int8),
        ks=np.full(n, k if method is not Method.OFF else 0),
    )


def test_worked_values_from_the_fitted_model() -> None:
    # research/anchors.md §6a: batch 1, 1k context: ~7.1 ms plain, ~9.4 ms with EAGLE-3 K=3.
    assert _d(1, Method.OFF, 0) == pytest.approx(7.13e-3, rel=0.02)
    assert _d(1, Method.EAGLE3, 3) == pytest.approx(9.4e-3, rel=0.03)


def test_cost_grows_with_batch_and_k_and_ngram_is_cheap() -> None:
    assert _d(32, Method.EAGLE3, 3) > _d(4, Method.EAGLE3, 3) > _d(1, Method.EAGLE3, 3)
    assert _d(8, Method.EAGLE3, 4) > _d(8, Method.EAGLE3, 1) > _d(8, Method.OFF, 0)
    assert _d(8, Method.NGRAM, 3) < _d(8, Method.EAGLE3, 3)
    # relative price of speculation rises with the batch
    assert _d(48, Method.EAGLE3, 3) / _d(48, Method.OFF, 0) > 1.4
