from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Features(_message.Message):
    __slots__ = ("start", "rows", "dim", "dtype", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: int
    rows: int
    dim: int
    dtype: str
    data: bytes
    def __init__(self, start: _Optional[int] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...
