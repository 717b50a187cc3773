from protos.radixmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachRequest(_message.Message):
    __slots__ = ("room", "kv_descriptor", "kv_transfer_backend", "dst_pages", "skip_tokens", "prompt_tokens", "prompt_digest")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    KV_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    room: str
    kv_descriptor: str
    kv_transfer_backend: str
    dst_pages: _containers.RepeatedScalarFieldContainer[int]
    skip_tokens: int
    prompt_tokens: int
    prompt_digest: bytes
    def __init__(self, room: _Optional[str] = ..., kv_descriptor: _Optional[str] = ..., kv_transfer_backend: _Optional[str] = ..., dst_pages: _Optional[_Iterable[int]] = ..., skip_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("heartbeat", "progress", "done", "error")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    heartbeat: Heartbeat
    progress: Progress
    done: PrefillDone
    error: _common_pb2.Error
    def __init__(self, heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Progress(_message.Message):
    __slots__ = ("pages_sent", "bytes_sent")
    PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    pages_sent: int
    bytes_sent: int
    def __init__(self, pages_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token_id", "logprob", "cached_tokens", "pages", "bytes", "transfer_seconds")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    logprob: _common_pb2.TokenLogprob
    cached_tokens: int
    pages: int
    bytes: int
    transfer_seconds: float
    def __init__(self, first_token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...
