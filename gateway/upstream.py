"""How the gateway reaches the draft and verify services: unary calls for a session's start and end,
and per-session round links for its rounds, over the fast path when both sides share the host
(specsplit.serving.fastpath) and over one gRPC stream per session otherwise. Every failure becomes a
Failure naming the service."""

from __future__ import annotations

import asyncio
import logging

import grpc

from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc
from specsplit.errors import Failure
from specsplit.serving.fastpath import FastLink

log = logging.getLogger("specsplit.gateway")


def failure(e: grpc.aio.AioRpcError, service: str) -> Failure:
    code = e.code()
    if code == grpc.StatusCode.NOT_FOUND:
        # The backend lost our session (restarted, or evicted it as idle): the request, not the
        # client's input, failed, and a retry starts a new session.
        code = grpc.StatusCode.ABORTED
    return Failure(code, f"{service} service: {e.details()}")


class Deadline:
    """Per-call timeouts: the gateway's per-call limit, bounded by what is left of the client's."""

    # A prefill's limit grows with its prompt: the per-call limit guards against a stalled backend,
    # never against legal work (a 6,400-token prompt took more than the 60 s default once).
    PREFILL_TOKENS_PER_LIMIT = 512

    def __init__(self, time_remaining, rpc_timeout_s: float):
        self._time_remaining, self._rpc_timeout_s = time_remaining, rpc_timeout_s

    def for_prefill(self, prompt_tokens: int) -> Deadline:
        """The same client deadline, with the per-call limit scaled by the prompt's length."""
        return Deadline(self._time_remaining,
                        self._rpc_timeout_s * max(1.0, prompt_tokens / self.PREFILL_TOKENS_PER_LIMIT))

    def __call__(self) -> float:
        remaining = self._time_remaining()
        return self._rpc_timeout_s if remaining is None else max(0.001, min(remaining, self._rpc_timeout_s))

    def total(self) -> float | None:
        """What is left of the client's deadline (None: none): a session stream's own deadline."""
        return self._time_remaining()


class StreamLink:
    """A session's rounds on one gRPC stream (VerifyStream / ProposeStream): answers in order."""

    def __init__(self, open_stream, service: str, deadline: Deadline):
        self._stream = open_stream(timeout=deadline.total())
        self._service, self._deadline = service, deadline
        self._unread = 0  # answers to calls whose caller gave up: read and dropped first

    async def call(self, request):
        try:
            async with asyncio.timeout(self._deadline()):
                await self._stream.write(request)
                self._unread += 1
                while True:
                    response = await self._stream.read()
                    self._unread -= 1
                    if response is grpc.aio.EOF:
                        raise Failure(grpc.StatusCode.UNAVAILABLE, f"{self._service} service: stream ended")
                    if self._unread == 0:
                        return response
        except TimeoutError:
            raise Failure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self._service} service: no answer in time") from None
        except grpc.aio.AioRpcError as e:
            raise failure(e, self._service) from None

    def close(self) -> None:
        self._stream.cancel()


class FastSessionLink:
    """A session's rounds on the gateway's shared fast-path connection to a service."""

    def __init__(self, link: FastLink, response_type, deadline: Deadline):
        self._link, self._type, self._deadline = link, response_type, deadline

    async def call(self, request):
        return await self._link.call(request, self._type, self._deadline())

    def close(self) -> None:
        pass  # the connection is shared by all sessions


class Upstream:
    """The gateway's fast-path connections, and the session releases still running after their
    request answered."""

    def __init__(self):
        self._fast: dict[str, FastLink] = {}
        self._opening: dict[str, asyncio.Future] = {}
        self._releases: set[asyncio.Task] = set()

    async def call(self, method, request, service: str, deadline: Deadline):
        try:
            return await method(request, timeout=deadline())
        except grpc.aio.AioRpcError as e:
            raise failure(e, service) from None

    async def verify_link(self, verifier: vpb_grpc.VerifierStub, fast_path: str, deadline: Deadline):
        """The session's round link to its verify replica: the fast path it offered, else a stream."""
        if fast_path:
            return FastSessionLink(await self._fast_link(fast_path, "verify"), vpb.VerifyResponse, deadline)
        return StreamLink(verifier.VerifyStream, "verify", deadline)

    async def draft_link(self, drafter: dpb_grpc.DrafterStub, fast_path: str, deadline: Deadline):
        """The session's round link to its draft replica: the fast path it offered, else a stream."""
        if fast_path:
            return FastSessionLink(await self._fast_link(fast_path, "draft"), dpb.ProposeResponse, deadline)
        return StreamLink(drafter.ProposeStream, "draft", deadline)

    async def _fast_link(self, path: str, service: str) -> FastLink:
        """The open connection to `path`, (re)opened once however many sessions ask at once."""
        link = self._fast.get(path)
        if link is not None and not link.closed:
            return link
        opening = self._opening.get(path)
        if opening is None:
            opening = self._opening[path] = asyncio.ensure_future(FastLink.open(path, service))
        try:
            link = await asyncio.shield(opening)
        except OSError as e:
            raise Failure(grpc.StatusCode.UNAVAILABLE, f"{service} service: fast path {path}: {e}") from None
        finally:
            self._opening.pop(path, None)
        for old in [p for p, known in self._fast.items() if known.closed]:
            del self._fast[old]  # a restarted service listens on a new path
        self._fast[path] = link
        return link

    def in_background(self, work) -> None:
        """Runs `work` (a session's release) without the answer waiting for it."""
        task = asyncio.ensure_future(work)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def drain(self, timeout_s: float) -> None:
        """Lets the releases still running finish (graceful shutdown, before the channels close)."""
        if self._releases:
            await asyncio.wait(set(self._releases), timeout=timeout_s)

    def close(self) -> None:
        for link in self._fast.values():
            link.close()
