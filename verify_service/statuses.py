"""The verify service's errors as the gRPC statuses its callers act on."""

from __future__ import annotations

import grpc

from specsplit.errors import Failure
from specsplit.model.fastllama import CacheFull
from specsplit.serving.sessions import SessionNotFound
from verify_service.steps import ContextFull, LengthMismatch


def failure(e: BaseException) -> BaseException:
    """A round's error as the status its caller can act on (others pass through: bugs)."""
    if isinstance(e, Failure):
        return e
    if isinstance(e, SessionNotFound):
        return Failure(grpc.StatusCode.NOT_FOUND, f"unknown session {e}")
    for kind, code in ((LengthMismatch, grpc.StatusCode.FAILED_PRECONDITION),
                       (ContextFull, grpc.StatusCode.OUT_OF_RANGE), (CacheFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
                       (ValueError, grpc.StatusCode.INVALID_ARGUMENT)):
        if isinstance(e, kind):
            return Failure(code, str(e))
    return e
