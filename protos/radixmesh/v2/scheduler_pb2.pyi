from protos.radixmesh.v1 import common_pb2 as _common_pb2
from protos.radixmesh.v2 import outputs_pb2 as _outputs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("rid", "input_ids", "sampling", "n", "namespace", "adapter", "text_options", "disaggregation")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TEXT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATION_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    n: int
    namespace: str
    adapter: str
    text_options: _outputs_pb2.TextOptions
    disaggregation: _common_pb2.Disaggregation
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., namespace: _Optional[str] = ..., adapter: _Optional[str] = ..., text_options: _Optional[_Union[_outputs_pb2.TextOptions, _Mapping]] = ..., disaggregation: _Optional[_Union[_common_pb2.Disaggregation, _Mapping]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rid", "index", "as_stop", "matched_stop")
    RID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    AS_STOP_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    rid: str
    index: int
    as_stop: bool
    matched_stop: str
    def __init__(self, rid: _Optional[str] = ..., index: _Optional[int] = ..., as_stop: _Optional[bool] = ..., matched_stop: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class OutputsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
