from protos.radixmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TextOptions(_message.Message):
    __slots__ = ("stop", "skip_special_tokens", "include_stop_str_in_output", "context_ids", "min_tokens", "reply_to", "traceparent")
    STOP_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    reply_to: str
    traceparent: str
    def __init__(self, stop: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., context_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ..., reply_to: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("rid", "index", "token_ids", "logprobs", "text", "finish", "usage", "weights_version", "text_options", "prompt_logprobs", "embedding")
    RID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    rid: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    text: str
    finish: _common_pb2.Finish
    usage: _common_pb2.Usage
    weights_version: str
    text_options: TextOptions
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rid: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., text: _Optional[str] = ..., finish: _Optional[_Union[_common_pb2.Finish, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., weights_version: _Optional[str] = ..., text_options: _Optional[_Union[TextOptions, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("rid", "error", "reply_to")
    RID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    rid: str
    error: _common_pb2.Error
    reply_to: str
    def __init__(self, rid: _Optional[str] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., reply_to: _Optional[str] = ...) -> None: ...

class OutputBatch(_message.Message):
    __slots__ = ("outputs", "errors")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    def __init__(self, outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ...) -> None: ...
