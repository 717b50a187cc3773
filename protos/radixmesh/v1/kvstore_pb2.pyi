from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Page(_message.Message):
    __slots__ = ("key", "data", "index")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    index: int
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ..., index: _Optional[int] = ...) -> None: ...

class PutPagesRequest(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[Page]
    def __init__(self, pages: _Optional[_Iterable[_Union[Page, _Mapping]]] = ...) -> None: ...

class PutPagesResponse(_message.Message):
    __slots__ = ("stored", "skipped", "rejected")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    skipped: int
    rejected: int
    def __init__(self, stored: _Optional[int] = ..., skipped: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class GetPagesRequest(_message.Message):
    __slots__ = ("keys", "stop_at_miss", "max_batch_bytes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_MISS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    stop_at_miss: bool
    max_batch_bytes: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., stop_at_miss: _Optional[bool] = ..., max_batch_bytes: _Optional[int] = ...) -> None: ...

class GetPagesResponse(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[Page]
    def __init__(self, pages: _Optional[_Iterable[_Union[Page, _Mapping]]] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("prefix_pages",)
    PREFIX_PAGES_FIELD_NUMBER: _ClassVar[int]
    prefix_pages: int
    def __init__(self, prefix_pages: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("pages_removed",)
    PAGES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    pages_removed: int
    def __init__(self, pages_removed: _Optional[int] = ...) -> None: ...

class KVStoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStoreStats(_message.Message):
    __slots__ = ("memory_pages", "memory_bytes", "memory_capacity_bytes", "disk_pages", "disk_bytes", "disk_capacity_bytes", "hits_memory", "hits_disk", "misses", "bytes_in", "bytes_out", "pages_stored", "pages_skipped", "pages_rejected", "spilled", "dropped", "disk_evicted", "corrupt", "disk_enabled")
    MEMORY_PAGES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_MEMORY_FIELD_NUMBER: _ClassVar[int]
    HITS_DISK_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    PAGES_STORED_FIELD_NUMBER: _ClassVar[int]
    PAGES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PAGES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    DISK_ENABLED_FIELD_NUMBER: _ClassVar[int]
    memory_pages: int
    memory_bytes: int
    memory_capacity_bytes: int
    disk_pages: int
    disk_bytes: int
    disk_capacity_bytes: int
    hits_memory: int
    hits_disk: int
    misses: int
    bytes_in: int
    bytes_out: int
    pages_stored: int
    pages_skipped: int
    pages_rejected: int
    spilled: int
    dropped: int
    disk_evicted: int
    corrupt: int
    disk_enabled: bool
    def __init__(self, memory_pages: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., memory_capacity_bytes: _Optional[int] = ..., disk_pages: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., hits_memory: _Optional[int] = ..., hits_disk: _Optional[int] = ..., misses: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., pages_stored: _Optional[int] = ..., pages_skipped: _Optional[int] = ..., pages_rejected: _Optional[int] = ..., spilled: _Optional[int] = ..., dropped: _Optional[int] = ..., disk_evicted: _Optional[int] = ..., corrupt: _Optional[int] = ..., disk_enabled: _Optional[bool] = ...) -> None: ...
