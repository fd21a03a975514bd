"""Reward: goodput, emitted tokens per second of engine time.

Never acceptance alone: acceptance can stay at 0.9 from batch 1 to 32 while the step cost of
verifying drafts grows until speculating loses. Goodput prices that in through the measured step time.
"""

from __future__ import annotations

import numpy as np

from policies.observation import StepObservation


def step_goodput(obs: StepObservation) -> float:
    """The step's goodput in tokens per second."""
    if obs.duration_s <= 0:
        return 0.0
    return obs.emitted / obs.duration_s


def request_goodput(obs: StepObservation) -> np.ndarray:
    """Per-request goodput, scaled to the whole batch.

    Row i gets ``(accepted_i + 1) * batch_size / duration``: the goodput the engine would reach at this
    batch size and step time if every request behaved like request i. Averaging rows of one traffic
    class therefore estimates that class's goodput at this batch size without the other classes'
    acceptance leaking in.
    """
    if obs.duration_s <= 0 or obs.n == 0:
        return np.zeros(obs.n)
    return (obs.accepted.astype(np.float64) + 1.0) * (max(obs.batch_size, obs.n) / obs.duration_s)
