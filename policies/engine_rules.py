"""What every engine applies on its own side of a Directive, written once.

The vLLM plugin (``controller.vllm.control``), the demo engine (``controller.embedded``) and the
simulator (``sim.kernel``) all call these, so the three cannot drift apart:

* ``clamp_plan``: the per-request plan made playable. A method the engine cannot draft with falls back
  to its configured one, K never exceeds the engine's ``max_k``, and K = 0 means off (and off means
  K = 0), so a row is either a real draft or nothing.
* ``safe_default_directive``: the directive an engine runs on by itself (version 0) before its first
  directive and after one expires: its start-up configuration, for every class and batch size.
* ``rule_alpha``: the per-request rule's smoothing factor, with one default.

Pure: numpy in, numpy out; no I/O.
"""

from __future__ import annotations

import numpy as np

from policies.arms import METHOD_CODES, Arm, Method
from policies.context import ANY_CLASS
from policies.directive import Directive, KRange, PlanEntry, RequestRule

#: Smoothing of the per-request rule's acceptance averages when the rule does not set ``alpha``.
DEFAULT_RULE_ALPHA = 0.3

_OFF = METHOD_CODES[Method.OFF]


def rule_alpha(rule: RequestRule) -> float:
    """The rule's ``alpha`` (its EWMA weight of the newest step), or the default."""
    return float(rule.params.get("alpha", DEFAULT_RULE_ALPHA))


def playable_codes(methods: tuple[Method, ...] | list[Method]) -> np.ndarray:
    """A lookup by method code: True for the methods an engine can draft with (``off`` always)."""
    out = np.zeros(len(METHOD_CODES), dtype=bool)
    out[_OFF] = True
    for m in methods:
        out[METHOD_CODES[m]] = True
    return out


def clamp_plan(
    methods: np.ndarray, ks: np.ndarray, *, playable: np.ndarray, fallback: Method, max_k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The plan an engine can run: (int8 method codes, K in ``ks``'s dtype), one per request.

    ``playable`` is ``playable_codes(...)``; a method outside it becomes ``fallback``. K is capped
    at ``max_k``; a row with K <= 0 or method off is off with K = 0.
    """
    m = np.where(playable[methods.astype(np.int64)], methods, METHOD_CODES[fallback]).astype(np.int8)
    k = np.minimum(ks, max_k)
    off = (m == _OFF) | (k <= 0)
    if off.any():
        m[off] = _OFF
        k = np.where(off, 0, k).astype(ks.dtype)
    return m, k


def safe_default_directive(arm: Arm, *, max_k: int) -> Directive:
    """The engine's fail-static directive (version 0): ``arm`` (K capped at ``max_k``) everywhere."""
    k = min(arm.k, max_k)
    return Directive(
        version=0,
        policy="safe-default",
        reason="no fresh directive from the sidecar",
        ttl_s=0.0,
        issued_at_s=0.0,
        k_table=(KRange(1, 0, k),),
        method=arm.method,
        plan=(PlanEntry(ANY_CLASS, 1, 0, arm),),
    )


__all__ = [
    "DEFAULT_RULE_ALPHA",
    "clamp_plan",
    "playable_codes",
    "rule_alpha",
    "safe_default_directive",
]
