"""A simulated engine that attaches to the sidecar over the real gRPC stream (the demo's engines)."""

from controller.embedded.core import EngineCore, EngineSettings, EngineTotals
from controller.embedded.cost import StepCost
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.traffic import Phase, Schedule, Traffic, TrafficClass, demo_traffic

__all__ = [
    "EmbeddedEngine",
    "EngineCore",
    "EngineSettings",
    "EngineTotals",
    "LinkSettings",
    "Phase",
    "Schedule",
    "StepCost",
    "Traffic",
    "TrafficClass",
    "demo_traffic",
]
