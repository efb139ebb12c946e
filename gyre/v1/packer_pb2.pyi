from gyre.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClaimOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLAIM_OUTCOME_UNSPECIFIED: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_CLAIMED: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_WAIT: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_CLOSED: _ClassVar[ClaimOutcome]
CLAIM_OUTCOME_UNSPECIFIED: ClaimOutcome
CLAIM_OUTCOME_CLAIMED: ClaimOutcome
CLAIM_OUTCOME_WAIT: ClaimOutcome
CLAIM_OUTCOME_CLOSED: ClaimOutcome

class TurnRecord(_message.Message):
    __slots__ = ("execution_id", "group_id", "turn_index", "prompt_token_ids", "output_token_ids", "output_logprobs", "output_policy_versions", "output_loss_mask", "idempotency_key", "chat_state", "temperature")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    CHAT_STATE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    group_id: str
    turn_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    output_policy_versions: _containers.RepeatedScalarFieldContainer[int]
    output_loss_mask: _containers.RepeatedScalarFieldContainer[int]
    idempotency_key: str
    chat_state: str
    temperature: float
    def __init__(self, execution_id: _Optional[str] = ..., group_id: _Optional[str] = ..., turn_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., output_policy_versions: _Optional[_Iterable[int]] = ..., output_loss_mask: _Optional[_Iterable[int]] = ..., idempotency_key: _Optional[str] = ..., chat_state: _Optional[str] = ..., temperature: _Optional[float] = ...) -> None: ...

class RecordTurnResponse(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    def __init__(self, duplicate: _Optional[bool] = ...) -> None: ...

class GetTrajectoryRequest(_message.Message):
    __slots__ = ("execution_id", "idempotency_key")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    idempotency_key: str
    def __init__(self, execution_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class GetTrajectoryResponse(_message.Message):
    __slots__ = ("last", "next_turn_index")
    LAST_FIELD_NUMBER: _ClassVar[int]
    NEXT_TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    last: TurnRecord
    next_turn_index: int
    def __init__(self, last: _Optional[_Union[TurnRecord, _Mapping]] = ..., next_turn_index: _Optional[int] = ...) -> None: ...

class FinishReport(_message.Message):
    __slots__ = ("execution_id", "group_id", "group_size", "status", "reward", "policy_version")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    group_id: str
    group_size: int
    status: _common_pb2.ExecutionStatus
    reward: float
    policy_version: int
    def __init__(self, execution_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.ExecutionStatus, str]] = ..., reward: _Optional[float] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ReportFinishResponse(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    def __init__(self, duplicate: _Optional[bool] = ...) -> None: ...

class MicroStep(_message.Message):
    __slots__ = ("micro_step_id", "batch_id", "sequences", "num_tokens", "policy_version", "packed_tokens")
    MICRO_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    micro_step_id: str
    batch_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[PackedSequence]
    num_tokens: int
    policy_version: int
    packed_tokens: int
    def __init__(self, micro_step_id: _Optional[str] = ..., batch_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[PackedSequence, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., policy_version: _Optional[int] = ..., packed_tokens: _Optional[int] = ...) -> None: ...

class PackedSequence(_message.Message):
    __slots__ = ("token_ids", "loss_mask", "logprobs", "advantage", "execution_id", "group_id", "turn_index", "policy_version", "token_policy_versions", "turns", "temperature")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantage: float
    execution_id: str
    group_id: str
    turn_index: int
    policy_version: int
    token_policy_versions: _containers.RepeatedScalarFieldContainer[int]
    turns: int
    temperature: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., advantage: _Optional[float] = ..., execution_id: _Optional[str] = ..., group_id: _Optional[str] = ..., turn_index: _Optional[int] = ..., policy_version: _Optional[int] = ..., token_policy_versions: _Optional[_Iterable[int]] = ..., turns: _Optional[int] = ..., temperature: _Optional[float] = ...) -> None: ...

class ClaimMicroStepsRequest(_message.Message):
    __slots__ = ("cell_id", "batch_id", "policy_version", "wait_s", "claim_id", "max_micro_steps")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    batch_id: int
    policy_version: int
    wait_s: float
    claim_id: str
    max_micro_steps: int
    def __init__(self, cell_id: _Optional[str] = ..., batch_id: _Optional[int] = ..., policy_version: _Optional[int] = ..., wait_s: _Optional[float] = ..., claim_id: _Optional[str] = ..., max_micro_steps: _Optional[int] = ...) -> None: ...

class ClaimMicroStepsResponse(_message.Message):
    __slots__ = ("outcome", "micro_steps", "claim_ttl_s", "batch_id", "policy_version")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TTL_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    outcome: ClaimOutcome
    micro_steps: _containers.RepeatedCompositeFieldContainer[MicroStep]
    claim_ttl_s: float
    batch_id: int
    policy_version: int
    def __init__(self, outcome: _Optional[_Union[ClaimOutcome, str]] = ..., micro_steps: _Optional[_Iterable[_Union[MicroStep, _Mapping]]] = ..., claim_ttl_s: _Optional[float] = ..., batch_id: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class AckMicroStepsRequest(_message.Message):
    __slots__ = ("cell_id", "batch_id", "micro_step_ids")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEP_IDS_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    batch_id: int
    micro_step_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cell_id: _Optional[str] = ..., batch_id: _Optional[int] = ..., micro_step_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckMicroStepsResponse(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, duplicate: _Optional[_Iterable[bool]] = ...) -> None: ...

class CommitBatchRequest(_message.Message):
    __slots__ = ("cell_id", "batch_id")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    batch_id: int
    def __init__(self, cell_id: _Optional[str] = ..., batch_id: _Optional[int] = ...) -> None: ...

class OpenBatchRequest(_message.Message):
    __slots__ = ("cell_id", "batch_id")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    batch_id: int
    def __init__(self, cell_id: _Optional[str] = ..., batch_id: _Optional[int] = ...) -> None: ...

class KeepClaimsRequest(_message.Message):
    __slots__ = ("cell_id",)
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    def __init__(self, cell_id: _Optional[str] = ...) -> None: ...

class KeepClaimsResponse(_message.Message):
    __slots__ = ("claims",)
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    claims: int
    def __init__(self, claims: _Optional[int] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    def __init__(self, batch_id: _Optional[int] = ...) -> None: ...

class BatchStatus(_message.Message):
    __slots__ = ("batch_id", "policy_version", "batch_size", "groups_packed", "micro_steps", "claimed", "acked", "sealed", "total_tokens", "closed", "done", "active", "unclaimed", "participants", "counters", "committed", "attempt")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PACKED_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    UNCLAIMED_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    policy_version: int
    batch_size: int
    groups_packed: int
    micro_steps: int
    claimed: int
    acked: int
    sealed: bool
    total_tokens: int
    closed: bool
    done: bool
    active: bool
    unclaimed: int
    participants: _containers.RepeatedScalarFieldContainer[str]
    counters: PackerCounters
    committed: bool
    attempt: int
    def __init__(self, batch_id: _Optional[int] = ..., policy_version: _Optional[int] = ..., batch_size: _Optional[int] = ..., groups_packed: _Optional[int] = ..., micro_steps: _Optional[int] = ..., claimed: _Optional[int] = ..., acked: _Optional[int] = ..., sealed: _Optional[bool] = ..., total_tokens: _Optional[int] = ..., closed: _Optional[bool] = ..., done: _Optional[bool] = ..., active: _Optional[bool] = ..., unclaimed: _Optional[int] = ..., participants: _Optional[_Iterable[str]] = ..., counters: _Optional[_Union[PackerCounters, _Mapping]] = ..., committed: _Optional[bool] = ..., attempt: _Optional[int] = ...) -> None: ...

class PackerCounters(_message.Message):
    __slots__ = ("produced", "consumed", "buffered", "dropped", "pending", "ready", "assigned", "packed", "claims_expired", "policy_version", "late_turns", "turns_replaced")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PRODUCED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LATE_TURNS_FIELD_NUMBER: _ClassVar[int]
    TURNS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    produced: int
    consumed: int
    buffered: int
    dropped: _containers.ScalarMap[str, int]
    pending: int
    ready: int
    assigned: int
    packed: int
    claims_expired: int
    policy_version: int
    late_turns: int
    turns_replaced: int
    def __init__(self, produced: _Optional[int] = ..., consumed: _Optional[int] = ..., buffered: _Optional[int] = ..., dropped: _Optional[_Mapping[str, int]] = ..., pending: _Optional[int] = ..., ready: _Optional[int] = ..., assigned: _Optional[int] = ..., packed: _Optional[int] = ..., claims_expired: _Optional[int] = ..., policy_version: _Optional[int] = ..., late_turns: _Optional[int] = ..., turns_replaced: _Optional[int] = ...) -> None: ...

class SealBatchRequest(_message.Message):
    __slots__ = ("fence", "batch_id")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    fence: _common_pb2.Fence
    batch_id: int
    def __init__(self, fence: _Optional[_Union[_common_pb2.Fence, _Mapping]] = ..., batch_id: _Optional[int] = ...) -> None: ...

class WatchSupplyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadLogRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, events: _Optional[_Iterable[str]] = ...) -> None: ...

class SupplySignal(_message.Message):
    __slots__ = ("ready_groups", "batch_needs", "batch_id", "dropped", "batch_active", "unclaimed_micro_steps", "ready_unassigned", "counters", "ready_tokens", "backlog_tokens", "tokens_trained", "optimizing", "groups_ready_total", "batch_assigned", "groups_filtered", "open_context_tokens")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    READY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_NEEDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    BATCH_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    UNCLAIMED_MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    READY_UNASSIGNED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_READY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BATCH_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    OPEN_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ready_groups: int
    batch_needs: int
    batch_id: int
    dropped: _containers.ScalarMap[str, int]
    batch_active: bool
    unclaimed_micro_steps: int
    ready_unassigned: int
    counters: PackerCounters
    ready_tokens: float
    backlog_tokens: float
    tokens_trained: float
    optimizing: bool
    groups_ready_total: int
    batch_assigned: int
    groups_filtered: int
    open_context_tokens: float
    def __init__(self, ready_groups: _Optional[int] = ..., batch_needs: _Optional[int] = ..., batch_id: _Optional[int] = ..., dropped: _Optional[_Mapping[str, int]] = ..., batch_active: _Optional[bool] = ..., unclaimed_micro_steps: _Optional[int] = ..., ready_unassigned: _Optional[int] = ..., counters: _Optional[_Union[PackerCounters, _Mapping]] = ..., ready_tokens: _Optional[float] = ..., backlog_tokens: _Optional[float] = ..., tokens_trained: _Optional[float] = ..., optimizing: _Optional[bool] = ..., groups_ready_total: _Optional[int] = ..., batch_assigned: _Optional[int] = ..., groups_filtered: _Optional[int] = ..., open_context_tokens: _Optional[float] = ...) -> None: ...
