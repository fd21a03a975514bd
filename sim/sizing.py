"""Memory sizing per replica: weights, KV bytes per token, and the KV room left on the GPUs.

What must hold: the replay prices steps, not memory, so a trace is replayed on a profile only where its
longest request (prompt and output) fits the KV room (``kv_fit_problem``): vLLM cannot hold a longer one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sim.costmodel import Memory, Profile
from sim.trace import Trace


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


def kv_fit_problem(profile: Profile, trace: Trace) -> str | None:
    """Why no engine of ``profile`` can hold the longest request of ``trace`` (its prompt and output in
    the KV cache), or None. The replay priced such a request as if it fitted: a profile with room for 0
    tokens reported thousands of tokens/s."""
    if trace.n == 0:
        return None
    room = profile.memory.kv_capacity_tokens()
    longest = int((trace.prompt_tokens + trace.output_tokens).max())
    if longest <= room:
        return None
    return (
        f"KV room for {room} tokens; trace {trace.name!r} has a request of {longest} tokens (prompt and "
        "output): no engine with that room can hold it"
    )
