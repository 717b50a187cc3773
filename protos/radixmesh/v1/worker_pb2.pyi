from protos.radixmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareGrammarResponse(_message.Message):
    __slots__ = ("cached", "compile_seconds")
    CACHED_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    cached: bool
    compile_seconds: float
    def __init__(self, cached: _Optional[bool] = ..., compile_seconds: _Optional[float] = ...) -> None: ...

class NewRequestSpec(_message.Message):
    __slots__ = ("rid", "prompt_ids", "output_ids", "sampling", "seed", "traceparent", "adapter")
    RID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    rid: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    traceparent: str
    adapter: str
    def __init__(self, rid: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., output_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., traceparent: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class StepItem(_message.Message):
    __slots__ = ("rid", "input_ids", "start_pos", "new_pages", "reset_pages", "sample", "verify", "draft_depth")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESET_PAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    start_pos: int
    new_pages: _containers.RepeatedScalarFieldContainer[int]
    reset_pages: bool
    sample: bool
    verify: bool
    draft_depth: int
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., start_pos: _Optional[int] = ..., new_pages: _Optional[_Iterable[int]] = ..., reset_pages: _Optional[bool] = ..., sample: _Optional[bool] = ..., verify: _Optional[bool] = ..., draft_depth: _Optional[int] = ...) -> None: ...

class KVCopy(_message.Message):
    __slots__ = ("src_tier", "dst_tier", "src_pages", "dst_pages", "keys")
    SRC_TIER_FIELD_NUMBER: _ClassVar[int]
    DST_TIER_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGES_FIELD_NUMBER: _ClassVar[int]
    DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    src_tier: str
    dst_tier: str
    src_pages: _containers.RepeatedScalarFieldContainer[int]
    dst_pages: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, src_tier: _Optional[str] = ..., dst_tier: _Optional[str] = ..., src_pages: _Optional[_Iterable[int]] = ..., dst_pages: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "items", "released_rids", "kv_copies", "kv_sends")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_RIDS_FIELD_NUMBER: _ClassVar[int]
    KV_COPIES_FIELD_NUMBER: _ClassVar[int]
    KV_SENDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequestSpec]
    items: _containers.RepeatedCompositeFieldContainer[StepItem]
    released_rids: _containers.RepeatedScalarFieldContainer[str]
    kv_copies: _containers.RepeatedCompositeFieldContainer[KVCopy]
    kv_sends: _containers.RepeatedCompositeFieldContainer[KVSend]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequestSpec, _Mapping]]] = ..., items: _Optional[_Iterable[_Union[StepItem, _Mapping]]] = ..., released_rids: _Optional[_Iterable[str]] = ..., kv_copies: _Optional[_Iterable[_Union[KVCopy, _Mapping]]] = ..., kv_sends: _Optional[_Iterable[_Union[KVSend, _Mapping]]] = ...) -> None: ...

class KVSend(_message.Message):
    __slots__ = ("room", "descriptor", "src_pages", "dst_pages")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGES_FIELD_NUMBER: _ClassVar[int]
    DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    room: str
    descriptor: str
    src_pages: _containers.RepeatedScalarFieldContainer[int]
    dst_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, room: _Optional[str] = ..., descriptor: _Optional[str] = ..., src_pages: _Optional[_Iterable[int]] = ..., dst_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class KVSendResult(_message.Message):
    __slots__ = ("room", "pages", "bytes", "seconds", "error")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    room: str
    pages: int
    bytes: int
    seconds: float
    error: str
    def __init__(self, room: _Optional[str] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class KVTransferStat(_message.Message):
    __slots__ = ("pages", "bytes", "seconds")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    pages: int
    bytes: int
    seconds: float
    def __init__(self, pages: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SampledLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LogprobSlot(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: SampledLogprobs
    def __init__(self, value: _Optional[_Union[SampledLogprobs, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "rids", "next_token_ids", "logprobs", "forward_seconds", "kv_transfers", "accepted", "drafts", "draft_seconds", "kv_sends", "prompt_logprobs", "embeddings")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RIDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_SENDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rids: _containers.RepeatedScalarFieldContainer[str]
    next_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[LogprobSlot]
    forward_seconds: float
    kv_transfers: _containers.RepeatedCompositeFieldContainer[KVTransferStat]
    accepted: _containers.RepeatedCompositeFieldContainer[TokenRun]
    drafts: _containers.RepeatedCompositeFieldContainer[TokenRun]
    draft_seconds: float
    kv_sends: _containers.RepeatedCompositeFieldContainer[KVSendResult]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    def __init__(self, step_id: _Optional[int] = ..., rids: _Optional[_Iterable[str]] = ..., next_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[LogprobSlot, _Mapping]]] = ..., forward_seconds: _Optional[float] = ..., kv_transfers: _Optional[_Iterable[_Union[KVTransferStat, _Mapping]]] = ..., accepted: _Optional[_Iterable[_Union[TokenRun, _Mapping]]] = ..., drafts: _Optional[_Iterable[_Union[TokenRun, _Mapping]]] = ..., draft_seconds: _Optional[float] = ..., kv_sends: _Optional[_Iterable[_Union[KVSendResult, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("rid", "start", "logprobs", "top_k", "top_token_ids", "top_logprobs")
    RID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    start: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_k: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rid: _Optional[str] = ..., start: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_k: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("rid", "values")
    RID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rid: str
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rid: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenRun(_message.Message):
    __slots__ = ("ids", "speculative")
    IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    speculative: bool
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., speculative: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling_json", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_ids", "name")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    RMS_NORM_EPS_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    ROPE_SCALING_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    TIE_WORD_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BIAS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_json: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    name: str
    def __init__(self, vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., num_hidden_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_key_value_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., rms_norm_eps: _Optional[float] = ..., rope_theta: _Optional[float] = ..., rope_scaling_json: _Optional[str] = ..., max_position_embeddings: _Optional[int] = ..., tie_word_embeddings: _Optional[bool] = ..., attention_bias: _Optional[bool] = ..., bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., name: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "num_kv_pages", "page_size", "dtype", "kv_dtype", "tp_size", "weights_version", "max_requests", "num_host_pages", "page_bytes", "model_identity", "kv_layout", "kvstore_addr", "max_draft_tokens", "verify_max_rows", "max_loras", "adapters", "disaggregation_mode", "kv_transfer_backend", "kv_descriptor", "bootstrap_address")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_ADDR_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATION_MODE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    model: ModelConfig
    num_kv_pages: int
    page_size: int
    dtype: str
    kv_dtype: str
    tp_size: int
    weights_version: str
    max_requests: int
    num_host_pages: int
    page_bytes: int
    model_identity: str
    kv_layout: str
    kvstore_addr: str
    max_draft_tokens: int
    verify_max_rows: int
    max_loras: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    disaggregation_mode: str
    kv_transfer_backend: str
    kv_descriptor: str
    bootstrap_address: str
    def __init__(self, model: _Optional[_Union[ModelConfig, _Mapping]] = ..., num_kv_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., tp_size: _Optional[int] = ..., weights_version: _Optional[str] = ..., max_requests: _Optional[int] = ..., num_host_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., model_identity: _Optional[str] = ..., kv_layout: _Optional[str] = ..., kvstore_addr: _Optional[str] = ..., max_draft_tokens: _Optional[int] = ..., verify_max_rows: _Optional[int] = ..., max_loras: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., disaggregation_mode: _Optional[str] = ..., kv_transfer_backend: _Optional[str] = ..., kv_descriptor: _Optional[str] = ..., bootstrap_address: _Optional[str] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "identity", "rank", "target_modules", "path", "resident")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    identity: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    path: str
    resident: bool
    def __init__(self, name: _Optional[str] = ..., identity: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., path: _Optional[str] = ..., resident: _Optional[bool] = ...) -> None: ...
