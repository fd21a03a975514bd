"""Kernels run the same compiled or not, and the switch between the two."""

from __future__ import annotations

import numpy as np
import pytest

from policies import jit
from policies.jit import prefetch


@jit.kernel
def _inner(x: np.ndarray, i: int) -> int:
    return int(x[i]) * 3


@jit.kernel
def _outer(x: np.ndarray, out: np.ndarray) -> int:
    total = 0
    for i in range(len(x)):
        out[i] = _inner(x, i)  # a kernel calling a kernel: bound compiled, or called as Python
        total += int(out[i])
    return total


@pytest.mark.usefixtures("kernels")
def test_a_kernel_calling_a_kernel_gives_the_same_results() -> None:
    x = np.array([1, -2, 2**40], dtype=np.int64)
    out = np.zeros(3, dtype=np.int64)
    assert _outer(x, out) == 3 * (1 - 2 + 2**40)
    assert out.tolist() == [3, -6, 3 * 2**40]


def test_the_switch_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        jit.use_numba(False)
        assert not jit.compiling()
        assert _outer(np.array([2], dtype=np.int64), np.zeros(1, dtype=np.int64)) == 6
        assert _outer.compiled is _outer.fn  # ran as written
        monkeypatch.setenv("SPECCONTROL_NUMBA", "0")
        jit.use_numba(None)
        assert not jit.compiling()
        monkeypatch.setenv("SPECCONTROL_NUMBA", "1")
        jit.use_numba(None)
        assert jit.compiling() == jit.numba_available()
    finally:
        jit.use_numba(None)


@jit.kernel
def _sum_prefetched(table: np.ndarray, rows: np.ndarray, flat: np.ndarray) -> int:
    for i in range(len(rows)):
        prefetch(table, int(rows[i]))  # a hint only: a 2-d array's row
        prefetch(flat, int(rows[i]))  # and a 1-d array's element
    total = 0
    for i in range(len(rows)):
        total += int(table[rows[i], 1]) + int(flat[rows[i]])
    return total


@pytest.mark.usefixtures("kernels")
def test_prefetch_is_a_hint_that_changes_no_result() -> None:
    table = np.arange(30, dtype=np.int64).reshape(10, 3)
    flat = np.arange(10, dtype=np.int32) * 7
    rows = np.array([9, 0, 4, 4], dtype=np.int64)
    assert _sum_prefetched(table, rows, flat) == sum(3 * r + 1 + 7 * r for r in (9, 0, 4, 4))


def test_prefetch_compiles_under_each_name_llvm_gave_it_and_to_nothing_without_one() -> None:
    numba = pytest.importorskip("numba")
    # The opaque-pointer name, the typed one (LLVM 12-16; later ones upgrade it), none (before 12).
    for name in ("llvm.prefetch.p0", "llvm.prefetch.p0i8", ""):
        hint = jit._prefetch_hint(name)

        def plus_one(a: np.ndarray) -> int:
            hint(a, 0)  # noqa: B023 (compiled now, with this loop's hint)
            return int(a[0]) + 1

        compiled = numba.njit(plus_one)
        assert compiled(np.array([41], dtype=np.int64)) == 42
        ir = compiled.inspect_llvm(compiled.signatures[0])
        assert ("call void @llvm.prefetch" in ir) == bool(name)
