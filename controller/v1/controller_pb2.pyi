from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Granularity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRANULARITY_UNSPECIFIED: _ClassVar[Granularity]
    GRANULARITY_BATCH_STEP: _ClassVar[Granularity]
    GRANULARITY_REQUEST_K: _ClassVar[Granularity]
    GRANULARITY_REQUEST_METHOD: _ClassVar[Granularity]
GRANULARITY_UNSPECIFIED: Granularity
GRANULARITY_BATCH_STEP: Granularity
GRANULARITY_REQUEST_K: Granularity
GRANULARITY_REQUEST_METHOD: Granularity

class EngineMessage(_message.Message):
    __slots__ = ("hello", "reports")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    reports: StepReportBatch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., reports: _Optional[_Union[StepReportBatch, _Mapping]] = ...) -> None: ...

class Arm(_message.Message):
    __slots__ = ("method", "k")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    method: str
    k: int
    def __init__(self, method: _Optional[str] = ..., k: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("engine_id", "model", "max_k", "arms", "granularity", "max_batch_size", "engine_version", "counterfactual_methods", "p_eagle_partial_k_safe", "protocol_version", "instance_id", "observe_only", "plugin_mode")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNTERFACTUAL_METHODS_FIELD_NUMBER: _ClassVar[int]
    P_EAGLE_PARTIAL_K_SAFE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_MODE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: str
    max_k: int
    arms: _containers.RepeatedCompositeFieldContainer[Arm]
    granularity: Granularity
    max_batch_size: int
    engine_version: str
    counterfactual_methods: _containers.RepeatedScalarFieldContainer[str]
    p_eagle_partial_k_safe: bool
    protocol_version: int
    instance_id: str
    observe_only: bool
    plugin_mode: str
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[str] = ..., max_k: _Optional[int] = ..., arms: _Optional[_Iterable[_Union[Arm, _Mapping]]] = ..., granularity: _Optional[_Union[Granularity, str]] = ..., max_batch_size: _Optional[int] = ..., engine_version: _Optional[str] = ..., counterfactual_methods: _Optional[_Iterable[str]] = ..., p_eagle_partial_k_safe: _Optional[bool] = ..., protocol_version: _Optional[int] = ..., instance_id: _Optional[str] = ..., observe_only: _Optional[bool] = ..., plugin_mode: _Optional[str] = ...) -> None: ...

class StepReportBatch(_message.Message):
    __slots__ = ("sequence", "steps", "dropped_steps")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    steps: _containers.RepeatedCompositeFieldContainer[StepReport]
    dropped_steps: int
    def __init__(self, sequence: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepReport, _Mapping]]] = ..., dropped_steps: _Optional[int] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("time_s", "duration_s", "batch_size", "queue_length", "queue_wait_s", "scheduled_k", "requests", "directive_version", "columns", "prefill_tokens")
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_K_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    time_s: float
    duration_s: float
    batch_size: int
    queue_length: int
    queue_wait_s: float
    scheduled_k: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestStep]
    directive_version: int
    columns: RequestColumns
    prefill_tokens: int
    def __init__(self, time_s: _Optional[float] = ..., duration_s: _Optional[float] = ..., batch_size: _Optional[int] = ..., queue_length: _Optional[int] = ..., queue_wait_s: _Optional[float] = ..., scheduled_k: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestStep, _Mapping]]] = ..., directive_version: _Optional[int] = ..., columns: _Optional[_Union[RequestColumns, _Mapping]] = ..., prefill_tokens: _Optional[int] = ...) -> None: ...

class RequestColumns(_message.Message):
    __slots__ = ("request_id", "classes", "traffic_class", "method", "k", "drafted", "accepted", "counterfactual", "finished", "ngram_proposal", "packed", "count", "packed_ngram_proposal", "packed_finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COUNTERFACTUAL_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    NGRAM_PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PACKED_NGRAM_PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    PACKED_FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: _containers.RepeatedScalarFieldContainer[str]
    classes: _containers.RepeatedScalarFieldContainer[str]
    traffic_class: _containers.RepeatedScalarFieldContainer[int]
    method: _containers.RepeatedScalarFieldContainer[int]
    k: _containers.RepeatedScalarFieldContainer[int]
    drafted: _containers.RepeatedScalarFieldContainer[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    counterfactual: _containers.RepeatedCompositeFieldContainer[CounterfactualColumn]
    finished: _containers.RepeatedScalarFieldContainer[bool]
    ngram_proposal: _containers.RepeatedScalarFieldContainer[int]
    packed: bytes
    count: int
    packed_ngram_proposal: bool
    packed_finished: bool
    def __init__(self, request_id: _Optional[_Iterable[str]] = ..., classes: _Optional[_Iterable[str]] = ..., traffic_class: _Optional[_Iterable[int]] = ..., method: _Optional[_Iterable[int]] = ..., k: _Optional[_Iterable[int]] = ..., drafted: _Optional[_Iterable[int]] = ..., accepted: _Optional[_Iterable[int]] = ..., counterfactual: _Optional[_Iterable[_Union[CounterfactualColumn, _Mapping]]] = ..., finished: _Optional[_Iterable[bool]] = ..., ngram_proposal: _Optional[_Iterable[int]] = ..., packed: _Optional[bytes] = ..., count: _Optional[int] = ..., packed_ngram_proposal: _Optional[bool] = ..., packed_finished: _Optional[bool] = ...) -> None: ...

class CounterfactualColumn(_message.Message):
    __slots__ = ("method", "accepted")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    method: str
    accepted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, method: _Optional[str] = ..., accepted: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestStep(_message.Message):
    __slots__ = ("request_id", "traffic_class", "method", "k", "drafted", "accepted", "counterfactual_accepted", "finished", "ngram_proposal")
    class CounterfactualAcceptedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COUNTERFACTUAL_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    NGRAM_PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    traffic_class: str
    method: str
    k: int
    drafted: int
    accepted: int
    counterfactual_accepted: _containers.ScalarMap[str, int]
    finished: bool
    ngram_proposal: int
    def __init__(self, request_id: _Optional[str] = ..., traffic_class: _Optional[str] = ..., method: _Optional[str] = ..., k: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., counterfactual_accepted: _Optional[_Mapping[str, int]] = ..., finished: _Optional[bool] = ..., ngram_proposal: _Optional[int] = ...) -> None: ...

class KRange(_message.Message):
    __slots__ = ("bs_min", "bs_max", "k")
    BS_MIN_FIELD_NUMBER: _ClassVar[int]
    BS_MAX_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    bs_min: int
    bs_max: int
    k: int
    def __init__(self, bs_min: _Optional[int] = ..., bs_max: _Optional[int] = ..., k: _Optional[int] = ...) -> None: ...

class PlanEntry(_message.Message):
    __slots__ = ("traffic_class", "bs_min", "bs_max", "arm")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    BS_MIN_FIELD_NUMBER: _ClassVar[int]
    BS_MAX_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    bs_min: int
    bs_max: int
    arm: Arm
    def __init__(self, traffic_class: _Optional[str] = ..., bs_min: _Optional[int] = ..., bs_max: _Optional[int] = ..., arm: _Optional[_Union[Arm, _Mapping]] = ...) -> None: ...

class RequestRule(_message.Message):
    __slots__ = ("kind", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    params: _containers.ScalarMap[str, float]
    def __init__(self, kind: _Optional[str] = ..., params: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("version", "policy", "reason", "ttl_s", "issued_at_s", "k_table", "method", "plan", "rule", "acked_sequence", "protocol_version", "max_message_bytes", "max_steps_per_batch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_S_FIELD_NUMBER: _ClassVar[int]
    K_TABLE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    policy: str
    reason: str
    ttl_s: float
    issued_at_s: float
    k_table: _containers.RepeatedCompositeFieldContainer[KRange]
    method: str
    plan: _containers.RepeatedCompositeFieldContainer[PlanEntry]
    rule: RequestRule
    acked_sequence: int
    protocol_version: int
    max_message_bytes: int
    max_steps_per_batch: int
    def __init__(self, version: _Optional[int] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., ttl_s: _Optional[float] = ..., issued_at_s: _Optional[float] = ..., k_table: _Optional[_Iterable[_Union[KRange, _Mapping]]] = ..., method: _Optional[str] = ..., plan: _Optional[_Iterable[_Union[PlanEntry, _Mapping]]] = ..., rule: _Optional[_Union[RequestRule, _Mapping]] = ..., acked_sequence: _Optional[int] = ..., protocol_version: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_steps_per_batch: _Optional[int] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("yaml", "source", "engine_id")
    YAML_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    yaml: str
    source: str
    engine_id: str
    def __init__(self, yaml: _Optional[str] = ..., source: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class ListPoliciesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RollbackPolicyRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class PolicyInfo(_message.Message):
    __slots__ = ("name", "algorithm", "yaml", "revision", "source", "set_at_s", "engine_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    YAML_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SET_AT_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    algorithm: str
    yaml: str
    revision: int
    source: str
    set_at_s: float
    engine_id: str
    def __init__(self, name: _Optional[str] = ..., algorithm: _Optional[str] = ..., yaml: _Optional[str] = ..., revision: _Optional[int] = ..., source: _Optional[str] = ..., set_at_s: _Optional[float] = ..., engine_id: _Optional[str] = ...) -> None: ...

class ListPoliciesResponse(_message.Message):
    __slots__ = ("presets", "active", "history", "truncated")
    PRESETS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    presets: _containers.RepeatedCompositeFieldContainer[PolicyInfo]
    active: _containers.RepeatedCompositeFieldContainer[PolicyInfo]
    history: _containers.RepeatedCompositeFieldContainer[PolicyInfo]
    truncated: bool
    def __init__(self, presets: _Optional[_Iterable[_Union[PolicyInfo, _Mapping]]] = ..., active: _Optional[_Iterable[_Union[PolicyInfo, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[PolicyInfo, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArmChoice(_message.Message):
    __slots__ = ("context", "arm", "goodput_tok_s")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_TOK_S_FIELD_NUMBER: _ClassVar[int]
    context: str
    arm: Arm
    goodput_tok_s: float
    def __init__(self, context: _Optional[str] = ..., arm: _Optional[_Union[Arm, _Mapping]] = ..., goodput_tok_s: _Optional[float] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "model", "connected", "directive_version", "directive_age_s", "steps", "rejected", "acceptance_rate", "goodput_tok_s", "arms", "policy", "granularity", "available_arms", "max_k", "observe_only", "plugin_mode")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_TOK_S_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_ARMS_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_MODE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: str
    connected: bool
    directive_version: int
    directive_age_s: float
    steps: int
    rejected: int
    acceptance_rate: float
    goodput_tok_s: float
    arms: _containers.RepeatedCompositeFieldContainer[ArmChoice]
    policy: str
    granularity: Granularity
    available_arms: _containers.RepeatedCompositeFieldContainer[Arm]
    max_k: int
    observe_only: bool
    plugin_mode: str
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[str] = ..., connected: _Optional[bool] = ..., directive_version: _Optional[int] = ..., directive_age_s: _Optional[float] = ..., steps: _Optional[int] = ..., rejected: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., goodput_tok_s: _Optional[float] = ..., arms: _Optional[_Iterable[_Union[ArmChoice, _Mapping]]] = ..., policy: _Optional[str] = ..., granularity: _Optional[_Union[Granularity, str]] = ..., available_arms: _Optional[_Iterable[_Union[Arm, _Mapping]]] = ..., max_k: _Optional[int] = ..., observe_only: _Optional[bool] = ..., plugin_mode: _Optional[str] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("version", "uptime_s", "policy", "engines", "snapshot_path", "last_snapshot_s", "engines_total", "engines_truncated", "fleet")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_PATH_FIELD_NUMBER: _ClassVar[int]
    LAST_SNAPSHOT_S_FIELD_NUMBER: _ClassVar[int]
    ENGINES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENGINES_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    policy: PolicyInfo
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    snapshot_path: str
    last_snapshot_s: float
    engines_total: int
    engines_truncated: bool
    fleet: FleetLinkStatus
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., policy: _Optional[_Union[PolicyInfo, _Mapping]] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., snapshot_path: _Optional[str] = ..., last_snapshot_s: _Optional[float] = ..., engines_total: _Optional[int] = ..., engines_truncated: _Optional[bool] = ..., fleet: _Optional[_Union[FleetLinkStatus, _Mapping]] = ...) -> None: ...

class FleetLinkStatus(_message.Message):
    __slots__ = ("fleet", "node_id", "broker", "connected", "policy_version", "policy_cleared")
    FLEET_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_CLEARED_FIELD_NUMBER: _ClassVar[int]
    fleet: str
    node_id: str
    broker: str
    connected: bool
    policy_version: int
    policy_cleared: bool
    def __init__(self, fleet: _Optional[str] = ..., node_id: _Optional[str] = ..., broker: _Optional[str] = ..., connected: _Optional[bool] = ..., policy_version: _Optional[int] = ..., policy_cleared: _Optional[bool] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ("offset", "limit", "after_engine_id")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    AFTER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    offset: int
    limit: int
    after_engine_id: str
    def __init__(self, offset: _Optional[int] = ..., limit: _Optional[int] = ..., after_engine_id: _Optional[str] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines", "total", "next_offset")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    total: int
    next_offset: int
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., total: _Optional[int] = ..., next_offset: _Optional[int] = ...) -> None: ...

class WatchDecisionsRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("engine_id", "directive", "arms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    directive: Directive
    arms: _containers.RepeatedCompositeFieldContainer[ArmChoice]
    def __init__(self, engine_id: _Optional[str] = ..., directive: _Optional[_Union[Directive, _Mapping]] = ..., arms: _Optional[_Iterable[_Union[ArmChoice, _Mapping]]] = ...) -> None: ...
