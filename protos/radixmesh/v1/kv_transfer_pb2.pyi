from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVSegment(_message.Message):
    __slots__ = ("layer", "tensor", "dst_page", "num_pages")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tensor: int
    dst_page: int
    num_pages: int
    def __init__(self, layer: _Optional[int] = ..., tensor: _Optional[int] = ..., dst_page: _Optional[int] = ..., num_pages: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("segments", "data", "layout")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[KVSegment]
    data: bytes
    layout: str
    def __init__(self, segments: _Optional[_Iterable[_Union[KVSegment, _Mapping]]] = ..., data: _Optional[bytes] = ..., layout: _Optional[str] = ...) -> None: ...

class KVWriteAck(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...
