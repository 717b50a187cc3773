from protos.radixmesh.v1 import tokenizer_pb2 as _tokenizer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AddReplicaRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RemoveReplicaRequest(_message.Message):
    __slots__ = ("address", "force", "timeout_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    force: bool
    timeout_s: float
    def __init__(self, address: _Optional[str] = ..., force: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DrainReplicaRequest(_message.Message):
    __slots__ = ("address", "resume")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    address: str
    resume: bool
    def __init__(self, address: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "state", "circuit", "in_flight", "routed", "routed_by_match", "routed_by_load", "failures", "ejections", "load", "tree_chars", "role")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CIRCUIT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    ROUTED_BY_MATCH_FIELD_NUMBER: _ClassVar[int]
    ROUTED_BY_LOAD_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    EJECTIONS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    TREE_CHARS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: str
    circuit: str
    in_flight: int
    routed: int
    routed_by_match: int
    routed_by_load: int
    failures: int
    ejections: int
    load: _tokenizer_pb2.LoadReport
    tree_chars: int
    role: str
    def __init__(self, address: _Optional[str] = ..., state: _Optional[str] = ..., circuit: _Optional[str] = ..., in_flight: _Optional[int] = ..., routed: _Optional[int] = ..., routed_by_match: _Optional[int] = ..., routed_by_load: _Optional[int] = ..., failures: _Optional[int] = ..., ejections: _Optional[int] = ..., load: _Optional[_Union[_tokenizer_pb2.LoadReport, _Mapping]] = ..., tree_chars: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("policy", "replicas")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, policy: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...
