"""What every engine applies on its own side of a Directive, written once.

The vLLM plugin (``controller.vllm.control``), the demo engine (``controller.embedded``) and the
simulator (``sim.kernel``) all call these, so the three cannot drift apart:

* ``clamp_row`` (one request; ``clamp_plan`` runs it on a whole plan): the per-request plan made
  playable. A method the engine cannot draft with falls back to its configured one, K never exceeds
  the engine's ``max_k``, and K = 0 means off (and off means K = 0), so a row is either a real draft
  or nothing. Written once, as a kernel (``policies.jit``), so the plugin's compiled plan kernel
  calls the very rule the simulator runs.
* ``drafter_k_row`` (``drafter_k_guess`` on a step): under synchronous scheduling, the K the
  configured drafter (EAGLE-3, P-EAGLE) runs at, guessed before the step from each request's class arm
  and pending plan (the plugin's schedule hook, the simulator's ``composite-sync``).
* ``safe_default_directive``: the directive an engine runs on by itself (version 0) before its first
  directive and after one expires: its start-up configuration, for every class and batch size
  (``startup_table_directive`` where the engine started with a K per batch size).
* ``rule_alpha``: the per-request rule's smoothing factor, with one default.

Pure: numbers and numpy in, numbers and numpy out; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from policies.arms import METHOD_CODES, OFF, Arm, Method
from policies.context import ANY_CLASS
from policies.directive import Directive, KRange, PlanEntry, RequestRule
from policies.jit import kernel

#: Smoothing of the per-request rule's acceptance averages when the rule does not set ``alpha``.
DEFAULT_RULE_ALPHA = 0.3

_OFF = METHOD_CODES[Method.OFF]
_NGRAM = METHOD_CODES[Method.NGRAM]


def rule_alpha(rule: RequestRule) -> float:
    """The rule's ``alpha`` (its EWMA weight of the newest step), or the default."""
    return float(rule.params.get("alpha", DEFAULT_RULE_ALPHA))


@kernel
def clamp_row(m: int, k: int, configured: int, composite: bool, max_k: int) -> tuple[int, int]:
    """One request's plan made playable, the rule every engine applies (the plugin per row in its
    compiled plan kernel, the simulator through ``clamp_plan``): the engine drafts its ``configured``
    method, n-gram as well with the ``composite`` drafter, or nothing, and any other method becomes
    the configured one; K is at most ``max_k``; K <= 0 is off and off is K = 0. Codes are
    ``METHOD_CODES``."""
    if m != _OFF and m != configured and not (composite and m == _NGRAM):
        m = configured
    if k > max_k:
        k = max_k
    if m == _OFF or k <= 0:
        return _OFF, 0
    return m, k


@kernel
def _clamp_rows(
    methods: np.ndarray, ks: np.ndarray, out_m: np.ndarray, out_k: np.ndarray, configured: int, composite: bool,
    max_k: int,
) -> None:  # fmt: skip
    for j in range(len(methods)):
        m, k = clamp_row(int(methods[j]), int(ks[j]), configured, composite, max_k)
        out_m[j] = m
        out_k[j] = k


def clamp_plan(
    methods: np.ndarray, ks: np.ndarray, *, configured: Method, composite: bool, max_k: int
) -> tuple[np.ndarray, np.ndarray]:
    """``clamp_row`` on every request of a plan: (method codes in ``methods``' dtype, K in ``ks``')."""
    out_m = np.empty(len(methods), dtype=methods.dtype)
    out_k = np.empty(len(ks), dtype=ks.dtype)
    _clamp_rows(methods, ks, out_m, out_k, METHOD_CODES[configured], composite, max_k)
    return out_m, out_k


@kernel
def drafter_k_row(m: int, k: int, pending: int, configured: int, composite: bool, max_k: int) -> int:
    """The K one request adds to a synchronous step's guess of its configured drafter's K (0:
    nothing): its class arm ``(m, k)`` as the engine plays it (``clamp_row``) where that is the
    configured drafter, unless its pending plan (``pending``, the method of the draft it verifies in
    the step; -1: none) is n-gram's, because a copy span usually goes on. The guess is made before the
    step runs (the plans of the drafts made after it come after it), from what the engine knows then."""
    if pending == _NGRAM:
        return 0
    m, k = clamp_row(m, k, configured, composite, max_k)
    return k if m == configured else 0


@kernel
def _drafter_k_rows(
    methods: np.ndarray, ks: np.ndarray, pending: np.ndarray, configured: int, composite: bool, max_k: int
) -> int:
    top = 0
    for j in range(len(methods)):
        top = max(
            top, drafter_k_row(int(methods[j]), int(ks[j]), int(pending[j]), configured, composite, max_k)
        )
    return top


def drafter_k_guess(
    methods: np.ndarray,
    ks: np.ndarray,
    pending: np.ndarray,
    *,
    configured: Method,
    composite: bool,
    max_k: int,
) -> int:
    """``drafter_k_row``'s largest over a step's requests (their class arms and pending methods)."""
    return int(_drafter_k_rows(methods, ks, pending, METHOD_CODES[configured], composite, max_k))


def safe_default_directive(arm: Arm, *, max_k: int) -> Directive:
    """The engine's fail-static directive (version 0): ``arm`` (K capped at ``max_k``) everywhere."""
    return _on_its_own(((1, 0, min(arm.k, max_k)),), arm.method, lambda _: arm)


def _on_its_own(
    ranges: Sequence[tuple[int, int, int]], method: Method, arm: Callable[[int], Arm]
) -> Directive:
    """The directive an engine runs on by itself (version 0, no TTL): K ``k`` at batch sizes
    ``bs_min..bs_max`` (0: and up) for each range, every class planned ``arm(k)`` there."""
    return Directive(
        version=0,
        policy="safe-default",
        reason="no fresh directive from the sidecar",
        ttl_s=0.0,
        issued_at_s=0.0,
        k_table=tuple(KRange(lo, hi, k) for lo, hi, k in ranges),
        method=method,
        plan=tuple(PlanEntry(ANY_CLASS, lo, hi, arm(k)) for lo, hi, k in ranges),
    )


def startup_table_directive(lookup: Sequence[int], method: Method, *, max_k: int) -> Directive:
    """The fail-static directive (version 0) of an engine started with a K per batch size (vLLM's
    ``num_speculative_tokens_per_batch_size``; ``lookup`` is its ``dynamic_sd_lookup``, index = batch
    size, entry 0 unused): that table, ``method`` at each range's K (0: off), for every class. With
    ``safe_default_directive`` alone such an engine ran its largest K at every batch size whenever the
    sidecar was absent (K 5 at batch 256 where its table said 1), which is not how it was configured.
    One K throughout is ``safe_default_directive`` itself."""
    ks = [min(max(int(k), 0), max_k) for k in lookup[1:]]
    if not ks:
        raise ValueError("lookup: no batch size")
    if len(set(ks)) == 1:
        return safe_default_directive(Arm(method, ks[0]) if ks[0] else OFF, max_k=max_k)
    runs: list[tuple[int, int, int]] = []  # (first batch size, last, K)
    for bs, k in enumerate(ks, start=1):
        if runs and runs[-1][2] == k:
            runs[-1] = (runs[-1][0], bs, k)
        else:
            runs.append((bs, bs, k))
    last = len(runs) - 1
    ranges = [(lo, 0 if i == last else hi, k) for i, (lo, hi, k) in enumerate(runs)]  # the last: and up
    return _on_its_own(ranges, method, lambda k: Arm(method, k) if k else OFF)


__all__ = [
    "DEFAULT_RULE_ALPHA",
    "clamp_plan",
    "clamp_row",
    "drafter_k_guess",
    "drafter_k_row",
    "rule_alpha",
    "safe_default_directive",
    "startup_table_directive",
]
