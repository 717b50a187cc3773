from protos.radixmesh.v1 import common_pb2 as _common_pb2
from protos.radixmesh.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("rid", "input_ids", "sampling", "namespace", "n", "adapter")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    namespace: str
    n: int
    adapter: str
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., namespace: _Optional[str] = ..., n: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

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

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_pages_used", "kv_pages_total", "page_size", "cache_hit_tokens", "cache_query_tokens", "total_usage", "kv_pages_cached", "retracted", "aborted", "finished", "steps", "worker_connected", "cache_hits", "cache_queries", "weights_version", "adapters", "resident_adapters")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    RETRACTED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    WORKER_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    page_size: int
    cache_hit_tokens: int
    cache_query_tokens: int
    total_usage: _common_pb2.Usage
    kv_pages_cached: int
    retracted: int
    aborted: int
    finished: int
    steps: int
    worker_connected: bool
    cache_hits: int
    cache_queries: int
    weights_version: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., page_size: _Optional[int] = ..., cache_hit_tokens: _Optional[int] = ..., cache_query_tokens: _Optional[int] = ..., total_usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., kv_pages_cached: _Optional[int] = ..., retracted: _Optional[int] = ..., aborted: _Optional[int] = ..., finished: _Optional[int] = ..., steps: _Optional[int] = ..., worker_connected: _Optional[bool] = ..., cache_hits: _Optional[int] = ..., cache_queries: _Optional[int] = ..., weights_version: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., resident_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("flushed", "message")
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    flushed: bool
    message: str
    def __init__(self, flushed: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
