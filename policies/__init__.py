"""Pure decision logic shared by the sidecar, the engine plugin and the simulator.

No I/O, no asyncio, no gRPC: a policy is a deterministic function of its inputs and a seeded RNG.
"""

from policies.arms import OFF, Arm, Method
from policies.context import BatchBuckets, Context
from policies.directive import Directive, KRange, PlanEntry, RequestRule
from policies.engine import EngineInfo, Granularity
from policies.loop import ControlLoop, Totals
from policies.observation import NOT_SCORED, StepObservation
from policies.rules import FastLoop
from policies.spec import PolicyError, PolicySpec, parse_policy, render_policy, static_policy

__all__ = [
    "NOT_SCORED",
    "OFF",
    "Arm",
    "BatchBuckets",
    "Context",
    "ControlLoop",
    "Directive",
    "EngineInfo",
    "FastLoop",
    "Granularity",
    "KRange",
    "Method",
    "PlanEntry",
    "PolicyError",
    "PolicySpec",
    "RequestRule",
    "StepObservation",
    "Totals",
    "parse_policy",
    "render_policy",
    "static_policy",
]
