"""The one error type that crosses our boundaries: a failure with the gRPC status code a caller can
act on. Services raise it from request handlers, the fast path carries it in an error frame, and the
gateway raises it for requests it refuses and for upstream calls that failed."""

from __future__ import annotations

import grpc


class Failure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code

    @property
    def message(self) -> str:
        return str(self)


class UsageError(ValueError):
    """A bad flag or input file: the CLI prints one line naming what and where, and exits 2."""
