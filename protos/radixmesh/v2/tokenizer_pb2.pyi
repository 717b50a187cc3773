from protos.radixmesh.v1 import common_pb2 as _common_pb2
from protos.radixmesh.v1 import tokenizer_pb2 as _tokenizer_pb2
from protos.radixmesh.v2 import outputs_pb2 as _outputs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateResponse(_message.Message):
    __slots__ = ("outputs", "error")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[_outputs_pb2.SequenceOutput]
    error: _common_pb2.Error
    def __init__(self, outputs: _Optional[_Iterable[_Union[_outputs_pb2.SequenceOutput, _Mapping]]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...
