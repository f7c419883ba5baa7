"""OpenTelemetry for the three services, set up in one place from the standard OTEL_* variables.

Traces are off unless configured: `OTEL_TRACES_EXPORTER` (otlp, otlp_json_file, console, none;
comma-separated) or an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` /
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, which imply otlp) or `SPECSPLIT_OTLP_FILE` (implies
otlp_json_file). OTLP goes over gRPC unless `OTEL_EXPORTER_OTLP_PROTOCOL` (or the per-signal
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `_METRICS_PROTOCOL`) says http/protobuf. Off, no
interceptor is installed and every span call is the API's no-op.
`OTEL_SERVICE_NAME` replaces the service's own name (specsplit-gateway/-verify/-draft),
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER(_ARG)` and `OTEL_BSP_*` work as in every SDK.
Metrics: `OTEL_METRICS_EXPORTER=otlp` pushes over OTLP, `SPECSPLIT_METRICS_PORT` (or the servers'
--metrics-port) serves a Prometheus scrape endpoint; with neither the instruments are no-ops.

W3C trace context travels in gRPC metadata (`traceparent`): the gateway's client interceptor
injects it and every server's interceptor continues the trace, so one Generate is one trace across
three processes."""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry import metrics, trace
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger("specsplit.serving.telemetry")
TRACER = "specsplit"
COMPUTE_MS = "specsplit.compute_ms"  # server span attribute: pure model compute of the call
REQUEST_BYTES, RESPONSE_BYTES = "rpc.request.size", "rpc.response.size"


@dataclass
class Telemetry:
    tracing: bool = False
    metrics: bool = False
    shutdown_hooks: list[Callable[[], None]] = field(default_factory=list)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [_ServerSpans()] if self.tracing else []

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return [_ClientSpans()] if self.tracing else []

    def shutdown(self) -> None:
        """Flushes and stops the exporters (spans still queued are sent)."""
        for hook in self.shutdown_hooks:
            try:
                hook()
            except Exception as e:  # never fail a shutdown over telemetry
                log.warning("telemetry shutdown: %s", e)
        self.shutdown_hooks.clear()


_configured: Telemetry | None = None


def configure(service: str, metrics_port: int = 0, env: dict | None = None) -> Telemetry:
    """Sets up tracing and metrics for this process once (later calls return the first result)."""
    global _configured
    if _configured is not None:
        return _configured
    env = os.environ if env is None else env
    telemetry = Telemetry()
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        _configured = telemetry
        return telemetry
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({} if env.get("OTEL_SERVICE_NAME") else {"service.name": service})
    exporters = _trace_exporters(env)
    if exporters:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=resource)
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        telemetry.tracing = True
        telemetry.shutdown_hooks.append(provider.shutdown)
    readers = _metric_readers(env, metrics_port or int(env.get("SPECSPLIT_METRICS_PORT", "0") or 0))
    if readers:
        from opentelemetry.sdk.metrics import MeterProvider

        provider = MeterProvider(metric_readers=readers, resource=resource)
        metrics.set_meter_provider(provider)
        telemetry.metrics = True
        telemetry.shutdown_hooks.append(provider.shutdown)
    _configured = telemetry
    return telemetry


def _trace_exporters(env) -> list:
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            names.append("otlp")
        if env.get("SPECSPLIT_OTLP_FILE"):
            names.append("otlp_json_file")
    exporters = []
    for name in names:
        if name == "none":
            continue
        if name == "otlp":
            if otlp_protocol(env, "TRACES") == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporters.append(OTLPSpanExporter())
        elif name == "otlp_json_file":
            exporters.append(OtlpJsonFileExporter(env.get("SPECSPLIT_OTLP_FILE", "specsplit-traces.jsonl")))
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER {name!r}: use otlp, otlp_json_file, console or none")
    return exporters


def otlp_protocol(env, signal: str) -> str:
    """OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL: grpc (the default) or
    http/protobuf (each exporter then reads its own endpoint variables, as every SDK does)."""
    protocol = (env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r}: use grpc or http/protobuf "
                         "(the Python exporters have no http/json)")
    return protocol


def _metric_readers(env, port: int) -> list:
    readers = []
    names = [n.strip() for n in env.get("OTEL_METRICS_EXPORTER", "").split(",") if n.strip()]
    if "otlp" in names:
        if otlp_protocol(env, "METRICS") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if port:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        start_http_server(port, addr=env.get("SPECSPLIT_METRICS_HOST", "127.0.0.1"))
        readers.append(PrometheusMetricReader())
    return readers


def shutdown() -> None:
    """Flushes and stops this process's exporters, if configure() set any up."""
    if _configured is not None:
        _configured.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER)


def meter() -> metrics.Meter:
    return metrics.get_meter(TRACER)


class OtlpJsonFileExporter:
    """OTLP/JSON lines for machines without a collector: one ExportTraceServiceRequest per line
    (the OTel file-exporter format; ids as hex). Processes may share the file: each batch is one
    O_APPEND write."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> object:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.trace.export import SpanExportResult

        message = MessageToDict(encode_spans(spans))
        for resource in message.get("resourceSpans", []):
            for scope in resource.get("scopeSpans", []):
                for span in scope.get("spans", []):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in span:
                            span[key] = base64.b64decode(span[key]).hex()
        line = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _method_attributes(method: str) -> dict:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


class _Metadata:
    """W3C trace context in gRPC metadata."""

    @staticmethod
    def get(carrier, key):
        return [v for k, v in carrier if k == key] or None

    @staticmethod
    def keys(carrier):
        return [k for k, _ in carrier]


class _ServerSpans(grpc.aio.ServerInterceptor):
    """A SERVER span per call, continuing the caller's trace, with message sizes and status."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(("/grpc.health", "/grpc.reflection")):
            return handler
        parent = extract(details.invocation_metadata or (), getter=_Metadata)
        name = details.method.lstrip("/")
        attributes = _method_attributes(details.method)

        def start(request):
            span = tracer().start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
            span.set_attribute(REQUEST_BYTES, request.ByteSize())
            return span

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                span = start(request)
                with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
                    try:
                        response = await inner(request, context)
                    except BaseException as e:
                        _server_error(span, context, e)
                        raise
                    span.set_attribute(RESPONSE_BYTES, response.ByteSize())
                    _server_status(span, context)
                    return response

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                span = start(request)
                sent = 0
                with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
                    try:
                        async for response in inner_stream(request, context):
                            sent += response.ByteSize()
                            yield response
                    except BaseException as e:
                        _server_error(span, context, e)
                        raise
                    span.set_attribute(RESPONSE_BYTES, sent)
                    _server_status(span, context)

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler


def _server_status(span, context) -> None:
    code = context.code()
    if code is not None and code != grpc.StatusCode.OK:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.set_status(Status(StatusCode.ERROR, context.details() or code.name))
    else:
        span.set_attribute("rpc.grpc.status_code", 0)


def _server_error(span, context, error: BaseException) -> None:
    code = context.code()  # set by context.abort before it raises
    if code is not None and code != grpc.StatusCode.OK:
        _server_status(span, context)
    else:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


class _ClientSpans(grpc.aio.UnaryUnaryClientInterceptor):
    """A CLIENT span per upstream call, carrying the trace context to the server."""

    async def intercept_unary_unary(self, continuation, details, request):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.startswith(("/grpc.health", "/grpc.reflection")):
            return await continuation(details, request)
        with tracer().start_as_current_span(method.lstrip("/"), kind=SpanKind.CLIENT,
                                            attributes=_method_attributes(method), record_exception=False,
                                            set_status_on_exception=False) as span:
            span.set_attribute(REQUEST_BYTES, request.ByteSize())
            metadata = list(details.metadata or ())
            carrier: dict[str, str] = {}
            inject(carrier)
            metadata += list(carrier.items())
            details = grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                                 details.wait_for_ready)
            call = await continuation(details, request)
            try:
                response = await call
            except grpc.aio.AioRpcError as e:
                span.set_attribute("rpc.grpc.status_code", e.code().value[0])
                span.set_status(Status(StatusCode.ERROR, e.details() or e.code().name))
                raise
            span.set_attribute(RESPONSE_BYTES, response.ByteSize())
            span.set_attribute("rpc.grpc.status_code", 0)
            return response


def record_compute(ns: int) -> None:
    """The current server span's pure model compute (forward or drafting), in ms."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(COMPUTE_MS, ns / 1e6)

