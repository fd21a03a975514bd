"""Typed, range-checked parameters for algorithms and rules (validated at the edge)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as an error message quotes it: its repr, or, when longer than ``limit``, an integer's
    digit count (its first 60 digits read like a number 1e59) or the repr's start with an ellipsis."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, int) and not isinstance(value, bool):
        return f"an integer of {len(str(abs(value)))} digits"
    return text[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class Param:
    """One tunable parameter: its type, default, inclusive bounds and what it means."""

    default: float | int | str
    doc: str
    lo: float | None = None
    hi: float | None = None

    def check(self, name: str, value: Any) -> float | int | str:
        """Return the value coerced to the parameter's type, or raise ValueError naming ``name``."""
        if isinstance(self.default, str):
            if not isinstance(value, str):
                raise ValueError(f"{name}: expected a string, got {type(value).__name__}")
            return str(value)
        given = value  # as written: a bound's message quotes 1e+308, not its 309 digits as an integer
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}: expected a number, got {type(value).__name__} {shown(value)}")
        if isinstance(self.default, int) and not isinstance(self.default, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(f"{name}: expected an integer, got {shown(value)}")
            value = int(value)
        else:
            if isinstance(value, int) and abs(value) > 1e308:  # float() would raise OverflowError
                raise ValueError(f"{name}: must be finite, got {shown(value)}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{name}: must be finite, got {shown(value)}")
        if self.lo is not None and value < self.lo:
            raise ValueError(f"{name}: must be >= {self.lo}, got {shown(given)}")
        if self.hi is not None and value > self.hi:
            raise ValueError(f"{name}: must be <= {self.hi}, got {shown(given)}")
        return int(value) if isinstance(value, int) else float(value)


def resolve(schema: Mapping[str, Param], given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Defaults overlaid with ``given``; unknown names and bad values raise ValueError."""
    unknown = sorted(set(given) - set(schema))
    if unknown:
        known = ", ".join(sorted(schema)) or "none"
        raise ValueError(f"{where}.{unknown[0]}: unknown parameter (known: {known})")
    out: dict[str, Any] = {k: p.default for k, p in schema.items()}
    for k, v in given.items():
        out[k] = schema[k].check(f"{where}.{k}", v)
    return out
