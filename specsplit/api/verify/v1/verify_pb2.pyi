from specsplit.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "vocab_size", "tokenizer_fingerprint", "max_context", "dtype", "device", "exact", "eos_token_ids", "active_sessions", "max_sessions", "param_bytes", "model_fingerprint", "hidden_size", "tree_verify", "forward_ms_by_rows", "active_prefills", "head_model_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    TREE_VERIFY_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_BY_ROWS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    HEAD_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_context: int
    dtype: str
    device: str
    exact: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    active_sessions: int
    max_sessions: int
    param_bytes: int
    model_fingerprint: str
    hidden_size: int
    tree_verify: bool
    forward_ms_by_rows: _containers.RepeatedScalarFieldContainer[float]
    active_prefills: int
    head_model_id: str
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., exact: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., param_bytes: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., hidden_size: _Optional[int] = ..., tree_verify: _Optional[bool] = ..., forward_ms_by_rows: _Optional[_Iterable[float]] = ..., active_prefills: _Optional[int] = ..., head_model_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "return_features", "sampling", "shm_segment", "skip_prefix_cache", "logprobs", "stop_token_ids", "resume", "constraint", "output_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SKIP_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_features: bool
    sampling: _common_pb2.Sampling
    shm_segment: str
    skip_prefix_cache: bool
    logprobs: _common_pb2.LogprobsRequest
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume: bool
    constraint: _common_pb2.Constraint
    output_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., return_features: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., shm_segment: _Optional[str] = ..., skip_prefix_cache: _Optional[bool] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobsRequest, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., resume: _Optional[bool] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("next_token_id", "length", "forward_ns", "features", "shm_nonce", "fast_path", "batch_rows", "batch_calls", "cached_tokens", "chunks", "logprobs", "prompt_logprobs")
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_CALLS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    next_token_id: int
    length: int
    forward_ns: int
    features: _common_pb2.Features
    shm_nonce: bytes
    fast_path: str
    batch_rows: int
    batch_calls: int
    cached_tokens: int
    chunks: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, next_token_id: _Optional[int] = ..., length: _Optional[int] = ..., forward_ns: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., shm_nonce: _Optional[bytes] = ..., fast_path: _Optional[str] = ..., batch_rows: _Optional[int] = ..., batch_calls: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., chunks: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "length", "draft_token_ids", "draft_probs", "draft_probs_shm", "draft_parents", "decode_ahead", "lookup_gamma", "forced_room", "head_gamma")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_SHM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_GAMMA_FIELD_NUMBER: _ClassVar[int]
    FORCED_ROOM_FIELD_NUMBER: _ClassVar[int]
    HEAD_GAMMA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseProbs]
    draft_probs_shm: _common_pb2.ShmRef
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    decode_ahead: int
    lookup_gamma: int
    forced_room: int
    head_gamma: int
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseProbs, _Mapping]]] = ..., draft_probs_shm: _Optional[_Union[_common_pb2.ShmRef, _Mapping]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., decode_ahead: _Optional[int] = ..., lookup_gamma: _Optional[int] = ..., forced_room: _Optional[int] = ..., head_gamma: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "length", "forward_ns", "features", "accepted_indices", "batch_rows", "batch_calls", "logprobs", "decoded_token_ids", "lookup_drafted", "lookup_accepted", "lookup_steps", "forced", "constraint_complete", "verified_draft_ids", "forced_accepted", "head_drafted", "head_accepted", "head_steps", "head_ns")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_INDICES_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECODED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HEAD_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    HEAD_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HEAD_STEPS_FIELD_NUMBER: _ClassVar[int]
    HEAD_NS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    length: int
    forward_ns: int
    features: _common_pb2.Features
    accepted_indices: _containers.RepeatedScalarFieldContainer[int]
    batch_rows: int
    batch_calls: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    decoded_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lookup_drafted: int
    lookup_accepted: int
    lookup_steps: int
    forced: int
    constraint_complete: bool
    verified_draft_ids: _containers.RepeatedScalarFieldContainer[int]
    forced_accepted: int
    head_drafted: int
    head_accepted: int
    head_steps: int
    head_ns: int
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., length: _Optional[int] = ..., forward_ns: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., accepted_indices: _Optional[_Iterable[int]] = ..., batch_rows: _Optional[int] = ..., batch_calls: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., decoded_token_ids: _Optional[_Iterable[int]] = ..., lookup_drafted: _Optional[int] = ..., lookup_accepted: _Optional[int] = ..., lookup_steps: _Optional[int] = ..., forced: _Optional[int] = ..., constraint_complete: _Optional[bool] = ..., verified_draft_ids: _Optional[_Iterable[int]] = ..., forced_accepted: _Optional[int] = ..., head_drafted: _Optional[int] = ..., head_accepted: _Optional[int] = ..., head_steps: _Optional[int] = ..., head_ns: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
