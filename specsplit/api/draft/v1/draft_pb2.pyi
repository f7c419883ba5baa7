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

class DrafterInfo(_message.Message):
    __slots__ = ("name", "kind", "model_id", "tokenizer_fingerprint", "param_bytes", "dtype", "device", "needs_features", "target_model_fingerprint", "memory_bytes", "draft_ns_per_token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    model_id: str
    tokenizer_fingerprint: str
    param_bytes: int
    dtype: str
    device: str
    needs_features: bool
    target_model_fingerprint: str
    memory_bytes: int
    draft_ns_per_token: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., model_id: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., param_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., needs_features: _Optional[bool] = ..., target_model_fingerprint: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., draft_ns_per_token: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("drafters", "default_drafter", "active_sessions", "max_sessions")
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterInfo]
    default_drafter: str
    active_sessions: int
    max_sessions: int
    def __init__(self, drafters: _Optional[_Iterable[_Union[DrafterInfo, _Mapping]]] = ..., default_drafter: _Optional[str] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ...) -> None: ...

class StartSessionRequest(_message.Message):
    __slots__ = ("session_id", "drafter", "prompt_token_ids", "target_tokenizer_fingerprint", "target_model_fingerprint", "sampling", "shm_segment", "target_forward_ms_by_rows", "task_type")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARD_MS_BY_ROWS_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    drafter: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    target_tokenizer_fingerprint: str
    target_model_fingerprint: str
    sampling: _common_pb2.Sampling
    shm_segment: str
    target_forward_ms_by_rows: _containers.RepeatedScalarFieldContainer[float]
    task_type: str
    def __init__(self, session_id: _Optional[str] = ..., drafter: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., target_tokenizer_fingerprint: _Optional[str] = ..., target_model_fingerprint: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., shm_segment: _Optional[str] = ..., target_forward_ms_by_rows: _Optional[_Iterable[float]] = ..., task_type: _Optional[str] = ...) -> None: ...

class StartSessionResponse(_message.Message):
    __slots__ = ("drafter", "prefill_ns", "shm_nonce", "fast_path")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    prefill_ns: int
    shm_nonce: bytes
    fast_path: str
    def __init__(self, drafter: _Optional[str] = ..., prefill_ns: _Optional[int] = ..., shm_nonce: _Optional[bytes] = ..., fast_path: _Optional[str] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "base_length", "new_token_ids", "gamma", "features", "tree_budget")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_length: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    gamma: int
    features: _common_pb2.Features
    tree_budget: int
    def __init__(self, session_id: _Optional[str] = ..., base_length: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., gamma: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., tree_budget: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_token_ids", "draft_ns", "source", "draft_probs", "draft_probs_shm", "draft_parents", "draft_scores")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_SHM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SCORES_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_ns: int
    source: str
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseProbs]
    draft_probs_shm: _common_pb2.ShmRef
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    draft_scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., draft_ns: _Optional[int] = ..., source: _Optional[str] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseProbs, _Mapping]]] = ..., draft_probs_shm: _Optional[_Union[_common_pb2.ShmRef, _Mapping]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., draft_scores: _Optional[_Iterable[float]] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id", "base_length", "new_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_length: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., base_length: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("ended",)
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ended: bool
    def __init__(self, ended: _Optional[bool] = ...) -> None: ...
