from gyre.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReportEngineFailureRequest(_message.Message):
    __slots__ = ("cell_id", "target", "reason")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    target: str
    reason: str
    def __init__(self, cell_id: _Optional[str] = ..., target: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportEngineFailureResponse(_message.Message):
    __slots__ = ("dead", "executions")
    DEAD_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    dead: bool
    executions: int
    def __init__(self, dead: _Optional[bool] = ..., executions: _Optional[int] = ...) -> None: ...

class AcquireExecutionRequest(_message.Message):
    __slots__ = ("harness_id", "wait_s", "idempotency_key")
    HARNESS_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    harness_id: str
    wait_s: float
    idempotency_key: str
    def __init__(self, harness_id: _Optional[str] = ..., wait_s: _Optional[float] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class Execution(_message.Message):
    __slots__ = ("execution_id", "token", "task_id", "group_id", "burst_id", "policy_version", "task_json", "openai_base_url", "router_target", "heartbeat_interval_s", "heartbeat_deadline_s", "model")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BURST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    OPENAI_BASE_URL_FIELD_NUMBER: _ClassVar[int]
    ROUTER_TARGET_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    token: str
    task_id: str
    group_id: str
    burst_id: int
    policy_version: int
    task_json: str
    openai_base_url: str
    router_target: str
    heartbeat_interval_s: float
    heartbeat_deadline_s: float
    model: str
    def __init__(self, execution_id: _Optional[str] = ..., token: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., burst_id: _Optional[int] = ..., policy_version: _Optional[int] = ..., task_json: _Optional[str] = ..., openai_base_url: _Optional[str] = ..., router_target: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_deadline_s: _Optional[float] = ..., model: _Optional[str] = ...) -> None: ...

class AcquireExecutionResponse(_message.Message):
    __slots__ = ("execution", "burst_exhausted", "retry_after_s")
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    BURST_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    execution: Execution
    burst_exhausted: bool
    retry_after_s: float
    def __init__(self, execution: _Optional[_Union[Execution, _Mapping]] = ..., burst_exhausted: _Optional[bool] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("execution_id",)
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    def __init__(self, execution_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("deadline_s", "status")
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    deadline_s: float
    status: _common_pb2.ExecutionStatus
    def __init__(self, deadline_s: _Optional[float] = ..., status: _Optional[_Union[_common_pb2.ExecutionStatus, str]] = ...) -> None: ...

class FinishExecutionRequest(_message.Message):
    __slots__ = ("execution_id", "status", "reward", "idempotency_key")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    status: _common_pb2.ExecutionStatus
    reward: float
    idempotency_key: str
    def __init__(self, execution_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.ExecutionStatus, str]] = ..., reward: _Optional[float] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class FinishExecutionResponse(_message.Message):
    __slots__ = ("status", "duplicate")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.ExecutionStatus
    duplicate: bool
    def __init__(self, status: _Optional[_Union[_common_pb2.ExecutionStatus, str]] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Ledger(_message.Message):
    __slots__ = ("burst_id", "dispatched", "launched", "finished", "queued", "running", "waterlevel", "finished_by_status", "policy_version")
    class FinishedByStatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BURST_ID_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_FIELD_NUMBER: _ClassVar[int]
    LAUNCHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WATERLEVEL_FIELD_NUMBER: _ClassVar[int]
    FINISHED_BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    burst_id: int
    dispatched: int
    launched: int
    finished: int
    queued: int
    running: int
    waterlevel: int
    finished_by_status: _containers.ScalarMap[str, int]
    policy_version: int
    def __init__(self, burst_id: _Optional[int] = ..., dispatched: _Optional[int] = ..., launched: _Optional[int] = ..., finished: _Optional[int] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., waterlevel: _Optional[int] = ..., finished_by_status: _Optional[_Mapping[str, int]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class CellInfo(_message.Message):
    __slots__ = ("cell_id", "kind", "index", "state", "slots", "routed", "target", "policy_version")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    kind: _common_pb2.CellKind
    index: int
    state: _common_pb2.CellState
    slots: int
    routed: int
    target: str
    policy_version: int
    def __init__(self, cell_id: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.CellKind, str]] = ..., index: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.CellState, str]] = ..., slots: _Optional[int] = ..., routed: _Optional[int] = ..., target: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class SchedulerStatus(_message.Message):
    __slots__ = ("epoch", "ledger", "capacity", "ready_groups", "batch_size", "cells", "policy_version", "reroutes", "bursts_completed", "transitions_to_training", "transitions_to_rollout", "total", "policy", "leader", "versions", "migrations", "open_bursts", "stale_rule", "groups_cancelled", "groups_restamped", "training")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    READY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CELLS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REROUTES_FIELD_NUMBER: _ClassVar[int]
    BURSTS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_TO_TRAINING_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_TO_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_BURSTS_FIELD_NUMBER: _ClassVar[int]
    STALE_RULE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_RESTAMPED_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    ledger: Ledger
    capacity: int
    ready_groups: int
    batch_size: int
    cells: _containers.RepeatedCompositeFieldContainer[CellInfo]
    policy_version: int
    reroutes: int
    bursts_completed: int
    transitions_to_training: int
    transitions_to_rollout: int
    total: Ledger
    policy: str
    leader: bool
    versions: _containers.RepeatedCompositeFieldContainer[Ledger]
    migrations: int
    open_bursts: int
    stale_rule: str
    groups_cancelled: int
    groups_restamped: int
    training: TrainingDiagnostics
    def __init__(self, epoch: _Optional[int] = ..., ledger: _Optional[_Union[Ledger, _Mapping]] = ..., capacity: _Optional[int] = ..., ready_groups: _Optional[int] = ..., batch_size: _Optional[int] = ..., cells: _Optional[_Iterable[_Union[CellInfo, _Mapping]]] = ..., policy_version: _Optional[int] = ..., reroutes: _Optional[int] = ..., bursts_completed: _Optional[int] = ..., transitions_to_training: _Optional[int] = ..., transitions_to_rollout: _Optional[int] = ..., total: _Optional[_Union[Ledger, _Mapping]] = ..., policy: _Optional[str] = ..., leader: _Optional[bool] = ..., versions: _Optional[_Iterable[_Union[Ledger, _Mapping]]] = ..., migrations: _Optional[int] = ..., open_bursts: _Optional[int] = ..., stale_rule: _Optional[str] = ..., groups_cancelled: _Optional[int] = ..., groups_restamped: _Optional[int] = ..., training: _Optional[_Union[TrainingDiagnostics, _Mapping]] = ...) -> None: ...

class TrainingDiagnostics(_message.Message):
    __slots__ = ("policy_version", "tokens", "clip_fraction", "behaviour_weight_mean", "behaviour_weight_max", "behaviour_weight_capped_share", "entropy", "logprob_gap_lag0", "lag_hist", "lag_mean", "grad_norm")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_WEIGHT_MEAN_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_WEIGHT_MAX_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_WEIGHT_CAPPED_SHARE_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_GAP_LAG0_FIELD_NUMBER: _ClassVar[int]
    LAG_HIST_FIELD_NUMBER: _ClassVar[int]
    LAG_MEAN_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tokens: float
    clip_fraction: float
    behaviour_weight_mean: float
    behaviour_weight_max: float
    behaviour_weight_capped_share: float
    entropy: float
    logprob_gap_lag0: float
    lag_hist: _containers.RepeatedScalarFieldContainer[float]
    lag_mean: float
    grad_norm: float
    def __init__(self, policy_version: _Optional[int] = ..., tokens: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., behaviour_weight_mean: _Optional[float] = ..., behaviour_weight_max: _Optional[float] = ..., behaviour_weight_capped_share: _Optional[float] = ..., entropy: _Optional[float] = ..., logprob_gap_lag0: _Optional[float] = ..., lag_hist: _Optional[_Iterable[float]] = ..., lag_mean: _Optional[float] = ..., grad_norm: _Optional[float] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("after_seq",)
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    def __init__(self, after_seq: _Optional[int] = ...) -> None: ...

class SchedulerEvent(_message.Message):
    __slots__ = ("seq", "time_s", "kind", "message", "cell_id", "execution_id", "waterlevel", "capacity", "ready_groups")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    WATERLEVEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    READY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time_s: float
    kind: str
    message: str
    cell_id: str
    execution_id: str
    waterlevel: int
    capacity: int
    ready_groups: int
    def __init__(self, seq: _Optional[int] = ..., time_s: _Optional[float] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., cell_id: _Optional[str] = ..., execution_id: _Optional[str] = ..., waterlevel: _Optional[int] = ..., capacity: _Optional[int] = ..., ready_groups: _Optional[int] = ...) -> None: ...
