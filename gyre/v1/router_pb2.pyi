from gyre.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("execution_id", "prompt_token_ids", "sampling", "prompt_loss_mask", "answer_once", "idempotency_key")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ANSWER_ONCE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prompt_loss_mask: _containers.RepeatedScalarFieldContainer[int]
    answer_once: bool
    idempotency_key: str
    def __init__(self, execution_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_loss_mask: _Optional[_Iterable[int]] = ..., answer_once: _Optional[bool] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "reroutes")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    REROUTES_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TokenChunk
    reroutes: int
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TokenChunk, _Mapping]] = ..., reroutes: _Optional[int] = ...) -> None: ...

class StreamCall(_message.Message):
    __slots__ = ("tag", "token", "request", "stream")
    TAG_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    tag: int
    token: str
    request: GenerateRequest
    stream: bool
    def __init__(self, tag: _Optional[int] = ..., token: _Optional[str] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., stream: _Optional[bool] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("calls", "cancels")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[StreamCall]
    cancels: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, calls: _Optional[_Iterable[_Union[StreamCall, _Mapping]]] = ..., cancels: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamAnswer(_message.Message):
    __slots__ = ("tag", "responses", "code", "message", "more")
    TAG_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    tag: int
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    code: int
    message: str
    more: bool
    def __init__(self, tag: _Optional[int] = ..., responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., more: _Optional[bool] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[StreamAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[StreamAnswer, _Mapping]]] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("execution_id", "from_cell", "to_cell", "route_epoch")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_CELL_FIELD_NUMBER: _ClassVar[int]
    TO_CELL_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    from_cell: str
    to_cell: str
    route_epoch: int
    def __init__(self, execution_id: _Optional[str] = ..., from_cell: _Optional[str] = ..., to_cell: _Optional[str] = ..., route_epoch: _Optional[int] = ...) -> None: ...

class MoveExecutionsRequest(_message.Message):
    __slots__ = ("fence", "moves")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    fence: _common_pb2.Fence
    moves: _containers.RepeatedCompositeFieldContainer[Move]
    def __init__(self, fence: _Optional[_Union[_common_pb2.Fence, _Mapping]] = ..., moves: _Optional[_Iterable[_Union[Move, _Mapping]]] = ...) -> None: ...

class MoveExecutionsResponse(_message.Message):
    __slots__ = ("moved_requests", "remaining_at_source")
    MOVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_AT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    moved_requests: int
    remaining_at_source: int
    def __init__(self, moved_requests: _Optional[int] = ..., remaining_at_source: _Optional[int] = ...) -> None: ...

class GetRouterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("inflight", "reroutes", "failed_calls", "turn_records", "kv_handoffs", "kv_recomputes")
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    REROUTES_FIELD_NUMBER: _ClassVar[int]
    FAILED_CALLS_FIELD_NUMBER: _ClassVar[int]
    TURN_RECORDS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTES_FIELD_NUMBER: _ClassVar[int]
    inflight: int
    reroutes: int
    failed_calls: int
    turn_records: int
    kv_handoffs: int
    kv_recomputes: int
    def __init__(self, inflight: _Optional[int] = ..., reroutes: _Optional[int] = ..., failed_calls: _Optional[int] = ..., turn_records: _Optional[int] = ..., kv_handoffs: _Optional[int] = ..., kv_recomputes: _Optional[int] = ...) -> None: ...
