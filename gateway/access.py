"""Who may call the gateway: an optional bearer token, and a cap on each client's requests in flight.
Health and reflection stay open (orchestrators probe them without credentials)."""

from __future__ import annotations

import hmac
from collections import Counter, namedtuple
from pathlib import Path

import grpc

from specsplit.errors import Failure, UsageError

OPEN_PREFIXES = ("/grpc.health", "/grpc.reflection")


def read_token(path: str) -> str:
    """The token in `path` (surrounding whitespace dropped); an empty file is a mistake, not "no auth"."""
    token = Path(path).read_text().strip()
    if not token:
        raise UsageError(f"{path}: the auth token file is empty")
    return token


class _CallDetails(namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                               "compression")), grpc.ClientCallDetails):
    pass


class SendToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """The client side of BearerAuth: every call on a (blocking) channel carries the token."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._header], d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def with_token(channel: grpc.Channel, token_file: str | None) -> grpc.Channel:
    """`channel`, sending the bearer token in `token_file` with every call (None: as it is)."""
    return grpc.intercept_channel(channel, SendToken(read_token(token_file))) if token_file else channel


class BearerAuth(grpc.aio.ServerInterceptor):
    """Calls must carry `authorization: Bearer <token>` (compared in constant time), else
    UNAUTHENTICATED."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        return _refusal(handler, "missing or wrong bearer token (metadata 'authorization: Bearer <token>')")


def _refusal(handler, message: str):
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a server-streaming handler is

    if handler is None:
        return None
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                    handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


def client_of(context: grpc.aio.ServicerContext) -> str:
    """A client's identity for the per-client cap: its address without the port ("unix:" for every
    caller on a UNIX socket, which are all local)."""
    peer = context.peer() or "unknown"
    if peer.startswith("ipv6:"):
        return peer.rsplit("]:", 1)[0] + "]" if "]" in peer else peer
    if peer.startswith("ipv4:"):
        return peer.rsplit(":", 1)[0]
    return peer.split(":", 1)[0] + ":"


class ClientCap:
    """At most `limit` sessions (Generate calls in flight) per client (0: no cap)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._inflight: Counter[str] = Counter()

    def enter(self, client: str) -> None:
        if self.limit and self._inflight[client] >= self.limit:
            raise Failure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"client {client} already has {self._inflight[client]} sessions open; this "
                          f"gateway allows {self.limit} per client (--max-sessions-per-client)")
        self._inflight[client] += 1

    def leave(self, client: str) -> None:
        self._inflight[client] -= 1
        if self._inflight[client] <= 0:
            del self._inflight[client]
