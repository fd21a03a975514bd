"""Memory sizing per replica: weights, KV bytes per token, and the KV room left on the GPUs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from sim.costmodel import Memory, Profile


@dataclass(frozen=True, slots=True)
class Sizing:
    name: str
    hardware: str
    weights_gb: float
    draft_weights_gb: float
    kv_bytes_per_token: float
    kv_room_gb: float
    kv_tokens: int
    note: str

    @property
    def fits(self) -> bool:
        return self.kv_room_gb > 0

    @property
    def sequences_at_4k(self) -> int:
        """Sequences of 4,096 tokens the KV room holds (what 'useful room' means here)."""
        return self.kv_tokens // 4096


def _sizing(name: str, hardware: str, mem: Memory, note: str) -> Sizing:
    room = mem.kv_room_gb()
    return Sizing(
        name,
        hardware,
        mem.weights_gb,
        mem.draft_weights_gb,
        mem.kv_bytes_per_token,
        room,
        mem.kv_capacity_tokens(),
        note,
    )


def profile_sizing(p: Profile) -> Sizing:
    return _sizing(p.name, p.hardware, p.memory, "profile")


#: Llama-3.3-70B in BF16 (70.6e9 params x 2 bytes) — the question "does it fit one H200?".
LLAMA_70B_BF16_H200 = Memory(
    gpu="H200 SXM 141GB",
    gpu_memory_gb=141,
    num_gpus=1,
    weights_gb=141.2,
    draft_weights_gb=2.6,
    kv_bytes_per_token=327680,
    reserve_gb=4,
    gpu_memory_utilization=0.9,
)
LLAMA_70B_BF16_2XH200 = replace(LLAMA_70B_BF16_H200, num_gpus=2)


def extra_sizings() -> list[Sizing]:
    return [
        _sizing(
            "llama-3.3-70b-bf16",
            "1x H200 141GB",
            LLAMA_70B_BF16_H200,
            "unquantised: weights alone exceed 90% of one H200",
        ),
        _sizing("llama-3.3-70b-bf16", "2x H200 141GB, TP2", LLAMA_70B_BF16_2XH200, "unquantised, TP2"),
    ]
