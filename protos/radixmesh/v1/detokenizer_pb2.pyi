from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DetokenizeOptions(_message.Message):
    __slots__ = ("stop", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "context_ids", "min_tokens")
    STOP_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    def __init__(self, stop: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., context_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("index", "options", "token_ids", "finished")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    index: int
    options: DetokenizeOptions
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, index: _Optional[int] = ..., options: _Optional[_Union[DetokenizeOptions, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("index", "text", "matched_stop", "done")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    matched_stop: str
    done: bool
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., matched_stop: _Optional[str] = ..., done: _Optional[bool] = ...) -> None: ...
