from protos.radixmesh.v1 import scheduler_pb2 as _scheduler_pb2
from protos.radixmesh.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunningRequests(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUNNING_REQUESTS_FINISH: _ClassVar[RunningRequests]
    RUNNING_REQUESTS_RETRACT: _ClassVar[RunningRequests]

class ExpertDistributionAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPERT_DISTRIBUTION_ACTION_UNSPECIFIED: _ClassVar[ExpertDistributionAction]
    EXPERT_DISTRIBUTION_START: _ClassVar[ExpertDistributionAction]
    EXPERT_DISTRIBUTION_STOP: _ClassVar[ExpertDistributionAction]
    EXPERT_DISTRIBUTION_DUMP: _ClassVar[ExpertDistributionAction]
RUNNING_REQUESTS_FINISH: RunningRequests
RUNNING_REQUESTS_RETRACT: RunningRequests
EXPERT_DISTRIBUTION_ACTION_UNSPECIFIED: ExpertDistributionAction
EXPERT_DISTRIBUTION_START: ExpertDistributionAction
EXPERT_DISTRIBUTION_STOP: ExpertDistributionAction
EXPERT_DISTRIBUTION_DUMP: ExpertDistributionAction

class GetModelStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UpdateWeightsFromDiskRequest(_message.Message):
    __slots__ = ("model_path", "running")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    running: RunningRequests
    def __init__(self, model_path: _Optional[str] = ..., running: _Optional[_Union[RunningRequests, str]] = ...) -> None: ...

class UpdateWeightsFromTensorRequest(_message.Message):
    __slots__ = ("shm_path", "running")
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    shm_path: str
    running: RunningRequests
    def __init__(self, shm_path: _Optional[str] = ..., running: _Optional[_Union[RunningRequests, str]] = ...) -> None: ...

class InitWeightsUpdateGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsFromDistributedRequest(_message.Message):
    __slots__ = ("group_name", "tensors", "running")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    running: RunningRequests
    def __init__(self, group_name: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., running: _Optional[_Union[RunningRequests, str]] = ...) -> None: ...

class WeightUpdateReport(_message.Message):
    __slots__ = ("path", "bytes", "load_seconds", "swap_seconds", "pause_seconds", "flush_seconds", "flushed_pages", "retracted", "total_seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    RETRACTED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    bytes: int
    load_seconds: float
    swap_seconds: float
    pause_seconds: float
    flush_seconds: float
    flushed_pages: int
    retracted: int
    total_seconds: float
    def __init__(self, path: _Optional[str] = ..., bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., swap_seconds: _Optional[float] = ..., pause_seconds: _Optional[float] = ..., flush_seconds: _Optional[float] = ..., flushed_pages: _Optional[int] = ..., retracted: _Optional[int] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class ExpertDistributionRequest(_message.Message):
    __slots__ = ("action",)
    ACTION_FIELD_NUMBER: _ClassVar[int]
    action: ExpertDistributionAction
    def __init__(self, action: _Optional[_Union[ExpertDistributionAction, str]] = ...) -> None: ...

class ExpertCounts(_message.Message):
    __slots__ = ("counts",)
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, counts: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertDistribution(_message.Message):
    __slots__ = ("layers", "logical_count", "forwards", "seconds", "recording")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECORDING_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    logical_count: _containers.RepeatedCompositeFieldContainer[ExpertCounts]
    forwards: int
    seconds: float
    recording: bool
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., logical_count: _Optional[_Iterable[_Union[ExpertCounts, _Mapping]]] = ..., forwards: _Optional[int] = ..., seconds: _Optional[float] = ..., recording: _Optional[bool] = ...) -> None: ...

class ModelState(_message.Message):
    __slots__ = ("model", "weights_version", "adapters", "max_loras", "update", "address", "replicas", "seconds", "expert_distribution", "flushed_pages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    weights_version: str
    adapters: _containers.RepeatedCompositeFieldContainer[_worker_pb2.AdapterInfo]
    max_loras: int
    update: WeightUpdateReport
    address: str
    replicas: _containers.RepeatedCompositeFieldContainer[ModelState]
    seconds: float
    expert_distribution: ExpertDistribution
    flushed_pages: int
    def __init__(self, model: _Optional[str] = ..., weights_version: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[_worker_pb2.AdapterInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ..., update: _Optional[_Union[WeightUpdateReport, _Mapping]] = ..., address: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ModelState, _Mapping]]] = ..., seconds: _Optional[float] = ..., expert_distribution: _Optional[_Union[ExpertDistribution, _Mapping]] = ..., flushed_pages: _Optional[int] = ...) -> None: ...
