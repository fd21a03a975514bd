"""P-EAGLE at every depth: the fix for vLLM 0.32's misassigned parallel drafts at 0 < K < max.

vLLM's parallel drafter lays out ``extra_slots_per_request`` mask slots per request, fixed at start-up to
``num_speculative_tokens`` (``v1/spec_decode/llm_base_proposer.py:113-116``), samples one token per slot,
then reshapes the samples by the step's K (``view(-1, K)``, ``:629-637``). At a K below the start-up
maximum the rows no longer line up with the requests: request *i* receives other requests' tokens (the
target still verifies them, so outputs stay right, but acceptance collapses).

The fix wraps ``SpecDecodeBaseProposer.propose``: on a parallel-drafting proposer asked for
0 < K < slots it proposes at the full depth (the forward pass is the same one: the slots were laid out
at start-up whatever K is) and keeps each request's first K tokens, and their draft probabilities.
Everything else (K = 0, K = max, sequential EAGLE, other drafters) passes through untouched.

What must hold: installed only after ``compat`` has checked the patch point (otherwise vLLM stays
unpatched and the engine core reports P-EAGLE as K ∈ {0, max} only, ``depth_fix_problem``); idempotent;
never raises out of ``install_depth_fix``. The engine core and the worker processes reach the same
verdict because they check the same vLLM installation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from controller.vllm import compat

log = logging.getLogger("vllm.speccontrol")

#: Set on the wrapper, so a second install (and ``installed``) can tell it is ours.
_MARK = "_speccontrol_depth_fix"


def depth_fix_problem() -> str | None:
    """None when the depth fix can be installed in this vLLM; otherwise why not (one line)."""
    bad = compat.problems(compat.P_EAGLE_POINTS, version=None)
    return "; ".join(bad) if bad else None


def partial_depth(proposer: Any, k: int) -> int | None:
    """The depth to propose at instead of ``k`` (all the proposer's slots), or None when ``k`` is safe
    as it is (K = 0 exits before the reshape, K = slots is the layout, sequential drafters reshape by
    the K they looped over)."""
    if not getattr(proposer, "parallel_drafting", False):
        return None
    slots = int(getattr(proposer, "extra_slots_per_request", 0) or 0)
    return slots if 0 < k < slots else None


def propose_at_depth(orig: Callable[..., Any], proposer: Any, k: int, *args: Any, **kwargs: Any) -> Any:
    """``orig(proposer, k, ...)``, with each request's draft its own first ``k`` tokens."""
    full = partial_depth(proposer, int(k))
    if full is None:
        return orig(proposer, k, *args, **kwargs)
    drafts = orig(proposer, full, *args, **kwargs)
    proposer.num_speculative_tokens = k  # as vLLM leaves it after a call at K
    probs = getattr(proposer, "_last_draft_probs", None)
    if probs is not None:
        proposer._last_draft_probs = _first(probs, k)
    return _first(drafts, k)


def _first(rows: Any, k: int) -> Any:
    """The first ``k`` columns of a (requests x slots [x vocab]) tensor, contiguous as vLLM's are."""
    cut = rows[:, :k]
    contiguous = getattr(cut, "contiguous", None)  # torch; numpy (the unit tests) has none
    return contiguous() if contiguous is not None else cut


def install_depth_fix() -> str | None:
    """Wrap ``SpecDecodeBaseProposer.propose`` (idempotent). None when it is in place; otherwise why
    not, logged once, with vLLM left unpatched. Never raises."""
    try:
        problem = depth_fix_problem()
        if problem is not None:
            log.error("speccontrol: P-EAGLE depth fix not installed (K in {0, max} only): %s", problem)
            return problem
        from vllm.v1.spec_decode.llm_base_proposer import (  # type: ignore[import-not-found]
            SpecDecodeBaseProposer,
        )

        orig = SpecDecodeBaseProposer.propose
        if getattr(orig, _MARK, False):
            return None

        def propose(self: Any, num_speculative_tokens: int, *args: Any, **kwargs: Any) -> Any:
            return propose_at_depth(orig, self, num_speculative_tokens, *args, **kwargs)

        setattr(propose, _MARK, True)
        propose.__wrapped__ = orig  # type: ignore[attr-defined]
        SpecDecodeBaseProposer.propose = propose
        log.info("speccontrol: P-EAGLE depth fix installed (every K aligned, pid %d)", os.getpid())
        return None
    except Exception as e:  # the engine serves on at K in {0, max}
        log.error("speccontrol: P-EAGLE depth fix not installed: %s: %s", type(e).__name__, e)
        return f"{type(e).__name__}: {e}"
