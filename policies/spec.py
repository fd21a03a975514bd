"""The policy document (``apiVersion: speccontrol/v1``, ``kind: Policy``) as an immutable value.

Parsing never executes anything (safe YAML only), caps the document size and nesting, and reports
errors as ``FILE:LINE: FIELD: what is wrong``.

    apiVersion: speccontrol/v1
    kind: Policy
    metadata: {name: default, description: ...}
    spec:
      algorithm: {name: discounted_thompson, params: {discount: 0.9}}
      arms: [eagle3:2, eagle3:4, ngram:4, off]    # optional: default every arm the engine offers
      contexts: {batch_buckets: [1, 4, 8, 16, 32], per_class: true}
      decision_interval_s: 1.0
      directive_ttl_s: 10.0
      min_dwell_s: 2.0
      rule: {kind: ngram_margin, params: {margin: 0.5}}
      switch_margin: 0.02                       # hysteresis on estimated goodput
      drift: {detector: page_hinkley, delta: 0.05, threshold: 30}
      slo: {p99_tpot_ms: 50}
      exploration: {max_share_at_high_load: 0.05, high_load_batch: 32}
      seed: 0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

import numpy as np
import yaml

from policies import yamldoc
from policies.algorithms import REGISTRY
from policies.arms import Arm
from policies.context import DEFAULT_BUCKET_BOUNDS, BatchBuckets
from policies.directive import RequestRule
from policies.drift import DETECTORS, DRIFT_FIELDS
from policies.guards import EXPLORATION_FIELDS, SLO_FIELDS
from policies.params import Param, resolve
from policies.rules import validate_rule
from policies.text import name_problem

API_VERSION = "speccontrol/v1"
KIND = "Policy"
MAX_DOCUMENT_BYTES = 64 * 1024
MAX_DEPTH = 12
MAX_ARMS = 64
MAX_NODES = 20_000


class PolicyError(ValueError):
    """A policy document is invalid; ``str()`` reads ``source:line: field: message``."""

    def __init__(
        self, message: str, *, source: str = "<policy>", line: int | None = None, field: str = ""
    ) -> None:
        self.message, self.source, self.line, self.field = message, source, line, field
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {field}: {message}" if field else f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    algorithm: str
    params: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    #: Arms the policy may choose from; empty means every arm the engine advertises.
    arms: tuple[Arm, ...] = ()
    buckets: BatchBuckets = field(default_factory=BatchBuckets)
    #: Learn per traffic class where the engine can choose per request.
    per_class: bool = True
    decision_interval_s: float = 1.0
    directive_ttl_s: float = 10.0
    #: A context keeps its arm at least this long after a switch (stops flip-flopping at boundaries).
    min_dwell_s: float = 2.0
    rule: RequestRule = field(default_factory=RequestRule)
    seed: int = 0
    #: A context switches only to an arm whose estimated goodput beats the current one's by this share.
    switch_margin: float = 0.0
    #: ``spec.drift`` (policies.drift.DRIFT_FIELDS), ``spec.slo`` and ``spec.exploration``
    #: (policies.guards), each with every field resolved to its value or default.
    drift: Mapping[str, Any] = field(default_factory=lambda: _defaults(DRIFT_FIELDS))
    slo: Mapping[str, Any] = field(default_factory=lambda: _defaults(SLO_FIELDS))
    exploration: Mapping[str, Any] = field(default_factory=lambda: _defaults(EXPLORATION_FIELDS))
    #: The document it was parsed from, kept for ``policy get`` and snapshots.
    source_yaml: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("params", "drift", "slo", "exploration"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


def _defaults(schema: Mapping[str, Param]) -> dict[str, Any]:
    return {k: p.default for k, p in schema.items()}


#: The largest seed a policy (and every command line's ``--seed``) takes: numpy seeds from 32-bit words.
MAX_SEED = 2**32 - 1

_SPEC_FIELDS: dict[str, Param] = {
    "decision_interval_s": Param(1.0, "Seconds between slow-loop decisions.", 0.01, 3600.0),
    "directive_ttl_s": Param(10.0, "Engines fall back to their safe default after this.", 0.1, 86400.0),
    "min_dwell_s": Param(2.0, "Minimum time between two switches of one context.", 0.0, 3600.0),
    "seed": Param(0, "Seed of the policy's random generator.", 0, MAX_SEED),
    "switch_margin": Param(
        0.0, "Relative goodput margin a new arm must beat the current one's estimate by.", 0.0, 10.0
    ),
}
#: Sub-mappings of ``spec`` that are plain parameter sets.
_SECTIONS: dict[str, Mapping[str, Param]] = {
    "drift": DRIFT_FIELDS,
    "slo": SLO_FIELDS,
    "exploration": EXPLORATION_FIELDS,
}


class _Lines:
    """A document's lines (``yamldoc.Lines``) and its source, for errors at a field's line."""

    def __init__(self, source: str, lines: yamldoc.Lines) -> None:
        self.source, self._lines = source, lines

    def line(self, path: str) -> int | None:
        return self._lines.line(path)

    def error(self, path: str, message: str) -> PolicyError:
        return PolicyError(message, source=self.source, line=self.line(path), field=path)

    def text(self, path: str, value: Any) -> Any:
        """``value`` of a field that takes text: a plain ``1e3``, which YAML 1.2 (``yamldoc``) reads as
        a number and YAML 1.1 read as text, as written (a policy named ``1e3`` stays one)."""
        written = self._lines.yaml12_float_text(path)
        return written if written is not None and isinstance(value, float) else value


def _load(text: str, source: str, *, saved: bool = False) -> tuple[Any, _Lines]:
    if len(text.encode("utf-8", "replace")) > MAX_DOCUMENT_BYTES:
        raise PolicyError(f"document larger than {MAX_DOCUMENT_BYTES} bytes", source=source)
    try:
        data, lines = yamldoc.load(text, max_depth=MAX_DEPTH, max_nodes=MAX_NODES, saved=saved)
    except yamldoc.YamlProblem as e:
        raise PolicyError(e.message, source=source, line=e.line, field=e.path) from None
    if data is None:
        raise PolicyError("empty document", source=source, line=1)
    return data, _Lines(source, lines)


def _mapping(lines: _Lines, value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise lines.error(path, f"expected a mapping, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise lines.error(path, f"keys must be strings, got {k!r}")
    return value


def _saved_name(name: object) -> bool:
    """The name rule before 2026-12-06 (Unicode letters and digits too): a policy saved under it is
    restored, never discarded by an upgrade."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 128
        and name.replace("-", "").replace("_", "").replace(".", "").isalnum()
    )


def _unknown(lines: _Lines, m: Mapping[str, Any], path: str, known: set[str]) -> None:
    for k in m:
        if k not in known:
            p = f"{path}.{k}" if path else k
            raise lines.error(p, f"unknown field (known: {', '.join(sorted(known))})")


def _checked(lines: _Lines, path: str, fn: Callable[[], Any]) -> Any:
    """Run a validator; turn its ValueError into a PolicyError at the failing field's line."""
    try:
        return fn()
    except PolicyError:
        raise
    except ValueError as e:
        msg = str(e)
        # Validators name the field first ("spec.x.y: ..."): point at that field's line.
        head, sep, rest = msg.partition(": ")
        if sep and (head == path or head.startswith(path + ".") or head.startswith(path + "[")):
            raise lines.error(head, rest) from None
        raise lines.error(path, msg) from None


def _yaml11_off(value: Any) -> Any:
    # YAML 1.1 reads a bare `off` as false; in an arm position it can only mean the arm "off".
    return "off" if value is False else value


def parse_policy(text: str, *, source: str = "<policy>", saved: bool = False) -> PolicySpec:
    """Parse and validate a policy document. Raises PolicyError naming file, line and field.

    ``saved``: a document an earlier version accepted and saved (a snapshot): the rules added since
    for new documents are not applied to it, so an upgrade never discards what it restores."""
    data, lines = _load(text, source, saved=saved)
    root = _mapping(lines, data, "")
    _unknown(lines, root, "", {"apiVersion", "kind", "metadata", "spec"})
    if root.get("apiVersion") != API_VERSION:
        raise lines.error("apiVersion", f"must be {API_VERSION!r}, got {root.get('apiVersion')!r}")
    if root.get("kind") != KIND:
        raise lines.error("kind", f"must be {KIND!r}, got {root.get('kind')!r}")
    meta = _mapping(lines, root.get("metadata", {}), "metadata")
    _unknown(lines, meta, "metadata", {"name", "description", "labels"})
    raw_name = lines.text("metadata.name", meta.get("name"))
    problem = name_problem(raw_name)
    if problem is not None and not (saved and _saved_name(raw_name)):
        raise lines.error("metadata.name", problem)
    name = str(raw_name)  # a string: both rules refuse anything else
    description = lines.text("metadata.description", meta.get("description", ""))
    if not isinstance(description, str):
        raise lines.error("metadata.description", "expected a string")

    spec = _mapping(lines, root.get("spec"), "spec")
    _unknown(lines, spec, "spec", {"algorithm", "arms", "contexts", "rule", *_SPEC_FIELDS, *_SECTIONS})

    algo = _mapping(lines, spec.get("algorithm"), "spec.algorithm")
    _unknown(lines, algo, "spec.algorithm", {"name", "params"})
    algo_name = algo.get("name")
    if not isinstance(algo_name, str) or algo_name not in REGISTRY:
        raise lines.error(
            "spec.algorithm.name", f"unknown algorithm {algo_name!r} (known: {', '.join(sorted(REGISTRY))})"
        )
    learner = REGISTRY[algo_name]
    given = dict(_mapping(lines, algo.get("params") or {}, "spec.algorithm.params"))
    if "arm" in given:
        given["arm"] = _yaml11_off(given["arm"])
    params = _checked(
        lines, "spec.algorithm.params", lambda: resolve(learner.PARAMS, given, "spec.algorithm.params")
    )
    if algo_name == "static":
        arm_text = str(params["arm"])
        _checked(lines, "spec.algorithm.params.arm", lambda: Arm.parse(arm_text))
    # Learners check their own parameters (arms, schedules) when built: build one to find bad values.
    _checked(
        lines,
        "spec.algorithm.params",
        lambda: learner(arms=(), params=params, rng=np.random.default_rng(0)),
    )

    arms_raw = spec.get("arms", [])
    if not isinstance(arms_raw, list):
        raise lines.error("spec.arms", "expected a list of arms such as [eagle3:3, ngram:4, off]")
    if len(arms_raw) > MAX_ARMS:
        raise lines.error("spec.arms", f"at most {MAX_ARMS} arms")
    arms: list[Arm] = []
    for i, a in enumerate(arms_raw):
        p = f"spec.arms[{i}]"
        a = _yaml11_off(a)
        if not isinstance(a, str):
            raise lines.error(p, f"expected a string such as 'eagle3:3', got {a!r}")
        arm: Arm = _checked(lines, p, partial(Arm.parse, a))
        if arm in arms:
            raise lines.error(p, f"duplicate arm {arm}")
        arms.append(arm)

    ctx = _mapping(lines, spec.get("contexts", {}), "spec.contexts")
    _unknown(lines, ctx, "spec.contexts", {"batch_buckets", "per_class"})
    bounds = ctx.get("batch_buckets", list(DEFAULT_BUCKET_BOUNDS))
    if not isinstance(bounds, list) or len(bounds) > 32:
        raise lines.error(
            "spec.contexts.batch_buckets", "expected a list of at most 32 increasing upper bounds"
        )
    buckets = _checked(lines, "spec.contexts.batch_buckets", lambda: BatchBuckets(tuple(bounds)))
    per_class = ctx.get("per_class", True)
    if not isinstance(per_class, bool):
        raise lines.error("spec.contexts.per_class", "expected true or false")

    rule_raw = _mapping(lines, spec.get("rule", {"kind": "none"}), "spec.rule")
    _unknown(lines, rule_raw, "spec.rule", {"kind", "params"})
    rule_params = _mapping(lines, rule_raw.get("params") or {}, "spec.rule.params")
    rule = _checked(
        lines, "spec.rule", lambda: validate_rule(str(rule_raw.get("kind", "none")), rule_params, "spec.rule")
    )

    sections: dict[str, dict[str, Any]] = {}
    for sec, schema in _SECTIONS.items():
        path = f"spec.{sec}"
        given_sec = _mapping(lines, spec.get(sec) or {}, path)
        sections[sec] = _checked(lines, path, partial(resolve, schema, given_sec, path))
    if sections["drift"]["detector"] not in DETECTORS:
        raise lines.error("spec.drift.detector", f"unknown detector (known: {', '.join(DETECTORS)})")
    slo = sections["slo"]
    if slo["min_samples"] > slo["window"] and not saved:  # (the guard acts at `window` then)
        # The TPOT guard keeps at most `window` request-steps per bucket and acts only once it holds
        # `min_samples`: with more samples needed than it keeps, it would never act.
        raise lines.error(
            "spec.slo.min_samples",
            f"must be at most spec.slo.window ({slo['window']}), got {slo['min_samples']}: "
            "the TPOT guard keeps only `window` request-steps per bucket, so it would never act",
        )

    scalars = _checked(
        lines, "spec", lambda: resolve(_SPEC_FIELDS, {k: spec[k] for k in _SPEC_FIELDS if k in spec}, "spec")
    )
    return PolicySpec(
        name=name,
        description=description,
        algorithm=algo_name,
        params=params,
        arms=tuple(arms),
        buckets=buckets,
        per_class=per_class,
        rule=rule,
        source_yaml=text,
        drift=sections["drift"],
        slo=sections["slo"],
        exploration=sections["exploration"],
        **scalars,
    )


def render_policy(spec: PolicySpec) -> str:
    """A canonical YAML document for ``spec`` (used when a policy was built in code)."""
    doc: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": spec.name, **({"description": spec.description} if spec.description else {})},
        "spec": {
            "algorithm": {"name": spec.algorithm, "params": dict(spec.params)},
            **({"arms": [str(a) for a in spec.arms]} if spec.arms else {}),
            "contexts": {"batch_buckets": list(spec.buckets.bounds), "per_class": spec.per_class},
            "decision_interval_s": spec.decision_interval_s,
            "directive_ttl_s": spec.directive_ttl_s,
            "min_dwell_s": spec.min_dwell_s,
            "rule": {"kind": spec.rule.kind, "params": dict(spec.rule.params)},
            "seed": spec.seed,
            "switch_margin": spec.switch_margin,
            "drift": dict(spec.drift),
            "slo": dict(spec.slo),
            "exploration": dict(spec.exploration),
        },
    }
    # yamldoc's Dumper: a string that parse_policy's loader would read as a number is quoted
    return yaml.dump(doc, Dumper=yamldoc.Dumper, sort_keys=False)


def static_policy(arm: Arm | str, **overrides: Any) -> PolicySpec:
    """A static policy for one arm (baselines in the demo and the simulator)."""
    a = Arm.parse(arm) if isinstance(arm, str) else arm
    base = PolicySpec(
        name=f"static-{str(a).replace(':', '-')}", algorithm="static", params={"arm": str(a)}, **overrides
    )
    return parse_policy(render_policy(base), source=f"<static {a}>")
