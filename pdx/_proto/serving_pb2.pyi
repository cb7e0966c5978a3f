from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "seed", "ignore_eos", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "want_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WANT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    seed: int
    ignore_eos: bool
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: int
    want_logprobs: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., want_logprobs: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "codec", "kv_start_token", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    KV_START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    codec: str
    kv_start_token: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., codec: _Optional[str] = ..., kv_start_token: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("kv_id", "first_token", "kv_endpoint", "kv_bytes", "kv_raw_bytes", "prefill_ms", "store_ms", "queue_ms", "model_version", "codec", "kv_overlap_bytes", "kv_overlap_ms", "kv_streamed", "cached_tokens", "kv_start_token")
    KV_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    KV_OVERLAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_OVERLAP_MS_FIELD_NUMBER: _ClassVar[int]
    KV_STREAMED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    kv_id: str
    first_token: int
    kv_endpoint: str
    kv_bytes: int
    kv_raw_bytes: int
    prefill_ms: float
    store_ms: float
    queue_ms: float
    model_version: str
    codec: str
    kv_overlap_bytes: int
    kv_overlap_ms: float
    kv_streamed: bool
    cached_tokens: int
    kv_start_token: int
    def __init__(self, kv_id: _Optional[str] = ..., first_token: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., kv_raw_bytes: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., store_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., model_version: _Optional[str] = ..., codec: _Optional[str] = ..., kv_overlap_bytes: _Optional[int] = ..., kv_overlap_ms: _Optional[float] = ..., kv_streamed: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., kv_start_token: _Optional[int] = ...) -> None: ...

class PrefillFirstToken(_message.Message):
    __slots__ = ("first_token", "prefill_ms", "queue_ms", "model_version", "first_logprob")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    prefill_ms: float
    queue_ms: float
    model_version: str
    first_logprob: TokenLogprob
    def __init__(self, first_token: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., model_version: _Optional[str] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ...) -> None: ...

class PrefillOpened(_message.Message):
    __slots__ = ("kv_id", "kv_endpoint")
    KV_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    kv_id: str
    kv_endpoint: str
    def __init__(self, kv_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first", "stored", "opened")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    first: PrefillFirstToken
    stored: PrefillReply
    opened: PrefillOpened
    def __init__(self, first: _Optional[_Union[PrefillFirstToken, _Mapping]] = ..., stored: _Optional[_Union[PrefillReply, _Mapping]] = ..., opened: _Optional[_Union[PrefillOpened, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_id", "kv_endpoint", "first_token", "has_first_token", "degrade_reason", "first_token_in_kv", "kv_start_token", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HAS_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DEGRADE_REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IN_KV_FIELD_NUMBER: _ClassVar[int]
    KV_START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_id: str
    kv_endpoint: str
    first_token: int
    has_first_token: bool
    degrade_reason: str
    first_token_in_kv: bool
    kv_start_token: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., first_token: _Optional[int] = ..., has_first_token: _Optional[bool] = ..., degrade_reason: _Optional[str] = ..., first_token_in_kv: _Optional[bool] = ..., kv_start_token: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("route", "degraded", "degrade_reason", "kv_bytes", "transfer_ms", "retries", "queue_ms", "local_prefill_ms", "first_step_ms", "transfer_outcome", "instance", "kv_streamed", "kv_wait_ms", "kv_bytes_while_writing", "cached_tokens", "computed_tokens", "local_prefill_compute_ms")
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADE_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    KV_STREAMED_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_WHILE_WRITING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    route: str
    degraded: bool
    degrade_reason: str
    kv_bytes: int
    transfer_ms: float
    retries: int
    queue_ms: float
    local_prefill_ms: float
    first_step_ms: float
    transfer_outcome: str
    instance: str
    kv_streamed: bool
    kv_wait_ms: float
    kv_bytes_while_writing: int
    cached_tokens: int
    computed_tokens: int
    local_prefill_compute_ms: float
    def __init__(self, route: _Optional[str] = ..., degraded: _Optional[bool] = ..., degrade_reason: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., retries: _Optional[int] = ..., queue_ms: _Optional[float] = ..., local_prefill_ms: _Optional[float] = ..., first_step_ms: _Optional[float] = ..., transfer_outcome: _Optional[str] = ..., instance: _Optional[str] = ..., kv_streamed: _Optional[bool] = ..., kv_wait_ms: _Optional[float] = ..., kv_bytes_while_writing: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., local_prefill_compute_ms: _Optional[float] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "stats", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeStatusReply(_message.Message):
    __slots__ = ("healthy", "queue_depth", "running", "max_batch", "max_queue", "kv_budget_bytes", "kv_free_bytes", "model_version", "instance", "vocab_size", "max_context_tokens", "prefill_tflops", "kv_bytes_per_token", "prefix_cache_bytes", "prefix_block_tokens")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TFLOPS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    queue_depth: int
    running: int
    max_batch: int
    max_queue: int
    kv_budget_bytes: int
    kv_free_bytes: int
    model_version: str
    instance: str
    vocab_size: int
    max_context_tokens: int
    prefill_tflops: float
    kv_bytes_per_token: float
    prefix_cache_bytes: int
    prefix_block_tokens: int
    def __init__(self, healthy: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_queue: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., kv_free_bytes: _Optional[int] = ..., model_version: _Optional[str] = ..., instance: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., prefill_tflops: _Optional[float] = ..., kv_bytes_per_token: _Optional[float] = ..., prefix_cache_bytes: _Optional[int] = ..., prefix_block_tokens: _Optional[int] = ...) -> None: ...

class CacheEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared", "block_tokens")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    cleared: bool
    block_tokens: int
    def __init__(self, stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., cleared: _Optional[bool] = ..., block_tokens: _Optional[int] = ...) -> None: ...
