from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_ROLE_UNSPECIFIED: _ClassVar[KVRole]
    KV_ROLE_PRODUCE: _ClassVar[KVRole]
    KV_ROLE_CONSUME: _ClassVar[KVRole]
KV_ROLE_UNSPECIFIED: KVRole
KV_ROLE_PRODUCE: KVRole
KV_ROLE_CONSUME: KVRole

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "structured_outputs", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    n: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    structured_outputs: StructuredOutputs
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    truncate_prompt_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., n: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("role", "transfer_id", "producer_address", "num_full_blocks", "block_hashes", "block_size", "compat_hash", "lease_seconds")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_FULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    role: KVRole
    transfer_id: str
    producer_address: str
    num_full_blocks: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    compat_hash: str
    lease_seconds: float
    def __init__(self, role: _Optional[_Union[KVRole, str]] = ..., transfer_id: _Optional[str] = ..., producer_address: _Optional[str] = ..., num_full_blocks: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., compat_hash: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling_params", "cache_salt", "kv_transfer_params", "add_special_tokens", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling_params: SamplingParams
    cache_salt: str
    kv_transfer_params: KVTransferParams
    add_special_tokens: bool
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., kv_transfer_params: _Optional[_Union[KVTransferParams, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., priority: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("index", "finish_reason", "stop_token_id", "stop_string", "prompt_tokens", "completion_tokens", "cached_tokens", "prompt_token_ids", "kv_transfer_params")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    index: int
    finish_reason: str
    stop_token_id: int
    stop_string: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_transfer_params: KVTransferParams
    def __init__(self, index: _Optional[int] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., kv_transfer_params: _Optional[_Union[KVTransferParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "complete")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    complete: Complete
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("served_model_name", "model_name", "max_model_len", "vocab_size", "block_size", "compat_hash", "max_logprobs", "eos_token_ids")
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    served_model_name: str
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    compat_hash: str
    max_logprobs: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, served_model_name: _Optional[str] = ..., model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., compat_hash: _Optional[str] = ..., max_logprobs: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_usage", "kv_role", "num_exports", "num_waiting_for_kv", "kv_free_blocks", "kv_total_blocks", "healthy")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_role: str
    num_exports: int
    num_waiting_for_kv: int
    kv_free_blocks: int
    kv_total_blocks: int
    healthy: bool
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., kv_role: _Optional[str] = ..., num_exports: _Optional[int] = ..., num_waiting_for_kv: _Optional[int] = ..., kv_free_blocks: _Optional[int] = ..., kv_total_blocks: _Optional[int] = ..., healthy: _Optional[bool] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("transfer_id", "first_block", "num_blocks", "compat_hash")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    first_block: int
    num_blocks: int
    compat_hash: str
    def __init__(self, transfer_id: _Optional[str] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., compat_hash: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("dtype", "shape", "offset", "data", "total_bytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    total_bytes: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("found", "lease_remaining_s")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    found: bool
    lease_remaining_s: float
    def __init__(self, found: _Optional[bool] = ..., lease_remaining_s: _Optional[float] = ...) -> None: ...
