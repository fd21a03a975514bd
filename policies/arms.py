"""Arms: what the controller can switch between, a drafting method and a draft length K."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Method(StrEnum):
    EAGLE3 = "eagle3"
    P_EAGLE = "p_eagle"
    NGRAM = "ngram"
    OFF = "off"


#: Stable small-integer codes so per-request columns can be numpy int8 arrays.
METHOD_CODES: dict[Method, int] = {m: i for i, m in enumerate(Method)}
METHODS_BY_CODE: tuple[Method, ...] = tuple(Method)


#: The longest draft an arm may name: vLLM's own bound on num_speculative_tokens is far below it, and
#: the wire protocol refuses an engine's max_k above it.
MAX_K = 64


@dataclass(frozen=True, order=True, slots=True)
class Arm:
    """A speculation configuration. ``off`` is the only method with K = 0 and always has K = 0."""

    method: Method
    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.method, Method):
            object.__setattr__(self, "method", Method(self.method))
        if isinstance(self.k, bool) or not isinstance(self.k, int):
            raise ValueError(f"k must be an integer, got {self.k!r}")
        if self.method is Method.OFF:
            if self.k != 0:
                raise ValueError(f"arm 'off' has k = 0, got k = {self.k}")
        elif self.k < 1:
            raise ValueError(f"arm '{self.method}' needs k >= 1 (use 'off' for no speculation), got {self.k}")
        elif self.k > MAX_K:
            raise ValueError(f"arm '{self.method}': k must be at most {MAX_K}, got {self.k}")

    @classmethod
    def parse(cls, text: str) -> Arm:
        """Parse ``"eagle3:3"``, ``"ngram:4"`` or ``"off"``."""
        s = str(text).strip()
        if s == Method.OFF.value or s == "off:0":
            return OFF
        method, sep, k = s.partition(":")
        if not sep:
            raise ValueError(f"arm {s!r}: expected 'method:k' (e.g. 'eagle3:3') or 'off'")
        try:
            m = Method(method)
        except ValueError:
            known = ", ".join(x.value for x in Method)
            raise ValueError(f"arm {s!r}: unknown method {method!r} (known: {known})") from None
        # digits only: int() also takes "1_0", "+3" and " 3"
        if not (k.isascii() and k.isdigit() and len(k) <= 3 and 1 <= int(k) <= MAX_K):
            raise ValueError(f"arm {s!r}: k must be an integer 1..{MAX_K}")
        return cls(m, int(k))

    @property
    def speculates(self) -> bool:
        return self.method is not Method.OFF

    def __str__(self) -> str:
        return "off" if self.method is Method.OFF else f"{self.method.value}:{self.k}"


OFF = Arm(Method.OFF, 0)
