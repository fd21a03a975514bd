"""Trace replay: spectrace traces, traffic generators, cost-model profiles, engine models, the replay
engine driving the same ControlLoop as the sidecar, hindsight oracles and reports (see docs/simulator.md).
"""

from sim.costmodel import Profile, load_profile
from sim.engines import ENGINES, EngineModel
from sim.replay import Replayer
from sim.run import RunResult
from sim.trace import Trace, TraceError, read_trace, validate_trace, write_trace
from sim.traffic import SCENARIOS, generate
from sim.vectorised import replay_static

__all__ = [
    "ENGINES",
    "SCENARIOS",
    "EngineModel",
    "Profile",
    "Replayer",
    "RunResult",
    "Trace",
    "TraceError",
    "generate",
    "load_profile",
    "read_trace",
    "replay_static",
    "validate_trace",
    "write_trace",
]
