from specsplit.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Speculation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_UNSPECIFIED: _ClassVar[Speculation]
    SPECULATION_AUTO: _ClassVar[Speculation]
    SPECULATION_ON: _ClassVar[Speculation]
    SPECULATION_OFF: _ClassVar[Speculation]

class Predraft(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREDRAFT_DEFAULT: _ClassVar[Predraft]
    PREDRAFT_ON: _ClassVar[Predraft]
    PREDRAFT_OFF: _ClassVar[Predraft]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]
SPECULATION_UNSPECIFIED: Speculation
SPECULATION_AUTO: Speculation
SPECULATION_ON: Speculation
SPECULATION_OFF: Speculation
PREDRAFT_DEFAULT: Predraft
PREDRAFT_ON: Predraft
PREDRAFT_OFF: Predraft
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_CONTEXT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("ignore_eos", "stop_strings")
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    ignore_eos: bool
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ignore_eos: _Optional[bool] = ..., stop_strings: _Optional[_Iterable[str]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "method")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    method: _common_pb2.VerifyMethod
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., method: _Optional[_Union[_common_pb2.VerifyMethod, str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "max_new_tokens", "stop", "sampling", "speculation", "gamma", "drafter", "task_type", "predraft", "tree_budget", "skip_prefix_cache", "logprobs", "constraint")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SKIP_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    max_new_tokens: int
    stop: StopConditions
    sampling: SamplingParams
    speculation: Speculation
    gamma: int
    drafter: str
    task_type: str
    predraft: Predraft
    tree_budget: int
    skip_prefix_cache: bool
    logprobs: _common_pb2.LogprobsRequest
    constraint: _common_pb2.Constraint
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Union[StopConditions, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[Speculation, str]] = ..., gamma: _Optional[int] = ..., drafter: _Optional[str] = ..., task_type: _Optional[str] = ..., predraft: _Optional[_Union[Predraft, str]] = ..., tree_budget: _Optional[int] = ..., skip_prefix_cache: _Optional[bool] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobsRequest, _Mapping]] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ...) -> None: ...

class RoundRecord(_message.Message):
    __slots__ = ("drafted", "accepted", "draft_ms", "verify_ms", "network_ms", "round_ms", "draft_source", "feature_bytes", "proposal_bytes", "predrafted", "gateway_ms", "depth", "expected", "batch_rows", "batch_calls", "decoded", "lookup_drafted", "lookup_accepted", "lookup_steps", "forced", "forced_accepted", "asked", "copy_in_sight", "head_drafted", "head_accepted", "head_steps")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_MS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_CALLS_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ASKED_FIELD_NUMBER: _ClassVar[int]
    COPY_IN_SIGHT_FIELD_NUMBER: _ClassVar[int]
    HEAD_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    HEAD_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HEAD_STEPS_FIELD_NUMBER: _ClassVar[int]
    drafted: int
    accepted: int
    draft_ms: float
    verify_ms: float
    network_ms: float
    round_ms: float
    draft_source: str
    feature_bytes: int
    proposal_bytes: int
    predrafted: bool
    gateway_ms: float
    depth: int
    expected: float
    batch_rows: int
    batch_calls: int
    decoded: int
    lookup_drafted: int
    lookup_accepted: int
    lookup_steps: int
    forced: int
    forced_accepted: int
    asked: bool
    copy_in_sight: bool
    head_drafted: int
    head_accepted: int
    head_steps: int
    def __init__(self, drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., network_ms: _Optional[float] = ..., round_ms: _Optional[float] = ..., draft_source: _Optional[str] = ..., feature_bytes: _Optional[int] = ..., proposal_bytes: _Optional[int] = ..., predrafted: _Optional[bool] = ..., gateway_ms: _Optional[float] = ..., depth: _Optional[int] = ..., expected: _Optional[float] = ..., batch_rows: _Optional[int] = ..., batch_calls: _Optional[int] = ..., decoded: _Optional[int] = ..., lookup_drafted: _Optional[int] = ..., lookup_accepted: _Optional[int] = ..., lookup_steps: _Optional[int] = ..., forced: _Optional[int] = ..., forced_accepted: _Optional[int] = ..., asked: _Optional[bool] = ..., copy_in_sight: _Optional[bool] = ..., head_drafted: _Optional[int] = ..., head_accepted: _Optional[int] = ..., head_steps: _Optional[int] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "prefill_ms", "decode_ms", "total_ms", "rounds", "drafted_tokens", "accepted_tokens", "mean_acceptance_length", "speculation_used", "drafter", "gamma", "draft_ms", "verify_ms", "network_ms", "exact", "task_type", "round_records", "recovered_tokens", "bonus_tokens", "seed", "verify_method", "speculation_reason", "shared_memory", "predraft_attempts", "predraft_hits", "gateway_ms", "fast_path", "prefill_compute_ms", "tree_budget", "prefix_cached_tokens", "prefill_chunks", "resumes", "resume_ms", "forced_tokens", "constraint_complete", "forwards")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_USED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_MS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    ROUND_RECORDS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_METHOD_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_REASON_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_MS_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    RESUME_MS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    prefill_ms: float
    decode_ms: float
    total_ms: float
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float
    speculation_used: bool
    drafter: str
    gamma: int
    draft_ms: float
    verify_ms: float
    network_ms: float
    exact: bool
    task_type: str
    round_records: _containers.RepeatedCompositeFieldContainer[RoundRecord]
    recovered_tokens: int
    bonus_tokens: int
    seed: int
    verify_method: str
    speculation_reason: str
    shared_memory: bool
    predraft_attempts: int
    predraft_hits: int
    gateway_ms: float
    fast_path: bool
    prefill_compute_ms: float
    tree_budget: int
    prefix_cached_tokens: int
    prefill_chunks: int
    resumes: int
    resume_ms: float
    forced_tokens: int
    constraint_complete: bool
    forwards: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., speculation_used: _Optional[bool] = ..., drafter: _Optional[str] = ..., gamma: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., network_ms: _Optional[float] = ..., exact: _Optional[bool] = ..., task_type: _Optional[str] = ..., round_records: _Optional[_Iterable[_Union[RoundRecord, _Mapping]]] = ..., recovered_tokens: _Optional[int] = ..., bonus_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., verify_method: _Optional[str] = ..., speculation_reason: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., predraft_attempts: _Optional[int] = ..., predraft_hits: _Optional[int] = ..., gateway_ms: _Optional[float] = ..., fast_path: _Optional[bool] = ..., prefill_compute_ms: _Optional[float] = ..., tree_budget: _Optional[int] = ..., prefix_cached_tokens: _Optional[int] = ..., prefill_chunks: _Optional[int] = ..., resumes: _Optional[int] = ..., resume_ms: _Optional[float] = ..., forced_tokens: _Optional[int] = ..., constraint_complete: _Optional[bool] = ..., forwards: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logprobs", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logprobs", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
