"""Traces across the three real service processes, received by an in-test OTLP/gRPC collector built
on the published OTLP service definitions (opentelemetry-proto), and the OTLP-JSON file exporter."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as otlp_metrics
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as otlp_metrics_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.bench.tracereport import Span, load_otlp_request, requests_from
from specsplit.launcher import Stack, StackConfig

GENERATE = "specsplit.gateway.v1.Gateway/Generate"


class Collector(otlp_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[Span] = []
        self.metrics: dict[str, set[str]] = defaultdict(set)  # service -> metric names
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            self.spans += load_otlp_request(request)
        return otlp.ExportTraceServiceResponse()


class MetricsCollector(otlp_metrics_grpc.MetricsServiceServicer):
    def __init__(self, sink: Collector):
        self.sink = sink
        self.totals: dict[tuple, float] = {}  # (service, metric, attributes) -> cumulative sum or count

    def Export(self, request, context):
        for resource in request.resource_metrics:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            for scope in resource.scope_metrics:
                self.sink.metrics[service] |= {m.name for m in scope.metrics if _has_points(m)}
                for metric in scope.metrics:
                    kind = metric.WhichOneof("data")
                    for point in getattr(metric, kind).data_points if kind else ():
                        attrs = frozenset((a.key, _value(a.value)) for a in point.attributes)
                        value = point.count if kind == "histogram" else _value(point)
                        self.totals[(service, metric.name, attrs)] = value  # cumulative: the last export holds all
        return otlp_metrics.ExportMetricsServiceResponse()

    def total(self, service: str, name: str, **attrs) -> float:
        """The metric's cumulative value summed over the series that carry `attrs`."""
        wanted = set(attrs.items())
        return sum(v for (svc, metric, a), v in self.totals.items() if (svc, metric) == (service, name) and wanted <= a)


def _value(message):
    """An OTLP AnyValue's or number data point's value."""
    return getattr(message, message.WhichOneof("value"))


def _has_points(metric) -> bool:
    kind = metric.WhichOneof("data")
    return bool(kind and getattr(metric, kind).data_points)


@pytest.fixture
def collector():
    """Starts an OTLP receiver speaking the given protocol (what OTEL_EXPORTER_OTLP_PROTOCOL tells
    the services): the gRPC services, or POSTs of protobuf to /v1/traces and /v1/metrics."""
    stops = []

    def start(protocol: str) -> tuple[Collector, MetricsCollector, int]:
        sink = Collector()
        metrics = MetricsCollector(sink)
        if protocol == "grpc":
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            otlp_grpc.add_TraceServiceServicer_to_server(sink, server)
            otlp_metrics_grpc.add_MetricsServiceServicer_to_server(metrics, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            stops.append(lambda: server.stop(0))
        else:
            server = _http_receiver(sink, metrics)
            port = server.server_address[1]
            stops.append(server.shutdown)
        return sink, metrics, port

    yield start
    for stop in stops:
        stop()


def _http_receiver(sink: Collector, metrics: MetricsCollector) -> ThreadingHTTPServer:
    routes = {"/v1/traces": (otlp.ExportTraceServiceRequest, sink.Export, otlp.ExportTraceServiceResponse),
              "/v1/metrics": (otlp_metrics.ExportMetricsServiceRequest, metrics.Export,
                              otlp_metrics.ExportMetricsServiceResponse)}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            message, export, response = routes[self.path]
            assert self.headers["Content-Type"] == "application/x-protobuf"
            export(message.FromString(self.rfile.read(int(self.headers["Content-Length"]))), None)
            body = response().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _generate(stub, prompt: str, speculation=pb.SPECULATION_ON, **kw) -> pb.GenerateResponse:
    # Without pre-drafting: one protocol per run (test_predraft covers pre-drafting).
    kw.setdefault("predraft", pb.PREDRAFT_OFF)
    return stub.Generate(pb.GenerateRequest(text=prompt, max_new_tokens=24, speculation=speculation,
                                            stop=pb.StopConditions(ignore_eos=True), task_type="test", **kw),
                         timeout=120)


def _stack(models, tmp_path, transport: str) -> Stack:
    return Stack(StackConfig(transport=transport, target_model=str(models["target"]),
                             draft_model=str(models["draft"]), dtype="float32", draft_dtype="float32",
                             drafter="ngram", self_head="none", run_dir=str(tmp_path)))


@pytest.mark.parametrize("transport,protocol", [("unix", "grpc"), ("tcp", "http/protobuf")])
def test_one_trace_per_generate_across_three_processes(models, tmp_path, collector, monkeypatch, transport,
                                                       protocol):
    sink, metrics, port = collector(protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    responses = []
    with _stack(models, tmp_path, transport) as stack:
        with grpc.insecure_channel(stack.start()) as channel:
            stub = pb_grpc.GatewayStub(channel)
            for prompt, drafter in (("def add(a, b):", "model"), ("The quick brown fox", "ngram")):
                responses.append(_generate(stub, prompt, drafter=drafter, gamma=3))
            responses.append(_generate(stub, "Once upon a time", pb.SPECULATION_OFF))
    # The stack stopped: every process flushed its spans on SIGTERM.
    by_trace = defaultdict(list)
    for span in sink.spans:
        by_trace[span.trace_id].append(span)
    roots = [s for s in sink.spans if s.name == GENERATE]
    assert len(roots) == len(responses) == len({s.trace_id for s in roots})  # one trace per Generate
    others = [v for t, v in by_trace.items() if t not in {r.trace_id for r in roots}]
    assert all(s.name.endswith("/Info") for v in others for s in v)  # only the gateway's start-up checks
    assert {s.service for s in sink.spans} == {"specsplit-gateway", "specsplit-verify", "specsplit-draft"}
    requests = requests_from(sink.spans)
    for response, root in zip(responses, sorted(roots, key=lambda s: s.start_ns)):
        spans = {s.span_id: s for s in by_trace[root.trace_id]}
        assert root.parent_id == "" and root.attributes["specsplit.transport.draft"] == transport
        rounds = sorted((s for s in spans.values() if s.name == "round"), key=lambda s: s.start_ns)
        assert all(spans[s.parent_id] is root for s in rounds)
        assert len(rounds) == response.stats.rounds
        # The round spans carry the gateway's accounting, the very figures of the response's stats.
        for span, record in zip(rounds, response.stats.round_records):
            for field in ("drafted", "accepted"):
                assert span.attributes[f"specsplit.{field}"] == getattr(record, field)
            for field in ("draft_ms", "verify_ms", "network_ms", "gateway_ms"):
                assert span.attributes[f"specsplit.{field}"] == pytest.approx(getattr(record, field))
            assert (span.end_ns - span.start_ns) / 1e6 == pytest.approx(record.round_ms, abs=0.01)
        assert all(a.end_ns <= b.start_ns + 1000 for a, b in zip(rounds, rounds[1:]))  # one after another
        for server in (s for s in spans.values() if s.kind == "server" and s is not root):
            client = spans[server.parent_id]  # the matching client span, in the gateway's process
            assert client.kind == "client" and client.name == server.name and client.service == "specsplit-gateway"
            assert server.service == ("specsplit-draft" if ".draft." in server.name else "specsplit-verify")
            releasing = server.name.endswith(("/Release", "/EndSession"))
            assert server.name.endswith(("/Release", "/EndSession", "/Prefill", "/StartSession")), server.name
            assert spans[client.parent_id].name == (GENERATE if releasing else "prefill")
            assert client.end_ns - client.start_ns >= server.end_ns - server.start_ns  # network time >= 0
            assert server.attributes["rpc.request.size"] == client.attributes["rpc.request.size"]
            if server.name.endswith("/Prefill"):
                assert 0 < server.attributes["specsplit.compute_ms"] <= (server.end_ns - server.start_ns) / 1e6
        report = next(r for r in requests if r.trace_id == root.trace_id)
        assert report.speculation == ("on" if response.stats.speculation_used else "off")
        assert report.tokens == response.stats.generated_tokens
        assert report.network_ms == pytest.approx(response.stats.network_ms)  # one definition, both places
        assert report.verify_ms == pytest.approx(response.stats.verify_ms + response.stats.prefill_compute_ms)
    # Metrics went over OTLP too (flushed at shutdown), with the responses' own figures.
    assert {"specsplit.acceptance_length", "specsplit.request.duration", "specsplit.round.network",
            "specsplit.round.gateway", "specsplit.speculation.enabled", "specsplit.spec_decode.drafts",
            "specsplit.request.time_to_first_token", "specsplit.request.time_per_output_token",
            "specsplit.requests"} <= sink.metrics["specsplit-gateway"]
    assert "specsplit.draft.memory" in sink.metrics["specsplit-draft"]
    assert {"specsplit.verify.forward", "specsplit.verify.sessions",
            "specsplit.verify.kv_cache.limit"} <= sink.metrics["specsplit-verify"]
    gateway = "specsplit-gateway"
    stats = [r.stats for r in responses]
    # Drafts: the rounds that carried some, and the verifier's forwards that verified its own lookup
    # (n-gram requests draft in the verifier); the stats' token totals count both alike.
    for name, field in (("drafts", None), ("draft_tokens", "drafted_tokens"), ("accepted_tokens", "accepted_tokens")):
        expected = sum(sum(bool(r.drafted) + r.lookup_steps for r in s.round_records) if field is None
                       else getattr(s, field) for s in stats)
        assert metrics.total(gateway, f"specsplit.spec_decode.{name}") == expected > 0, name
    # Per draft position: every drafting round reached position 1; accepted there = rounds with >= 1 accepted.
    rounds = [r for s in stats for r in s.round_records if r.drafted]
    assert metrics.total(gateway, "specsplit.spec_decode.drafts_per_position", draft_position=1) == len(rounds)
    assert metrics.total(gateway, "specsplit.spec_decode.accepted_tokens_per_position", draft_position=1) == \
        sum(1 for r in rounds if r.accepted >= 1)
    assert sum(metrics.total(gateway, "specsplit.spec_decode.accepted_tokens_per_position", draft_position=d)
               for d in range(1, 5)) == sum(r.accepted for r in rounds)  # chains of gamma 3
    assert metrics.total(gateway, "specsplit.requests", status="OK", finish_reason="length") == len(responses)
    assert metrics.total(gateway, "specsplit.request.time_to_first_token") == len(responses)
    assert metrics.total(gateway, "specsplit.request.time_per_output_token", speculation="off") == 1
    # The verify service's forwards: one Prefill per request, every round's verify (and warm-up's).
    verify = "specsplit-verify"
    assert metrics.total(verify, "specsplit.verify.forward", call="prefill") == len(responses)
    assert metrics.total(verify, "specsplit.verify.forward", call="verify") >= sum(s.rounds for s in stats)
    assert metrics.total(verify, "specsplit.verify.sessions.limit") > 0
    assert metrics.total(verify, "specsplit.verify.kv_cache.limit") > 0


def test_json_file_exporter_writes_otlp_json_lines(models, tmp_path, monkeypatch):
    trace_file = tmp_path / "traces.jsonl"
    monkeypatch.setenv("SPECSPLIT_OTLP_FILE", str(trace_file))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    with _stack(models, tmp_path, "unix") as stack:
        with grpc.insecure_channel(stack.start()) as channel:
            response = _generate(pb_grpc.GatewayStub(channel), "def add(a, b):", drafter="ngram")
    lines = trace_file.read_text().splitlines()
    assert all("resourceSpans" in json.loads(line) for line in lines)
    from specsplit.bench.tracereport import load_file

    spans = load_file(trace_file)
    assert {s.service for s in spans} == {"specsplit-gateway", "specsplit-verify", "specsplit-draft"}
    (request,) = requests_from(spans)
    assert request.rounds == response.stats.rounds and len(request.trace_id) == 32
