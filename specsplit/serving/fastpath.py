"""The co-located round path: the same request and response messages as the gRPC streams, framed
on a UNIX socket that the service's worker thread serves directly (docs/protocol.md#fast-path).

A service with shared memory on listens on `specsplit-fast-<pid>-<random>.sock` in the shared-memory
directory (0600) and names it in its Prefill/StartSession answer, but only to a gateway whose
segment it mapped (so both sides are proven to share the host). The gateway keeps one connection
per service for all its sessions. An answer carries its request's call id: a call that takes
several forwards (a Verify that decodes ahead) is answered after calls sent later.

Frame: u32 body length, u8 kind, u32 call id, body. A request's kind is 0 and its body the serialized
request; an answer's kind is 0 (body: the serialized response) or 1 (an error: u8 gRPC status code,
then the message in UTF-8), and its call id is its request's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import grpc

from specsplit.errors import Failure
from specsplit.serving import hops, shm
from specsplit.serving.worker import ModelWorker

log = logging.getLogger("specsplit")

HEAD = struct.Struct("<IBI")
OK, ERROR = 0, 1
MAX_FRAME = 64 * 1024 * 1024  # as the gRPC message limit
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def frame(kind: int, body: bytes, call: int = 0) -> bytes:
    return HEAD.pack(len(body), kind, call) + body


def error_frame(failure: Failure, call: int) -> bytes:
    return frame(ERROR, bytes([failure.code.value[0]]) + failure.message.encode()[:4096], call)


class _Frames:
    """Splits a byte stream into (kind, call id, body) frames."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        self._buffer += data
        out = []
        while len(self._buffer) >= HEAD.size:
            length, kind, call = HEAD.unpack_from(self._buffer)
            if length > MAX_FRAME:
                raise ValueError(f"a frame of {length} bytes exceeds {MAX_FRAME}")
            end = HEAD.size + length
            if len(self._buffer) < end:
                break
            out.append((kind, call, bytes(self._buffer[HEAD.size:end])))
            del self._buffer[:end]
        return out


class FastPathServer:
    """Serves `handler(request bytes, reply)` on the worker thread; reply(response bytes or the
    exception) answers, now or from a later batch."""

    def __init__(self, worker: ModelWorker, handler: Callable[[bytes, Callable], None], name: str):
        self._worker, self._handler = worker, handler
        self._received, self._answers = f"{name}.received", f"{name}.answers"  # hop marks
        self.path = shm.shm_dir() / f"specsplit-fast-{os.getpid()}-{secrets.token_hex(4)}.sock"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # 0600 from the start: only this user may connect
        try:
            self._listener.bind(str(self.path))
        except OSError:
            self._listener.close()
            raise
        finally:
            os.umask(old)
        self._listener.listen(64)
        self._listener.setblocking(False)
        worker.watch(self._listener, self._accept)
        log.info("%s fast path on %s", name, self.path)

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        conn.settimeout(5.0)  # a peer that stops reading cannot hold the worker for longer
        frames = _Frames()
        self._worker.watch(conn, lambda c: self._serve(c, frames))

    def _serve(self, conn: socket.socket, frames: _Frames) -> None:
        try:
            data = conn.recv(1 << 16)
            if not data:
                raise ConnectionResetError("peer closed")
            hops.mark(self._received)
            for _, call, body in frames.feed(data):
                try:
                    self._handler(body, lambda outcome, call=call: self._answer(conn, call, outcome))
                except Exception as e:  # an unreadable request: answered at once
                    self._answer(conn, call, e)
        except (OSError, ValueError) as e:
            self._drop(conn, e)

    def _answer(self, conn: socket.socket, call: int, outcome) -> None:
        if isinstance(outcome, Failure):
            answer = error_frame(outcome, call)
        elif isinstance(outcome, BaseException):  # a bug: the caller gets INTERNAL, the service keeps serving
            log.error("fast-path request failed: %r", outcome)
            answer = error_frame(Failure(grpc.StatusCode.INTERNAL, f"{type(outcome).__name__}: {outcome}"), call)
        else:
            answer = frame(OK, outcome, call)
        if conn.fileno() < 0:
            return  # dropped meanwhile
        hops.mark(self._answers)
        try:
            conn.sendall(answer)
        except OSError as e:
            self._drop(conn, e)

    def _drop(self, conn: socket.socket, e: Exception) -> None:
        if conn.fileno() < 0:
            return
        if not isinstance(e, ConnectionResetError):
            log.warning("fast-path connection dropped: %s", e)
        self._worker.unwatch(conn)
        conn.close()

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def offer(worker: ModelWorker, handler: Callable[[bytes, Callable], None], name: str,
          enabled: bool) -> FastPathServer | None:
    """A fast path for a service with shared memory on, or None (rounds then use the gRPC streams)
    when it is off or the socket cannot be made (e.g. a SPECSPLIT_SHM_DIR too long for a socket path)."""
    if not enabled or not shm.available():
        return None
    try:
        return FastPathServer(worker, handler, name)
    except OSError as e:
        log.warning("%s: no fast path (%s); rounds use the gRPC stream", name, e)
        return None


def reclaim_stale() -> list[str]:
    """Removes fast-path sockets nobody listens on (a service killed before it could remove its own)."""
    removed = []
    for path in shm.shm_dir().glob("specsplit-fast-*.sock"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
        except OSError:
            pass
        finally:
            probe.close()
    return removed


class FastLink(asyncio.Protocol):
    """The gateway's connection to one service's fast path; `call` from any number of sessions."""

    def __init__(self, service: str):
        self.service = service
        self._sent, self._back = f"gateway.to-{service}", f"gateway.from-{service}"  # hop marks
        self._frames = _Frames()
        self._waiting: dict[int, asyncio.Future] = {}  # by call id
        self._calls = 0  # the next call id
        self._transport: asyncio.Transport | None = None
        self.closed = False

    @classmethod
    async def open(cls, path: str | Path, service: str) -> FastLink:
        link = cls(service)
        await asyncio.get_running_loop().create_unix_connection(lambda: link, str(path))
        return link

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._frames.feed(data)
        except ValueError as e:
            self._transport.abort()
            self._fail_all(f"bad frame: {e}")
            return
        for kind, call, body in frames:
            waiter = self._waiting.pop(call, None)
            if waiter is None:  # the stream is out of step: nothing after this can be trusted
                self._transport.abort()
                self._fail_all("an answer nobody asked for")
                return
            if waiter.done():  # its caller gave up (deadline, cancellation): drop the late answer
                continue
            if kind == OK:
                waiter.set_result(body)
            elif not body:
                waiter.set_exception(Failure(grpc.StatusCode.UNKNOWN, f"{self.service} service: an error with no "
                                                                      "status or message"))
            else:
                code = _CODES.get(body[0], grpc.StatusCode.UNKNOWN)
                waiter.set_exception(Failure(code, f"{self.service} service: {body[1:].decode(errors='replace')}"))

    def connection_lost(self, exc) -> None:
        self._fail_all(f"fast path closed ({exc or 'by the service'})")

    def _fail_all(self, why: str) -> None:
        self.closed = True
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not waiter.done():
                waiter.set_exception(Failure(grpc.StatusCode.UNAVAILABLE, f"{self.service} service: {why}"))

    async def call(self, request, response_type, timeout: float):
        """Sends one request and waits for its answer (at most `timeout` seconds)."""
        if self.closed:
            raise Failure(grpc.StatusCode.UNAVAILABLE, f"{self.service} service: fast path closed")
        waiter = asyncio.get_running_loop().create_future()
        call, self._calls = self._calls, (self._calls + 1) & 0xFFFFFFFF
        self._waiting[call] = waiter  # kept after a timeout: the late answer is read and dropped
        hops.mark(self._sent)
        self._transport.write(frame(OK, request.SerializeToString(), call))
        try:
            async with asyncio.timeout(timeout):
                body = await waiter
        except TimeoutError:
            raise Failure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.service} service: no answer in "
                                                             f"{timeout:.3f} s") from None
        hops.mark(self._back)
        return response_type.FromString(body)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
