"""GPU and API prices, read from ``sim/data/prices.yaml`` (dated data, never constants in code)."""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True, slots=True)
class Price:
    usd: float
    source: str
    assumption: bool
    note: str = ""


@dataclass(frozen=True, slots=True)
class Prices:
    read_on: str | None
    recorded_on: str
    gpu_hour: dict[str, Price]
    api_per_1m_output: dict[str, Price]

    def gpu_cost_per_1m(self, key: str, num_gpus: int, tokens_per_s: float) -> float:
        """USD per 1M output tokens for a replica of ``num_gpus`` at ``tokens_per_s``."""
        if tokens_per_s <= 0 or key not in self.gpu_hour:
            return float("nan")
        return self.gpu_hour[key].usd * num_gpus / 3600.0 / tokens_per_s * 1e6


def _prices(d: Any, where: str) -> dict[str, Price]:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping")
    out: dict[str, Price] = {}
    for k, v in d.items():
        if not isinstance(v, dict) or not isinstance(v.get("usd"), int | float):
            raise ValueError(f"{where}.{k}.usd: expected a number")
        out[str(k)] = Price(
            float(v["usd"]), str(v.get("source", "")), bool(v.get("assumption", True)), str(v.get("note", ""))
        )
    return out


def load_prices(path: str | Path | None = None) -> Prices:
    p = Path(path) if path else Path(str(importlib.resources.files("sim") / "data" / "prices.yaml"))
    d = yaml.safe_load(p.read_text(encoding="utf-8"))
    if not isinstance(d, dict):
        raise ValueError(f"{p}: expected a mapping")
    return Prices(
        read_on=None if d.get("read_on") is None else str(d["read_on"]),
        recorded_on=str(d.get("recorded_on", "")),
        gpu_hour=_prices(d.get("gpu_hour_usd"), f"{p}: gpu_hour_usd"),
        api_per_1m_output=_prices(
            d.get("api_usd_per_1m_output_tokens"), f"{p}: api_usd_per_1m_output_tokens"
        ),
    )
