"""A simulated engine that attaches to the sidecar over the real gRPC stream (the demo's engines)."""

from controller.embedded.core import EngineCore, EngineSettings, EngineTotals
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import Phase, Schedule, Workload, build_workload, demo_workload

__all__ = [
    "EmbeddedEngine",
    "EngineCore",
    "EngineSettings",
    "EngineTotals",
    "LinkSettings",
    "Phase",
    "Schedule",
    "Workload",
    "build_workload",
    "demo_workload",
]
