"""The physical bounds of one engine step, in one place for every reader of step durations.

The sidecar's telemetry (``controller.validation``, ``controller.observe``), the simulator's step logs
(``sim.steplog``) and its cost-model profiles (``sim.costmodel``) all hold a step to these bounds, so a
step one of them accepts is never refused by another (a profile faster than the sidecar's floor had
``sim replay`` and ``sim tune`` teach policies from steps no engine could report). Must hold:
``0 < MIN_STEP_S < MAX_STEP_S``; ``step_floor_s`` is the one formula for the shortest measured step.
"""

from __future__ import annotations

#: A step is at least a microsecond (below that, tokens per second are meaningless: 5e-324 s would
#: give an infinite goodput) and at most an hour (beyond that the learner's squared costs overflow).
MIN_STEP_S = 1e-6
MAX_STEP_S = 3600.0
#: And a measured step lasts at least this long per request it scheduled: 50 ns, i.e. at most 2e7
#: request-steps per second in one engine. Without it a step of 64 requests that "lasted" 1 us passed,
#: a round goodput of ~2e8 tok/s (real engines: 1e3..1e5 tok/s), which the learners averaged in for a
#: long time. Real figures, per scheduled request and step: vLLM's engine core runs Python per request
#: on every step (scheduling, input preparation, output update: a few microseconds each; the controller
#: plugin's own hooks alone measured 2-4.4 us per request, ``sim/profiles/*.yaml``
#: ``plugin.*.per_request_s``); the GPU cost per batched token fitted on H100/H200 (``sim/profiles``,
#: 8B..120B models) is 8.6-92 us. 50 ns is 100x below ~5 us of host work and 170x below the fastest GPU
#: fit, so no real engine (a tiny model, the fastest card, any batch) is refused; a step of one request
#: is bounded by the 1 us above (CUDA-graph replay and vLLM's step loop alone take tens of microseconds).
#: One step's goodput is then at most (K + 1) x 2e7 tok/s.
MIN_STEP_S_PER_REQUEST = 5e-8


def step_floor_s(requests: int) -> float:
    """The shortest a measured step of ``requests`` scheduled requests may last."""
    return max(MIN_STEP_S, requests * MIN_STEP_S_PER_REQUEST)


__all__ = ["MAX_STEP_S", "MIN_STEP_S", "MIN_STEP_S_PER_REQUEST", "step_floor_s"]
