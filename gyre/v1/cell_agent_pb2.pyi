from gyre.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineGenerateRequest(_message.Message):
    __slots__ = ("request_id", "execution_id", "prompt_token_ids", "sampling", "required_policy_version", "kv_handle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    execution_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    required_policy_version: int
    kv_handle: KvHandle
    def __init__(self, request_id: _Optional[str] = ..., execution_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., required_policy_version: _Optional[int] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ...) -> None: ...

class EngineStreamRequest(_message.Message):
    __slots__ = ("starts", "cancels")
    STARTS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    starts: _containers.RepeatedCompositeFieldContainer[EngineStreamStart]
    cancels: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, starts: _Optional[_Iterable[_Union[EngineStreamStart, _Mapping]]] = ..., cancels: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineStreamStart(_message.Message):
    __slots__ = ("tag", "request", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TAG_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    request: EngineGenerateRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, tag: _Optional[int] = ..., request: _Optional[_Union[EngineGenerateRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EngineStep(_message.Message):
    __slots__ = ("tags", "counts", "policy_versions", "token_ids", "logprobs", "ends")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ends: _containers.RepeatedCompositeFieldContainer[EngineStreamEnd]
    def __init__(self, tags: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., ends: _Optional[_Iterable[_Union[EngineStreamEnd, _Mapping]]] = ...) -> None: ...

class EngineStreamEnd(_message.Message):
    __slots__ = ("tag", "finish_reason", "code", "message")
    TAG_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    tag: int
    finish_reason: _common_pb2.FinishReason
    code: int
    message: str
    def __init__(self, tag: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("cell_id", "slots", "running_requests", "policy_version", "accepting", "engine")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    slots: int
    running_requests: int
    policy_version: int
    accepting: bool
    engine: str
    def __init__(self, cell_id: _Optional[str] = ..., slots: _Optional[int] = ..., running_requests: _Optional[int] = ..., policy_version: _Optional[int] = ..., accepting: _Optional[bool] = ..., engine: _Optional[str] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("handle_id", "source_cell", "num_tokens", "locator", "medium")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_CELL_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCATOR_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    source_cell: str
    num_tokens: int
    locator: str
    medium: str
    def __init__(self, handle_id: _Optional[str] = ..., source_cell: _Optional[str] = ..., num_tokens: _Optional[int] = ..., locator: _Optional[str] = ..., medium: _Optional[str] = ...) -> None: ...

class ExportKvRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ExportKvResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: KvHandle
    def __init__(self, handle: _Optional[_Union[KvHandle, _Mapping]] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("handle_id",)
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    def __init__(self, handle_id: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetStateRequest(_message.Message):
    __slots__ = ("fence", "target", "reason")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    fence: _common_pb2.Fence
    target: _common_pb2.CellState
    reason: str
    def __init__(self, fence: _Optional[_Union[_common_pb2.Fence, _Mapping]] = ..., target: _Optional[_Union[_common_pb2.CellState, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class SetStateResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.CellState
    def __init__(self, state: _Optional[_Union[_common_pb2.CellState, str]] = ...) -> None: ...

class GetCellStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CellStatus(_message.Message):
    __slots__ = ("cell_id", "kind", "index", "state", "load", "epoch")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    kind: _common_pb2.CellKind
    index: int
    state: _common_pb2.CellState
    load: EngineLoad
    epoch: int
    def __init__(self, cell_id: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.CellKind, str]] = ..., index: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.CellState, str]] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class LoadPolicyRequest(_message.Message):
    __slots__ = ("fence", "version", "source_target")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TARGET_FIELD_NUMBER: _ClassVar[int]
    fence: _common_pb2.Fence
    version: int
    source_target: str
    def __init__(self, fence: _Optional[_Union[_common_pb2.Fence, _Mapping]] = ..., version: _Optional[int] = ..., source_target: _Optional[str] = ...) -> None: ...

class LoadPolicyResponse(_message.Message):
    __slots__ = ("policy_version", "seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class JoinBatchRequest(_message.Message):
    __slots__ = ("fence", "batch_id", "policy_version", "prefix_size", "core_target")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SIZE_FIELD_NUMBER: _ClassVar[int]
    CORE_TARGET_FIELD_NUMBER: _ClassVar[int]
    fence: _common_pb2.Fence
    batch_id: int
    policy_version: int
    prefix_size: int
    core_target: str
    def __init__(self, fence: _Optional[_Union[_common_pb2.Fence, _Mapping]] = ..., batch_id: _Optional[int] = ..., policy_version: _Optional[int] = ..., prefix_size: _Optional[int] = ..., core_target: _Optional[str] = ...) -> None: ...

class JoinBatchResponse(_message.Message):
    __slots__ = ("joined",)
    JOINED_FIELD_NUMBER: _ClassVar[int]
    joined: bool
    def __init__(self, joined: _Optional[bool] = ...) -> None: ...

class PullSnapshotRequest(_message.Message):
    __slots__ = ("version", "chunk_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk_bytes: int
    def __init__(self, version: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "name", "dtype", "shape", "offset", "total_bytes", "data", "tensors_total")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    total_bytes: int
    data: bytes
    tensors_total: int
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., tensors_total: _Optional[int] = ...) -> None: ...
