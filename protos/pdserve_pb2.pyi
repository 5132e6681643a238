from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens", "logit_bias", "prompt_logprobs", "min_tokens", "include_stop_str_in_output", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    skip_special_tokens: bool
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    min_tokens: int
    include_stop_str_in_output: bool
    structured: StructuredOutput
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("request_id", "prefill_worker_id", "transport", "address", "block_ids", "num_tokens", "layout", "checksums", "block_hashes", "lease_expires_unix_ms", "fingerprint", "release_address", "streaming")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_worker_id: str
    transport: str
    address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    layout: KVLayout
    checksums: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    lease_expires_unix_ms: int
    fingerprint: str
    release_address: str
    streaming: bool
    def __init__(self, request_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., transport: _Optional[str] = ..., address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., checksums: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., lease_expires_unix_ms: _Optional[int] = ..., fingerprint: _Optional[str] = ..., release_address: _Optional[str] = ..., streaming: _Optional[bool] = ...) -> None: ...

class PhaseTimings(_message.Message):
    __slots__ = ("queue_s", "compute_s", "transfer_s", "transfer_exposed_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_EXPOSED_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    compute_s: float
    transfer_s: float
    transfer_exposed_s: float
    def __init__(self, queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., transfer_exposed_s: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("entries", "rank")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, entries: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("kv", "done")
    KV_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    kv: KVHandle
    done: PrefillResponse
    def __init__(self, kv: _Optional[_Union[KVHandle, _Mapping]] = ..., done: _Optional[_Union[PrefillResponse, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "logprobs", "kv", "finish_reason", "num_cached_tokens", "first_text", "timings", "stop_string", "stop_token_id", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprobs: TokenLogprobs
    kv: KVHandle
    finish_reason: str
    num_cached_tokens: int
    first_text: str
    timings: PhaseTimings
    stop_string: str
    stop_token_id: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, first_token: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., first_text: _Optional[str] = ..., timings: _Optional[_Union[PhaseTimings, _Mapping]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("renewed", "lease_expires_unix_ms")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    renewed: bool
    lease_expires_unix_ms: int
    def __init__(self, renewed: _Optional[bool] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "first_token", "first_logprobs", "kv", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    first_token: int
    first_logprobs: TokenLogprobs
    kv: KVHandle
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., first_token: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs", "finish_reason", "stop_string", "stop_token_id", "num_prompt_tokens", "num_cached_tokens", "kv_source", "timings", "prompt_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    stop_string: str
    stop_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_source: str
    timings: PhaseTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., kv_source: _Optional[str] = ..., timings: _Optional[_Union[PhaseTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...
