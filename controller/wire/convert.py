"""Conversions between the wire messages (controller.v1) and the pure values in ``policies``: arms,
the engine's Hello and directives. What must hold: ``x_from_pb(x_to_pb(v)) == v`` for every valid value,
and a message that names an unknown method or an impossible K raises ValueError (never a crash).

``directive_for_engine`` is what an engine takes from its sidecar: ``directive_from_pb`` plus every check
the engine's own code relies on (a known rule with its parameters in range, K within the arms' bound,
tables no larger than a sidecar makes, a version its reports may carry back), so that a directive it
accepts can never fail or stall the engine's step nor get its reports refused, and one it refuses
raises ValueError naming the field (the engine keeps what it had).

The per-step telemetry columns are ``controller.wire.codec``'s.
"""

from __future__ import annotations

import math
from collections import Counter

from controller.v1 import controller_pb2 as pb
from controller.wire.codec import MAX_SEQUENCE
from controller.wire.names import MAX_PLUGIN_MODE, escape_text
from policies.arms import MAX_K, Arm, Method
from policies.directive import Directive, KRange, PlanEntry, RequestRule
from policies.engine import EngineInfo, Granularity
from policies.rules import validate_rule

#: The most K ranges and plan entries an engine takes in one directive, and plan entries for one traffic
#: class. A sidecar makes one K range per batch bucket (a policy has at most 33) and a plan entry per
#: bucket for "*" and for each class whose arm differs (at most 256 classes per engine): 33 and 33 x 257.
#: Twice that leaves room; far more only costs the engine's step (it looks arms up per class and batch
#: size), and a 4 MiB directive held half a million ranges, a minute of the engine's thread to tabulate.
MAX_K_RANGES = 64
MAX_PLAN_PER_CLASS = 64
MAX_PLAN_ENTRIES = 64 * 257


def arm_to_pb(arm: Arm) -> pb.Arm:
    return pb.Arm(method=arm.method.value, k=arm.k)


def arm_from_pb(msg: pb.Arm) -> Arm:
    """Raises ValueError for an unknown method or an impossible K."""
    return Arm(Method(msg.method), int(msg.k))


def engine_info_from_hello(h: pb.Hello) -> EngineInfo:
    """Raises ValueError when the Hello is unusable (the caller answers INVALID_ARGUMENT)."""
    return EngineInfo(
        engine_id=h.engine_id,
        model=h.model,
        max_k=int(h.max_k),
        arms=tuple(arm_from_pb(a) for a in h.arms),
        granularity=Granularity(h.granularity) if h.granularity else Granularity.BATCH_STEP,
        max_batch_size=int(h.max_batch_size) or 256,
        counterfactual_methods=tuple(Method(m) for m in h.counterfactual_methods),
        p_eagle_partial_k_safe=bool(h.p_eagle_partial_k_safe),
    )


def hello_from_engine_info(e: EngineInfo, *, engine_version: str = "", plugin_mode: str = "") -> pb.Hello:
    """The Hello an engine sends. ``plugin_mode`` goes escaped and cut to what the sidecar takes: the
    plugin's names every vLLM patch point that no longer matches, with the exception's text, and one
    too long (or holding a line break) had the whole Hello refused."""
    return pb.Hello(
        engine_id=e.engine_id,
        model=e.model,
        max_k=e.max_k,
        arms=[arm_to_pb(a) for a in e.arms],
        granularity=f"GRANULARITY_{e.granularity.name}",
        max_batch_size=e.max_batch_size,
        engine_version=engine_version,
        counterfactual_methods=[m.value for m in e.counterfactual_methods],
        p_eagle_partial_k_safe=e.p_eagle_partial_k_safe,
        protocol_version=1,
        plugin_mode=_shown(plugin_mode, MAX_PLUGIN_MODE),
    )


def directive_to_pb(d: Directive) -> pb.Directive:
    return pb.Directive(
        version=d.version,
        policy=d.policy,
        reason=d.reason,
        ttl_s=d.ttl_s,
        issued_at_s=d.issued_at_s,
        k_table=[pb.KRange(bs_min=r.bs_min, bs_max=r.bs_max, k=r.k) for r in d.k_table],
        method=d.method.value,
        plan=[
            pb.PlanEntry(
                traffic_class=e.traffic_class, bs_min=e.bs_min, bs_max=e.bs_max, arm=arm_to_pb(e.arm)
            )
            for e in d.plan
        ],
        rule=pb.RequestRule(kind=d.rule.kind, params=dict(d.rule.params)),
    )


def directive_from_pb(m: pb.Directive) -> Directive:
    return Directive(
        version=int(m.version),
        policy=m.policy,
        reason=m.reason,
        ttl_s=m.ttl_s,
        issued_at_s=m.issued_at_s,
        k_table=tuple(KRange(int(r.bs_min), int(r.bs_max), int(r.k)) for r in m.k_table),
        method=Method(m.method) if m.method else Method.OFF,
        plan=tuple(
            PlanEntry(e.traffic_class, int(e.bs_min), int(e.bs_max), arm_from_pb(e.arm)) for e in m.plan
        ),
        rule=RequestRule(m.rule.kind or "none", dict(m.rule.params)),
    )


def directive_for_engine(m: pb.Directive) -> Directive:
    """``m`` as an engine applies it: ``directive_from_pb``, with the rule's parameters resolved (its
    defaults filled in, ``policies.rules.validate_rule``). Raises ValueError naming the field when the
    engine cannot apply it: version 0 (the engine's own safe default) or one beyond ``MAX_SEQUENCE`` (the
    engine reports the version in force with every step, and the sidecar refuses a report carrying
    such a one), a TTL that is not a number, more
    K ranges or plan entries than ``MAX_K_RANGES`` / ``MAX_PLAN_ENTRIES`` (``MAX_PLAN_PER_CLASS`` for one
    class), a K beyond ``policies.arms.MAX_K``, an unknown method or rule, a rule parameter it does not
    have or one outside its type or range. The sizes are checked before anything is converted. K
    above the engine's own ``max_k`` is not refused: engines clamp it (``Directive.k_for_batch``)."""
    if m.version == 0:
        raise ValueError("version: 0 is the engine's own safe default; a sidecar numbers from 1")
    if m.version > MAX_SEQUENCE:  # every step run under it reports it, and the sidecar refuses those
        raise ValueError(f"version: {m.version} is beyond {MAX_SEQUENCE} (a sidecar's count stops there)")
    if math.isnan(m.ttl_s):
        raise ValueError("ttl_s: not a number")
    if len(m.k_table) > MAX_K_RANGES:
        raise ValueError(f"k_table: {len(m.k_table)} ranges, more than the {MAX_K_RANGES} an engine takes")
    if len(m.plan) > MAX_PLAN_ENTRIES:
        raise ValueError(f"plan: {len(m.plan)} entries, more than the {MAX_PLAN_ENTRIES} an engine takes")
    if m.plan:
        cls, n = Counter(e.traffic_class for e in m.plan).most_common(1)[0]
        if n > MAX_PLAN_PER_CLASS:
            raise ValueError(
                f"plan: {n} entries for traffic class '{_shown(cls)}', more than the {MAX_PLAN_PER_CLASS} "
                "an engine takes"
            )
    for i, r in enumerate(m.k_table):
        if r.k > MAX_K:
            raise ValueError(f"k_table[{i}].k: at most {MAX_K}, got {r.k}")
    if m.method:
        _method(m.method, "method")
    for i, e in enumerate(m.plan):
        _method(e.arm.method, f"plan[{i}].arm.method")
        try:
            arm_from_pb(e.arm)
        except ValueError as err:
            raise ValueError(f"plan[{i}].arm: {err}") from None
    try:
        rule = validate_rule(_shown(m.rule.kind or "none"), dict(m.rule.params), "rule")
    except ValueError as err:  # (it may quote a parameter's name, which is the sidecar's text)
        raise ValueError(_shown(str(err), 200)) from None
    d = directive_from_pb(m)
    return Directive(d.version, d.policy, d.reason, d.ttl_s, d.issued_at_s, d.k_table, d.method, d.plan, rule)


def _method(text: str, where: str) -> Method:
    try:
        return Method(text)
    except ValueError:
        known = ", ".join(x.value for x in Method)
        raise ValueError(f"{where}: unknown method '{_shown(text)}' (known: {known})") from None


def _shown(text: str, limit: int = 40) -> str:
    """A sidecar's text as an error quotes it: escaped (no control characters reach a log line) and cut."""
    out = escape_text(text)
    return out if len(out) <= limit else f"{out[: limit - 3]}..."
