"""Stand-ins for vLLM's parts in the plugin's unit tests (the real ones run in the e2e tests)."""

from __future__ import annotations

from typing import Any


class PeerGroup:
    """vLLM's tensor-parallel group as ``controller.vllm.ranks`` uses it, seen from a rank with one peer
    whose failure is ``peer_failed``: ``all_reduce`` adds the peer's flag to this rank's and records
    this rank's (torch tensors; ``raises``: the collective itself fails)."""

    world_size = 2

    def __init__(self, peer_failed: bool = False, *, raises: bool = False) -> None:
        self.peer_failed, self.raises = peer_failed, raises
        self.flags: list[float] = []

    def all_reduce(self, t: Any) -> Any:
        self.flags.append(float(t.item()))
        if self.raises:
            raise RuntimeError("the collective failed (test)")
        return t + float(self.peer_failed)
