from protos.radixmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls_json: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls_json: _Optional[str] = ...) -> None: ...

class Conversation(_message.Message):
    __slots__ = ("messages", "tools_json", "tool_call_format")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    tool_call_format: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., tool_call_format: _Optional[str] = ...) -> None: ...

class TextBatch(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class ConversationBatch(_message.Message):
    __slots__ = ("conversations",)
    CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    conversations: _containers.RepeatedCompositeFieldContainer[Conversation]
    def __init__(self, conversations: _Optional[_Iterable[_Union[Conversation, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("texts", "conversations", "add_special_tokens", "add_generation_prompt")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    texts: TextBatch
    conversations: ConversationBatch
    add_special_tokens: bool
    add_generation_prompt: bool
    def __init__(self, texts: _Optional[_Union[TextBatch, _Mapping]] = ..., conversations: _Optional[_Union[ConversationBatch, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, items: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class ApplyChatTemplateRequest(_message.Message):
    __slots__ = ("conversations", "add_generation_prompt")
    CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    conversations: _containers.RepeatedCompositeFieldContainer[Conversation]
    add_generation_prompt: bool
    def __init__(self, conversations: _Optional[_Iterable[_Union[Conversation, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class ApplyChatTemplateResponse(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prompts: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeIdsRequest(_message.Message):
    __slots__ = ("items", "skip_special_tokens")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TokenIds]
    skip_special_tokens: bool
    def __init__(self, items: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenStrings(_message.Message):
    __slots__ = ("strs",)
    STRS_FIELD_NUMBER: _ClassVar[int]
    strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, strs: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeIdsResponse(_message.Message):
    __slots__ = ("texts", "tokens")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenStrings]
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., tokens: _Optional[_Iterable[_Union[TokenStrings, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "eos_token_ids", "context_length", "bos_token_id", "pad_token_id", "has_chat_template", "tool_call_format", "disaggregation_mode", "bootstrap_address")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATION_MODE_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    bos_token_id: int
    pad_token_id: int
    has_chat_template: bool
    tool_call_format: str
    disaggregation_mode: str
    bootstrap_address: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., tool_call_format: _Optional[str] = ..., disaggregation_mode: _Optional[str] = ..., bootstrap_address: _Optional[str] = ...) -> None: ...

class GenerateTextRequest(_message.Message):
    __slots__ = ("rid", "text", "conversation", "input_ids", "sampling", "n", "namespace", "add_special_tokens", "skip_special_tokens", "include_stop_str_in_output", "default_max_new_tokens", "adapter", "disaggregation")
    RID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATION_FIELD_NUMBER: _ClassVar[int]
    rid: str
    text: str
    conversation: Conversation
    input_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    n: int
    namespace: str
    add_special_tokens: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    default_max_new_tokens: int
    adapter: str
    disaggregation: _common_pb2.Disaggregation
    def __init__(self, rid: _Optional[str] = ..., text: _Optional[str] = ..., conversation: _Optional[_Union[Conversation, _Mapping]] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., namespace: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., default_max_new_tokens: _Optional[int] = ..., adapter: _Optional[str] = ..., disaggregation: _Optional[_Union[_common_pb2.Disaggregation, _Mapping]] = ...) -> None: ...

class ReadyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageHealth(_message.Message):
    __slots__ = ("stage", "address", "serving", "detail")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    stage: str
    address: str
    serving: bool
    detail: str
    def __init__(self, stage: _Optional[str] = ..., address: _Optional[str] = ..., serving: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class ReadyResponse(_message.Message):
    __slots__ = ("ready", "stages")
    READY_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    stages: _containers.RepeatedCompositeFieldContainer[StageHealth]
    def __init__(self, ready: _Optional[bool] = ..., stages: _Optional[_Iterable[_Union[StageHealth, _Mapping]]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "in_flight", "kv_usage", "cache_hit_tokens", "cache_query_tokens", "cache_hit_rate", "weights_version", "adapters", "resident_adapters")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    in_flight: int
    kv_usage: float
    cache_hit_tokens: int
    cache_query_tokens: int
    cache_hit_rate: float
    weights_version: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., in_flight: _Optional[int] = ..., kv_usage: _Optional[float] = ..., cache_hit_tokens: _Optional[int] = ..., cache_query_tokens: _Optional[int] = ..., cache_hit_rate: _Optional[float] = ..., weights_version: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., resident_adapters: _Optional[_Iterable[str]] = ...) -> None: ...
