"""What every specsplit server shares: binding, health, reflection, warm-up, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specsplit.errors import Failure
from specsplit.serving import fastpath, shm
from specsplit.serving.sessions import SessionTable
from specsplit.serving.settings import ClientTLS, ServerSettings
from specsplit.serving.telemetry import record_compute
from specsplit.serving.worker import ModelWorker

log = logging.getLogger("specsplit")

# Token ids and stats only; 64 MiB leaves room for long prompts without allowing abuse.
MESSAGE_LIMIT = 64 * 1024 * 1024
# Keepalive: a split deployment notices a dead peer (or a NAT that dropped the connection) within
# ~40 s instead of at the next call's deadline; servers accept the clients' pings.
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Reconnect backoff: gRPC's default grows to 120 s, so a backend that was down for a minute could
# stay unreachable for two more after it is back (calls fail fast with UNAVAILABLE meanwhile).
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    *KEEPALIVE,
    *RECONNECT,
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS (and with a client CA, mutual TLS) from the settings' PEM files; None: plaintext."""
    if not settings.tls_cert and not settings.tls_key:
        if settings.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (settings.tls_cert and settings.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return grpc.ssl_server_credentials([(_read(settings.tls_key), _read(settings.tls_cert))],
                                       root_certificates=_read(settings.tls_client_ca),
                                       require_client_auth=bool(settings.tls_client_ca))


def channel_credentials(tls: ClientTLS) -> grpc.ChannelCredentials:
    """TLS to a specsplit service from `tls`'s PEM files (with a client certificate: mutual TLS)."""
    if bool(tls.cert) != bool(tls.key):
        raise ValueError("a client certificate needs its key, and the key its certificate")
    return grpc.ssl_channel_credentials(_read(tls.ca), _read(tls.key), _read(tls.cert))


def gateway_client_options() -> list[tuple[str, str]]:
    """Channel options for a client of the gateway: the retry policy it should use (UNAVAILABLE is
    retried with backoff: a gateway restarting, or one with no verify replica serving for a moment;
    a stream is retried only before its first answer). The same file is for clients in any language:
    specsplit/data/gateway-service-config.json."""
    from importlib.resources import files

    return [("grpc.service_config", (files("specsplit.data") / "gateway-service-config.json").read_text())]


def aio_channel(address: str, tls: ClientTLS | None = None, interceptors=(), options=()) -> grpc.aio.Channel:
    """A channel to a specsplit service: plaintext, or TLS/mTLS with `tls`; keepalive either way."""
    options = [*CHANNEL_OPTIONS, *options]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=list(interceptors))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options,
                                   interceptors=list(interceptors))


def unix_path(address: str) -> Path | None:
    """The socket path of a `unix:` address, None for TCP."""
    if address.startswith("unix://"):
        return Path(address[len("unix://"):])
    if address.startswith("unix:"):
        return Path(address[len("unix:"):])
    return None


async def answer(work: Awaitable[Any], context: grpc.aio.ServicerContext) -> Any:
    """A handler's response, or the call aborted with the status of the Failure it raised."""
    try:
        return await work
    except Failure as e:
        await context.abort(e.code, e.message)


class Rounds:
    """A service's round handler offered the three ways a round arrives: a unary call, a session's
    gRPC stream, and fast-path frames. Rounds are gathered on the worker thread (ModelWorker.gather)
    and handed to `run_many(requests) -> outcomes` together (a response, or the Failure raised);
    `rows(request)` is what a round weighs against the batch's row budget."""

    def __init__(self, worker: ModelWorker, run_many: Callable[[list], list], request_type,
                 compute_ns: Callable[[Any], int], rows: Callable[[Any], int] = lambda request: 1):
        self._worker, self._run_many, self._type, self._compute_ns = worker, run_many, request_type, compute_ns
        self._rows = rows
        self.fast_server: fastpath.FastPathServer | None = None

    def open_fast_path(self, name: str, enabled: bool) -> fastpath.FastPathServer | None:
        """Serves the frames on a fast-path socket when shared memory is on and one can be made."""
        self.fast_server = fastpath.offer(self._worker, self.frame, name, enabled)
        return self.fast_server

    @property
    def fast_path(self) -> str:
        """The socket announced to sessions that mapped their segment; empty: none."""
        return str(self.fast_server.path) if self.fast_server else ""

    def _one(self, request):
        return self._worker.run_gathered(self._run_many, request, self._rows(request))

    async def unary(self, request, context):
        response = await answer(self._one(request), context)
        record_compute(self._compute_ns(response))
        return response

    async def stream(self, requests, context):
        async for request in requests:
            yield await answer(self._one(request), context)

    def frame(self, body: bytes, reply: Callable[[Any], None]) -> None:
        """The fast path's handler (on the worker thread): reply(response bytes, or the Failure)."""
        try:
            request = self._type.FromString(body)
        except DecodeError as e:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT,
                          f"undecodable {self._type.DESCRIPTOR.name} ({len(body)} bytes): {e}") from None
        self._worker.gather(self._run_many, request, self._rows(request),
                            lambda outcome: reply(outcome if isinstance(outcome, BaseException)
                                                  else outcome.SerializeToString()))


class Undecodable(grpc.aio.ServerInterceptor):
    """A request that does not parse (bad wire format, a string field that is not UTF-8) gets
    INVALID_ARGUMENT naming the message and the fault, as any other bad input does; gRPC's own
    deserializer would fail it as UNKNOWN ("Unexpected DecodeError"). Unary requests only: a
    stream's messages come from our own clients."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        parse, method = handler.request_deserializer, details.method

        async def parsed(raw: bytes, context):
            try:
                return parse(raw)
            except DecodeError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{method}: the request ({len(raw)} bytes) does not parse: {e}")

        if handler.unary_unary:
            async def unary(raw, context):
                return await handler.unary_unary(await parsed(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)

        async def stream(raw, context):
            answers = handler.unary_stream(await parsed(raw, context), context)
            if hasattr(answers, "__aiter__"):
                async for answer in answers:
                    yield answer
            else:  # a behaviour that writes with context.write()
                await answers

        return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)


async def serve(
    settings: ServerSettings,
    service_name: str,
    register: Callable[[grpc.aio.Server], None],
    warmup: Callable[[], Awaitable[None]] | None = None,
    *,
    sessions: SessionTable | None = None,
    worker: ModelWorker | None = None,
    stop_event: asyncio.Event | None = None,
    handle_signals: bool = True,
    interceptors: list[grpc.aio.ServerInterceptor] = (),
    fast_path: fastpath.FastPathServer | None = None,
    health_monitor: Callable[[Callable[[str, bool], Awaitable[None]]], Awaitable[None]] | None = None,
) -> None:
    """Binds `settings.listen` (`unix:///path.sock` or `host:port`, port 0 picks one), reports
    NOT_SERVING until `warmup` finished, writes the bound address to `settings.address_file`, sweeps
    idle `sessions`, and on SIGINT/SIGTERM (or `stop_event`) flips health to NOT_SERVING, gives
    in-flight calls `settings.grace_s`, then removes the `fast_path` socket and stops the `worker`.
    Once serving, `health_monitor(report)` runs until the stop and reports what it sees with
    `await report(name, serving)` ("" for the server as a whole; the gateway: its backends)."""
    if settings.shared_memory:
        shm.reclaim_stale()  # segments of a gateway that died (SIGKILL) before it could remove them
        fastpath.reclaim_stale()  # and fast-path sockets of a service that did
    credentials = server_credentials(settings)
    # Undecodable outermost: the interceptors inside it (tracing reads the request's size) get messages.
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[Undecodable(), *interceptors])
    register(server)
    checks = Health(server, service_name)
    await checks.report("", False)
    bound, sock = await _bind(server, settings.listen, credentials)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    sweeper = asyncio.create_task(sessions.sweep(sessions.idle_timeout_s / 4)) if sessions is not None else None
    monitor = None
    try:
        if warmup is not None and not await _unless_stopped(warmup(), stop):
            return
        await checks.report("", True)
        if settings.address_file:
            _publish(settings.address_file, bound)
        log.info("%s serving on %s", service_name, bound)
        monitor = asyncio.ensure_future(health_monitor(checks.report)) if health_monitor is not None else None
        await stop.wait()
    finally:
        if monitor is not None:
            monitor.cancel()
        await checks.report("", False)
        if sessions is not None:
            await _drain(sessions, settings.drain_s, service_name)
        await server.stop(settings.grace_s)
        if sweeper is not None:
            sweeper.cancel()
        _close(fast_path, worker, sock)
        for sig in signals:
            loop.remove_signal_handler(sig)
        log.info("%s stopped", service_name)


def _publish(address_file: str, bound: str) -> None:
    """The bound address, written whole (a reader never sees half of it)."""
    tmp = Path(f"{address_file}.tmp")
    tmp.write_text(bound + "\n")
    os.replace(tmp, address_file)


def _close(fast_path: fastpath.FastPathServer | None, worker: ModelWorker | None, sock: Path | None) -> None:
    """After the server stopped: its fast-path socket, its worker thread, its UNIX socket."""
    if fast_path is not None:
        fast_path.close()
    if worker is not None:
        worker.shutdown()
    if sock is not None and sock.exists():
        sock.unlink()


class Health:
    """The server's health service: "" (the server as a whole) and its own service move together;
    a health monitor may report other names (the gateway: its backends)."""

    def __init__(self, server: grpc.aio.Server, service_name: str):
        self.servicer = health.aio.HealthServicer()
        self.service_name = service_name
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection([service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)

    async def report(self, name: str, serving: bool) -> None:
        """A verdict: "" is the server as a whole (and its own service with it)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for each in ("", self.service_name) if name == "" else (name,):
            await self.servicer.set(each, status)


async def _bind(server: grpc.aio.Server, listen: str, credentials) -> tuple[str, Path | None]:
    """Binds and starts the server: (the address bound, port 0 resolved; its UNIX socket or None).
    A UNIX socket's directory is made only this user's, a socket a killed predecessor left is
    removed first (bind would fail on it), and the socket is made 0600 whatever the umask."""
    sock = unix_path(listen)
    if sock is not None:
        sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if sock.exists():
            sock.unlink()
    port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    if sock is None and port == 0:
        raise RuntimeError(f"could not bind {listen}")
    await server.start()
    if sock is not None:
        os.chmod(sock, 0o600)
    return (listen if sock is not None else f"{listen.rsplit(':', 1)[0]}:{port}"), sock


DRAIN_IDLE_S = 2.0  # a session not called for this long while draining has no caller left to finish it


async def _drain(sessions: SessionTable, drain_s: float, service_name: str) -> None:
    """No new session from now on (Draining); the held ones that are still called get up to
    `drain_s` to end (one idle for DRAIN_IDLE_S, its gateway gone, is not waited for)."""
    sessions.draining = True
    if len(sessions):
        log.info("%s draining: %d session(s) to finish (up to %g s)", service_name, len(sessions), drain_s)
    deadline = time.monotonic() + drain_s
    while sessions.active(DRAIN_IDLE_S) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if len(sessions):
        log.warning("%s stops with %d session(s) left after its %g s drain", service_name, len(sessions), drain_s)


async def _unless_stopped(work: Awaitable[None], stop: asyncio.Event) -> bool:
    """Runs `work` unless `stop` is set first (a SIGTERM during a long warm-up or while waiting for
    backends); returns whether it finished. Its exceptions propagate."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False
    task.result()
    return True
