from protos.radixmesh.v1 import common_pb2 as _common_pb2
from protos.radixmesh.v1 import tokenizer_pb2 as _tokenizer_pb2
from protos.radixmesh.v2 import outputs_pb2 as _outputs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamRequest(_message.Message):
    __slots__ = ("generate", "cancel", "traceparent")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    generate: _tokenizer_pb2.GenerateTextRequest
    cancel: str
    traceparent: str
    def __init__(self, generate: _Optional[_Union[_tokenizer_pb2.GenerateTextRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("outputs", "error")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[_outputs_pb2.SequenceOutput]
    error: _common_pb2.Error
    def __init__(self, outputs: _Optional[_Iterable[_Union[_outputs_pb2.SequenceOutput, _Mapping]]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...
