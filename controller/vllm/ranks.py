"""Tensor parallelism: the drafts every rank verifies must be the same.

Each rank's worker merges n-gram drafts into EAGLE's for itself (V1: ``worker.py``; V2: ``v2.py``),
from the same scheduler output and the same sampled tokens, so the ranks reach the same drafts. They
must: ranks that verify different drafts feed different tokens into one sharded forward, which
corrupts the output. A merge that raises is switched off in its own rank, and a failure can hit one
rank only (a device allocation), so on every step with n-gram rows the ranks add up their failures
and every rank hands on EAGLE's drafts once any rank failed: one switches off, so all do.

What must hold: ``agree`` is called on the same steps on every rank (the caller calls it on the steps
with n-gram rows, which come with the scheduler output, the same on every rank), or the ranks'
collectives no longer pair up; a single rank joins none. No host read where the drafts are a tensor.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vllm.speccontrol")


def tensor_parallel_group(owner: Any) -> Any:
    """vLLM's tensor-parallel group when it has more than one rank (else None), looked up once per
    ``owner`` (the model runner or the speculator) and kept in its ``__dict__``."""
    group = owner.__dict__.get("_speccontrol_tp", 0)
    if group == 0:
        try:
            from vllm.distributed import get_tp_group  # type: ignore[import-not-found]

            group = get_tp_group()
        except Exception:  # no distributed state (an owner built outside an engine)
            group = None
        if group is not None and int(getattr(group, "world_size", 1)) <= 1:
            group = None
        owner._speccontrol_tp = group
    return group


def agree(group: Any, merged: Any, drafts: Any, *, failed: bool, device: Any) -> Any:
    """The drafts to hand on: ``merged``, unless a rank of ``group`` failed (this one: ``failed``), in
    which case EAGLE's ``drafts``. The failures are summed by one all-reduce of one float on the
    device, and read on the host only where the runner's drafts are host rows."""
    import torch  # type: ignore[import-not-found]

    try:
        failures = group.all_reduce(torch.full((1,), float(failed), dtype=torch.float32, device=device))
    except Exception:
        log.exception(
            "speccontrol: the tensor-parallel ranks could not agree on the drafts; EAGLE's pass through"
        )
        return drafts
    if not torch.is_tensor(drafts):
        return drafts if float(failures.item()) > 0 else merged
    if merged is drafts:
        return drafts
    return torch.where(failures[0] > 0, drafts, merged)
