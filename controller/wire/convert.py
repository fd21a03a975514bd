"""Conversions between the wire messages (controller.v1) and the pure values in ``policies``: arms,
the engine's Hello and directives. What must hold: ``x_from_pb(x_to_pb(v)) == v`` for every valid value,
and a message that names an unknown method or an impossible K raises ValueError (never a crash).

The per-step telemetry columns are ``controller.wire.codec``'s.
"""

from __future__ import annotations

from controller.v1 import controller_pb2 as pb
from policies.arms import Arm, Method
from policies.directive import Directive, KRange, PlanEntry, RequestRule
from policies.engine import EngineInfo, Granularity


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
        plugin_mode=plugin_mode,
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
